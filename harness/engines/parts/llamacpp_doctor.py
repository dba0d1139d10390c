"""llama.cpp's build seen by doctor: what it was compiled with, what a load of it needs, what to
say when it crashes, and the CPU kernel path a load takes (parts of harness.engines.llamacpp)."""

from __future__ import annotations

import importlib.util
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.core import native_preload
from harness.engines.base import (
    Finding,
    LoadSpec,
    Log,
)
from harness.engines.parts import cpu_kernels
from harness.engines.parts.child_probe import probe_in_child
from harness.engines.parts.llama_offload import gpu_layers
from harness.models import catalog as models

INSTALL_CUDA = ('CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF" pip install --force-reinstall --no-cache-dir '
                '--no-deps llama-cpp-python')
_PROBE = """
import json, llama_cpp as ll
from importlib import metadata
info = ll.llama_print_system_info().decode(errors="replace")
print(json.dumps({"version": metadata.version("llama-cpp-python"), "gpu_offload": bool(ll.llama_supports_gpu_offload()),
                  "system_info": info.strip()}))
"""


def backends(system_info: str) -> list[str]:
    """The ggml backends named in llama.cpp's system info ('CUDA : ARCHS = 900 | CPU : AVX2 = 1 | ...')."""
    return list(dict.fromkeys(re.findall(r"(?:^|\|\s*)([A-Za-z][A-Za-z0-9_]*) : ", system_info)))


class LlamaCppDoctor:
    """The llama.cpp engine's doctor-facing class methods (a mixin of LlamaCppEngine)."""

    @classmethod
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        facts = probe_in_child(_PROBE, timeout_s=60, preload=cls.native_package)
        if "system_info" in facts:
            facts["backends"] = backends(facts["system_info"])
        return facts

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        offload = "GPU offload compiled in" if facts["gpu_offload"] else "CPU only (no GPU offload compiled in)"
        return f"llama-cpp-python {facts['version']}, {offload}; backends {', '.join(facts['backends'])}"

    @classmethod
    def crash_hint(cls, spec: LoadSpec, signal_name: str, before: str = "") -> str:
        """For a build with a GPU backend: the backend, what was in the process before the engine and
        the preload, with the preload's fix where it was not in force; the CPU's kernels and the
        extra-buffer advice only for cells whose layers the CPU computes."""
        gpu_build = native_preload.backends(cls.native_package)
        on_gpu = bool(gpu_build) and gpu_layers(spec.gpu, spec.options.get("n_gpu_layers")) != 0
        natives, preload = native_preload.split_before(before)
        said = ["llama.cpp died in native code"]
        if gpu_build:
            said += [f"this build has a GPU backend ({', '.join(gpu_build)}) and the cell's layers were meant for the "
                     + ("GPU" if on_gpu else "CPU (gpu: cpu or n_gpu_layers: 0)"),
                     f"native libraries in the process before the engine: {natives or 'not recorded in the log'}",
                     f"native preload {preload or 'not recorded'}"]
            if not preload.startswith("on"):
                said.append(f"a GPU build can crash so where numpy or pyarrow loaded first (a stock CUDA + PyTorch "
                            f"image): leave {native_preload.SWITCH} unset (auto starts engine processes with the "
                            "GPU backend preloaded); see docs/gpu-nodes.md")
            elif on_gpu:
                said.append("the backend was preloaded and it still died: run 'harness doctor FILE', set "
                            "engine_options.llamacpp.verbose: true to keep llama.cpp's last words in the group's "
                            "log, and check that the build's CUDA architectures include this GPU's "
                            "(docs/gpu-nodes.md)")
        if not on_gpu:
            facts = probe_in_child(_PROBE, timeout_s=60, preload=cls.native_package)
            features = " ".join(cpu_kernels.build_features(facts.get("system_info", ""))) or "unknown"
            chosen = spec.options.get("extra_bufts", "auto")
            tries = ("engine_options.llamacpp.extra_bufts: off (no AMX or repacked kernels)" if chosen != "off" else
                     "a llama-cpp-python built for a plainer CPU (CMAKE_ARGS=\"-DGGML_NATIVE=OFF\")")
            said.append(f"this build uses CPU features {features} (extra_bufts {chosen}); try {tries}")
        return "; ".join(said)

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        found = []
        named_gpu = any(c["gpu"] not in ("any", "cpu") for c in cells)
        if wants_gpu and not facts["gpu_offload"]:
            found.append(Finding(cls.name, "this llama-cpp-python has no GPU offload compiled in: its cells "
                                 + ("that name a GPU type will fail (they would run on the CPU)" if named_gpu
                                    else "would run on the CPU"), False, INSTALL_CUDA))
        if options.get("n_gpu_layers") == 0 and named_gpu:
            found.append(Finding(cls.name, "n_gpu_layers: 0 keeps every layer on the CPU, yet cells name a GPU type: "
                                 "they will fail", False, "drop n_gpu_layers (default: all layers on the GPU) or use "
                                 "gpu: cpu"))
        if any(c["dtype"] != "auto" for c in cells) and importlib.util.find_spec("gguf") is None:
            found.append(Finding(cls.name, "dtype f16/bf16/f32 copies need the gguf package", False, models.INSTALL_GGUF))
        return found

    @classmethod
    def kernel_choice(cls, option: str, model: Path, model_sha256: str, system_info: str, threads: int,
                      log: Log) -> tuple[cpu_kernels.Choice, cpu_kernels.Probe, str]:
        """The extra-buffer choice for a load of `model` (what a run and doctor both ask), with the
        probe behind it and the key its answers are kept under (host, this build, the model file)."""
        probe = cpu_kernels.probe_child(model, threads)
        # the GPUs the process may see are part of the key: the same build answers for another device set
        key = cpu_kernels.cache_key("llama-cpp-python", metadata.version("llama-cpp-python"), system_info, model_sha256,
                                    os.environ.get("CUDA_VISIBLE_DEVICES", "<all>"))
        amx = cpu_kernels.has_amx(system_info) or cpu_kernels.cpu_reports_amx()
        return cpu_kernels.choose(option, amx, probe, models.cache_dir(), key, log), probe, key
