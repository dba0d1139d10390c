"""Every provenance field of a row, declared once with its roles: where and with what the row was made.

The pairing rule (metrics: a run and its reference, batch-invariant twins, two folders compared),
the `--allow-mixed` names, the machine label, the rows a rerun may keep (checkpoints, stale cells),
the context the report and `harness compare` show, and the columns read as categoricals all derive
from `FIELDS`. A field's type is the row schema's (harness.results.schema.ROW_SCHEMA).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """One provenance column of a row and what it is used for."""

    name: str
    #: rows paired for a comparison must agree in it, unless `--allow-mixed PAIRS` is given
    #: ("" = never checked); several fields under one name are checked as one (the machine: "host")
    pairs: str = ""
    #: a row kept from an earlier run (a checkpoint, a stale cell) must have the value of the load
    #: about to run: the same engine build and model file, the same harness and libraries, on the
    #: same machine and driver (every pairing field, and the versions that could change a row)
    same_load: bool = False
    #: shown as the context of a folder: the report's header, and what `compare` lists when it differs
    context: bool = False


#: in row order; the machine's fields in the order its label names them (host, GPU uuid, driver, CUDA)
FIELDS: tuple[Field, ...] = (
    Field("model_file"),
    Field("model_sha256", pairs="model_sha256", same_load=True, context=True),
    Field("engine_version", pairs="engine_version", same_load=True, context=True),
    Field("schema_version", pairs="schema_version", same_load=True, context=True),
    # what ran (harness.run.enforced): compared with what was asked, not paired on
    Field("device"),
    Field("device_uuid"),
    Field("backend"),
    Field("attention_backend"),
    Field("host", pairs="host", same_load=True, context=True),
    Field("gpu_uuid", pairs="host", same_load=True),
    Field("gpu_driver", pairs="host", same_load=True, context=True),
    Field("cuda_version", pairs="host", same_load=True, context=True),
    Field("platform", context=True),
    Field("cpu", context=True),
    Field("cpu_count", context=True),
    Field("gpu_name", context=True),
    Field("gpu_count", context=True),
    Field("gpu_compute_cap"),
    Field("library_versions", same_load=True, context=True),
    Field("python_version", context=True),
    Field("python_executable", context=True),  # the interpreter its worker ran under (the environment axis)
    Field("harness_version", same_load=True, context=True),
    Field("git_commit", same_load=True, context=True),
    # the chat template the engine applied is read from its info (metrics.chat_template_of); the
    # whole info (the build's system info or binary hash, its settings in force) is the load's identity
    Field("engine_info", pairs="chat_template", same_load=True),
    # the CPU kernels that computed (llama.cpp: AMX / repacked weights / llamafile / plain): two paths
    # can give different logits on one model and build
    Field("cpu_kernels", pairs="cpu_kernels", same_load=True, context=True),
    Field("env", same_load=True),  # the engine variables (VLLM_, CUDA_, OMP_, ...) its worker ran with
    Field("job_id"),
    Field("job_array_index"),
)

NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
#: what `--allow-mixed` may name: each must agree between paired rows unless named
MIXABLE: tuple[str, ...] = tuple(dict.fromkeys(f.pairs for f in FIELDS if f.pairs))
#: the columns the pairing rule reads
PAIRED: tuple[str, ...] = tuple(f.name for f in FIELDS if f.pairs)
#: the columns that together say which machine made a row (the 'host' of MIXABLE)
MACHINE: tuple[str, ...] = tuple(f.name for f in FIELDS if f.pairs == "host")
#: what a kept row must share with the load about to run
SAME_LOAD: tuple[str, ...] = tuple(f.name for f in FIELDS if f.same_load)
#: shown as a folder's context
CONTEXT: tuple[str, ...] = tuple(f.name for f in FIELDS if f.context)
