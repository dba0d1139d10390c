"""What ran, not what was asked: the state an engine reports as in force, as row columns, and
the rule that fails a cell whose state contradicts its settings.

A row's setting columns (`gpu`, `batch_invariant`, ...) say what the experiment asked for. On a
cluster that is not always what ran: a llama.cpp build without GPU offload computes every token
on the CPU of an A100 node, a vLLM worker may leave the batch-invariant kernels off. Each engine
reports what it put in force (`Engine.in_force`, keys of IN_FORCE); the worker turns that into
the columns below and fails the cell, naming both sides, when the two disagree.
"""

from __future__ import annotations

import os
from typing import Any

from harness.core import gpu_names

#: the keys an engine's in_force() may give, each what it means; a key left out is unknown
IN_FORCE: dict[str, str] = {
    "device_kind": "'cpu' or 'gpu': where the model's layers were computed",
    "backend": "the engine's compute backend (llama.cpp: CPU, CUDA, Metal...; vLLM: its platform)",
    "offloaded_layers": "layers the engine put on the GPU (llama.cpp)",
    "model_layers": "layers the model has, counted as the engine counts offloadable ones (llama.cpp)",
    "batch_invariant_active": "whether the batch-invariant kernels were on in the model worker (vLLM)",
    "cuda_graphs": "whether CUDA graphs were captured (false: eager mode) (vLLM)",
    "tensor_parallel_size": "GPUs one model was split over (vLLM)",
    "attention_backend": "the attention backend the engine chose (vLLM)",
    "device_note": "how the engine came to run where it did, for the message of a contradiction",
    "batch_invariant_note": "why batch_invariant_active is unknown, where it is",
}

#: the row columns that say what ran (schema 5); `device` is 'cpu' or the GPU's name
ROW_COLUMNS = ("device", "device_uuid", "backend", "offloaded_layers", "model_layers", "batch_invariant_active",
               "cuda_graphs", "tensor_parallel_size", "attention_backend")


def visible_gpus(gpus: list[dict[str, str]], environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The GPUs this process may use: the node's, narrowed by CUDA_VISIBLE_DEVICES (indices or UUIDs),
    as SLURM and PBS set it for a task given some of a node's GPUs."""
    environ = os.environ if environ is None else environ
    wanted = environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        return list(gpus)
    out = []
    for item in (w.strip() for w in wanted.split(",")):
        if item.isdigit() and int(item) < len(gpus):
            out.append(gpus[int(item)])
        elif item.startswith(("GPU-", "MIG-")):
            out += [g for g in gpus if g.get("uuid", "").startswith(item)]
        elif item == "" or item.startswith("-"):
            break  # CUDA stops at the first invalid entry
    return out


def columns(state: dict[str, Any], gpus: list[dict[str, str]]) -> dict[str, Any]:
    """The row columns for an engine's reported state, with the GPU used named from the node's GPUs."""
    kind = state.get("device_kind")
    used = visible_gpus(gpus)[: max(1, int(state.get("tensor_parallel_size") or 1))] if kind == "gpu" else []
    device = "cpu" if kind == "cpu" else ", ".join(g.get("name", "") for g in used) or ("gpu" if kind else None)
    return {
        "device": device,
        "device_uuid": ", ".join(g.get("uuid", "") for g in used) or None,
        **{k: state.get(k) for k in ROW_COLUMNS[2:]},
    }


def contradiction(engine: str, gpu: str, batch_invariant: bool, state: dict[str, Any],
                  cols: dict[str, Any]) -> str | None:
    """Why what ran (`state`, `cols`) contradicts what the cell asked for; None when it does not."""
    kind, device = state.get("device_kind"), cols.get("device")
    asked = f"asked gpu {gpu}"
    if gpu == "cpu" and kind == "gpu":
        return f"{asked}; {engine} ran on {device}: {state.get('device_note', 'the GPU')}"
    if gpu not in ("cpu", "any"):
        if kind == "cpu":
            return f"{asked}; {engine} {state.get('device_note', 'ran on the CPU')}"
        if kind == "gpu" and device not in (None, "gpu") and not any(
                gpu_names.matches(gpu, name.strip()) for name in str(device).split(",")):
            return f"{asked}; {engine} ran on {device} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
    active = state.get("batch_invariant_active", "absent")
    if active != "absent" and active is not batch_invariant and (active is not None or batch_invariant):
        if active is None:
            return (f"asked batch_invariant {str(batch_invariant).lower()}; {engine} could not tell whether the "
                    f"batch-invariant kernels are on ({state.get('batch_invariant_note', 'not reported')})")
        return (f"asked batch_invariant {str(batch_invariant).lower()}; {engine}'s model worker reports the "
                f"batch-invariant kernels {'on' if active else 'off'}")
    return None


def device_environment(gpu: str, gpus: list[dict[str, str]], count: int = 1,
                       environ: dict[str, str] | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a group's worker and the servers it starts. `gpu: cpu` sees no GPU (a
    CUDA build of llama.cpp would otherwise offload large prefill batches to one, while the rows say
    cpu); a GPU type sees the first `count` visible GPUs of that type, by UUID (llama.cpp would
    otherwise split the layers over every visible GPU); `any` is left as it is."""
    if gpu == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if gpu == "any":
        return {}
    chosen = [g for g in visible_gpus(gpus, environ) if gpu_names.matches(gpu, g.get("name", ""))][:max(1, count)]
    ids = [g.get("uuid", "") for g in chosen]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)} if chosen and all(ids) else {}
