"""Where llama.cpp puts a model's layers, shared by the in-process engine and llama-server:
how many to offload for a cell, and what llama.cpp's own load log says it did."""

from __future__ import annotations

import re
from typing import Any


def gpu_layers(gpu: str, asked: int | None) -> int:
    """Layers to offload: none for gpu: cpu; what the experiment says; else all of them."""
    if gpu == "cpu":
        return 0
    return -1 if asked is None else asked


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
#: backends named in llama.cpp's system info ('CUDA : ARCHS = 900 | ... | CPU : SSE3 = 1 | ...')
_BACKEND = re.compile(r"(?:^|\|)\s*([A-Za-z][\w-]*) : ")


def offload_state(load_log: str, offload_built: bool, asked: int, system_info: str,
                  layers: int | None = None) -> dict[str, Any]:
    """Where llama.cpp (or llama-server) put the model's layers, from its own load log: the in_force()
    state (harness.run.enforced). llama.cpp says 'offloaded N/M layers to GPU' when it loads a model."""
    found = _OFFLOADED.findall(load_log)
    backends = [b for b in dict.fromkeys(_BACKEND.findall(system_info)) if b != "CPU"]
    state: dict[str, Any] = {}
    if found:
        done, total = (int(x) for x in found[-1])
        state |= {"offloaded_layers": done, "model_layers": total}
    elif not offload_built or asked == 0:
        state["offloaded_layers"] = 0
        if layers:
            state["model_layers"] = layers
    else:
        return {"backend": ", ".join(backends) or "CPU"}  # nothing said: where it ran is unknown
    gpu = state["offloaded_layers"] > 0
    state |= {"device_kind": "gpu" if gpu else "cpu", "backend": ", ".join(backends) if gpu and backends else "CPU"}
    of = f" of {state['model_layers']}" if "model_layers" in state else ""
    if not offload_built:
        why = ("this llama.cpp build has no GPU offload (llama_supports_gpu_offload() is false); "
               "install a CUDA build, e.g. CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall llama-cpp-python")
    elif asked == 0:
        why = "n_gpu_layers is 0"
    else:
        why = "llama.cpp found no GPU to put them on"
    state["device_note"] = f"offloaded {state['offloaded_layers']}{of} layers: {why}" if not gpu else (
        f"offloaded {state['offloaded_layers']}{of} layers to {state['backend']}")
    return state
