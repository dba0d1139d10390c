"""The row contract: every column a row has, its type and order on disk, and the schema version
(docs/rows.md). Declared once; the store writes it, readers read by it."""

from __future__ import annotations

import pyarrow as pa

from harness.experiment.axes import AXES_DECLARED
from harness.results import provenance_fields

#: 2 added token_texts and the probe_* columns; 3 the answer_* columns; 4 the prefix_cache,
#: context_tokens, prefill_chunk and kv_cache_dtype axes, cached_tokens, context_tokens_used,
#: logprobs_hash and the prefill_probe_* columns; 5 what ran (harness.run.enforced: device, backend,
#: offloaded layers, batch-invariant kernels, CUDA graphs, tensor parallelism, attention backend);
#: 6 seed_check (the seed control's verdict); 7 run_key (what one run depends on: harness.run.reuse);
#: 8 prefill_probe_kl_mean and prefill_probe_kl_max (exact KL of decode vs one prefill, per step);
#: 9 cpu_kernels (llama.cpp's CPU kernel path: extra buffer types in use, build features, llamafile);
#: 10 boot and load_id (the engine load a run came from: cross-boot repeats), python_executable
#: (the interpreter a worker ran under: the environment axis); 11 the kv_cache_tokens and draft_tokens
#: axes, preemptions, batch_preemptions, draft_proposed, draft_accepted and itl_s (serving under load: harness.analysis.latency);
#: 12 load_s and warmup_s (the engine's start-up and the cell's warm-up, shown beside the slowdown).
#: Older files read back with the newer columns empty, and the newer axes at their defaults (what
#: those files were run with).
SCHEMA_VERSION = 12

#: The row contract (docs/rows.md). Order here is the column order on disk.
ROW_SCHEMA = pa.schema(
    [
        # identity
        ("schema_version", pa.int16()),
        ("experiment", pa.string()),
        ("run_id", pa.string()),
        ("cell_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("repeat", pa.int32()),
        ("batch_position", pa.int32()),
        ("filler_ids", pa.list_(pa.string())),
        ("run_key", pa.string()),
        # the engine load that made the run: its boot (of the experiment's `boots`) and a load id
        # unique to that worker process (runs with one load id shared an engine load)
        ("boot", pa.int32()),
        ("load_id", pa.string()),
        # settings: one column per declared axis (harness.experiment.axes), named and typed by it
        *[(axis.name, getattr(pa, axis.arrow)()) for axis in AXES_DECLARED],
        ("max_tokens", pa.int32()),
        ("engine_options", pa.string()),
        ("model_file", pa.string()),
        ("model_sha256", pa.string()),
        ("engine_version", pa.string()),
        # outcome
        ("status", pa.string()),
        ("error", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("context_tokens_used", pa.int32()),
        ("cached_tokens", pa.int32()),
        # what the engine's scheduler did to the target: preempted (and recomputed) so many times, and
        # with speculative decoding the tokens drafted for it and accepted; empty where not reported
        ("preemptions", pa.int32()),
        ("batch_preemptions", pa.int32()),
        ("draft_proposed", pa.int32()),
        ("draft_accepted", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("n_tokens", pa.int32()),
        ("text", pa.string()),
        ("token_texts", pa.list_(pa.string())),
        ("finish_reason", pa.string()),
        ("output_hash", pa.string()),
        ("logprobs", pa.list_(pa.float32())),
        ("margins", pa.list_(pa.float32())),
        ("logprobs_hash", pa.string()),
        ("engine_detail", pa.string()),
        # what ran (harness.run.enforced), beside the settings asked for
        ("device", pa.string()),
        ("device_uuid", pa.string()),
        ("backend", pa.string()),
        ("offloaded_layers", pa.int32()),
        ("model_layers", pa.int32()),
        ("batch_invariant_active", pa.bool_()),
        ("cuda_graphs", pa.bool_()),
        ("tensor_parallel_size", pa.int32()),
        ("attention_backend", pa.string()),
        # the seed control's verdict (harness.run.seed_control; empty: not asked for, or greedy)
        ("seed_check", pa.string()),
        # answers (prompts that give an answer and/or a parse rule)
        ("answer_parsed", pa.string()),
        ("answer_expected", pa.string()),
        ("answer_correct", pa.bool_()),
        # logit probes (probe_logits: true), against the same prompt decoded alone
        ("probe_reference", pa.string()),
        ("probe_steps", pa.int32()),
        ("probe_steps_differed", pa.int32()),
        ("probe_first_diff_step", pa.int32()),
        ("probe_logits_compared", pa.int64()),
        ("probe_logits_differed", pa.int64()),
        ("probe_max_abs_diff", pa.float64()),
        ("probe_low_margin_frac", pa.float64()),
        ("prefill_probe_steps", pa.int32()),
        ("prefill_probe_steps_differed", pa.int32()),
        ("prefill_probe_first_diff_step", pa.int32()),
        ("prefill_probe_max_abs_diff", pa.float64()),
        ("prefill_probe_kl_mean", pa.float64()),
        ("prefill_probe_kl_max", pa.float64()),
        # timing
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("prefill_s", pa.float64()),
        ("ttft_s", pa.float64()),
        # gaps between successive output tokens of the target as the caller received them (inter-token
        # latency); empty where the engine hands the output over only at the end
        ("itl_s", pa.list_(pa.float32())),
        ("decode_s", pa.float64()),
        ("wall_s", pa.float64()),
        # start-up, outside every timing above: the engine load that made the run (imports, weights,
        # compile, CUDA graph capture) and its cell's untimed warm-up batch (a batch shape's first use)
        ("load_s", pa.float64()),
        ("warmup_s", pa.float64()),
        ("target_tokens_per_s", pa.float64()),
        ("batch_tokens_per_s", pa.float64()),
        # provenance
        ("host", pa.string()),
        ("platform", pa.string()),
        ("cpu", pa.string()),
        ("cpu_count", pa.int32()),
        ("gpu_name", pa.string()),
        ("gpu_count", pa.int32()),
        ("gpu_driver", pa.string()),
        ("gpu_uuid", pa.string()),
        ("gpu_compute_cap", pa.string()),
        ("cuda_version", pa.string()),
        ("library_versions", pa.string()),
        ("python_version", pa.string()),
        ("python_executable", pa.string()),
        ("harness_version", pa.string()),
        ("git_commit", pa.string()),
        ("engine_info", pa.string()),
        ("cpu_kernels", pa.string()),
        ("env", pa.string()),
        ("job_id", pa.string()),
        ("job_array_index", pa.string()),
    ]
)

#: text columns that say where and with what a row was made: the CLI's readers read them as
#: pandas categoricals (they only compare, group and list them, and a categorical does that
#: without hashing a million strings); by default they read back as Python strings
WHERE_MADE = tuple(n for n in provenance_fields.NAMES if ROW_SCHEMA.field(n).type == pa.string())

#: the key of a cell file's metadata that records its landing (run_id, writer, written_at, statuses)
LANDING_KEY = b"harness.landing"

#: statuses a rerun does not redo: the run happened, or the engine's declared rules refuse it
DONE_STATUSES = frozenset({"ok", "unsupported"})

#: columns every cell file has, whatever its schema version: a file without them is not one
CELL_FILE_COLUMNS = ("cell_id", "prompt_id", "repeat", "status")
