"""What ran, not what was asked: rows carry the state the engine reports, and a contradiction fails the cell."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.results.store import Store
from harness.run import enforced

from .conftest import PROMPTS, fake_nvidia_smi, needs_llama

A100 = {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-aaaa"}
L40S = {"name": "NVIDIA L40S", "uuid": "GPU-bbbb"}


def test_visible_gpus_follow_cuda_visible_devices():
    gpus = [A100, L40S]
    assert enforced.visible_gpus(gpus, {}) == gpus
    assert enforced.visible_gpus(gpus, {"CUDA_VISIBLE_DEVICES": "1"}) == [L40S]
    assert enforced.visible_gpus(gpus, {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}) == [A100]
    assert enforced.visible_gpus(gpus, {"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("gpu, bi, state, expected", [
    ("A100", False, {"device_kind": "cpu", "device_note": "offloaded 0 of 30 layers: no GPU offload"},
     "asked gpu A100; llamacpp offloaded 0 of 30 layers: no GPU offload"),
    ("cpu", False, {"device_kind": "gpu"}, "asked gpu cpu; llamacpp ran on NVIDIA A100-SXM4-80GB"),
    ("L40S", False, {"device_kind": "gpu"}, "asked gpu L40S; llamacpp ran on NVIDIA A100-SXM4-80GB"),
    ("A100", True, {"device_kind": "gpu", "batch_invariant_active": False},
     "asked batch_invariant true; llamacpp's model worker reports the batch-invariant kernels off"),
    ("A100", False, {"device_kind": "gpu", "batch_invariant_active": True}, "kernels on"),
    ("A100", True, {"device_kind": "gpu", "batch_invariant_active": None}, "could not tell"),
    ("A100", False, {"device_kind": "gpu", "batch_invariant_active": None}, None),  # off and unknown: no claim
    ("A100", True, {"device_kind": "gpu", "batch_invariant_active": True}, None),
    ("any", False, {"device_kind": "cpu"}, None),
    ("A100", False, {}, None),  # the engine cannot tell (a remote server): nothing to contradict
])
def test_contradictions_name_both_sides(gpu, bi, state, expected, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cols = enforced.columns(state, [A100])
    found = enforced.contradiction("llamacpp", gpu, bi, state, cols)
    if expected is None:
        assert found is None
    else:
        assert found is not None and expected in found


def test_columns_name_the_gpu_used_or_the_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert enforced.columns({"device_kind": "gpu", "backend": "CUDA"}, [A100, L40S])["device"] == "NVIDIA L40S"
    cols = enforced.columns({"device_kind": "cpu", "backend": "CPU", "offloaded_layers": 0}, [A100, L40S])
    assert (cols["device"], cols["device_uuid"], cols["offloaded_layers"]) == ("cpu", None, 0)
    assert set(cols) == set(enforced.ROW_COLUMNS)


def test_llama_offload_is_read_from_llamas_own_load_log():
    from harness.engines.parts.llama_offload import gpu_layers, offload_state

    assert (gpu_layers("cpu", -1), gpu_layers("A100", None), gpu_layers("any", None), gpu_layers("A100", 12)) == (0, -1, -1, 12)
    cuda = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | AVX = 1 |"
    on = offload_state("load_tensors: offloaded 31/31 layers to GPU\n", True, -1, cuda)
    assert (on["device_kind"], on["backend"], on["offloaded_layers"], on["model_layers"]) == ("gpu", "CUDA", 31, 31)
    off = offload_state("", False, -1, "CPU : AVX = 1 |", layers=30)
    assert (off["device_kind"], off["offloaded_layers"]) == ("cpu", 0) and "no GPU offload" in off["device_note"]
    assert offload_state("", True, -1, cuda) == {"backend": "CUDA"}  # said nothing: unknown, no claim


EXP = """
name: ran
prompts: prompts.yaml
repeats: 1
max_tokens: 4
matrix:
  model: [smollm2-135m]
  gpu: [A100, any]
engine_options:
  llamacpp: {n_threads: 2}
"""


@needs_llama
def test_a_fake_a100_with_the_cpu_build_fails_its_cell_and_rows_say_what_ran(write, tmp_path):
    """A stand-in nvidia-smi (no GPU here) says A100; the CPU build of llama.cpp cannot offload, so the
    A100 cell fails naming both sides, and the 'any' cell runs, its rows saying it ran on the CPU."""
    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB")
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", EXP)
    done = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--no-summary"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = Store(tmp_path / "out").read_rows()
    a100, anywhere = rows[rows.gpu == "A100"], rows[rows.gpu == "any"]
    assert set(a100.status) == {"failed"}
    assert a100.error.str.startswith("asked gpu A100; llamacpp offloaded 0 of 30 layers: this llama.cpp build "
                                     "has no GPU offload").all(), a100.error.iloc[0]
    assert set(a100.device) == {"cpu"} and set(a100.offloaded_layers) == {0}
    assert set(anywhere.status) == {"ok"} and set(anywhere.device) == {"cpu"} and set(anywhere.backend) == {"CPU"}
    assert json.loads(anywhere.engine_info.iloc[0])["n_gpu_layers"] == -1  # a GPU would have got every layer
    doctor = subprocess.run([sys.executable, "-m", "harness", "doctor", "exp.yaml"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert "that name a GPU type will fail" in doctor.stdout, doctor.stdout


def test_a_cpu_cell_sees_no_gpu_and_a_gpu_cell_only_its_own():
    """gpu: cpu hides every GPU from the worker (a CUDA llama.cpp would still offload prefill ops); a GPU
    type gets the first visible GPU of that type by UUID (not the layers split over every GPU), or as
    many as tensor parallelism asks; a task already given some GPUs (CUDA_VISIBLE_DEVICES) keeps to them."""
    from harness.run.enforced import device_environment

    node = [{"name": "NVIDIA L40S", "uuid": "GPU-aaa"}, {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-bbb"},
            {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-ccc"}]
    assert device_environment("cpu", node, environ={}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert device_environment("any", node, environ={}) == {}
    assert device_environment("A100", node, environ={}) == {"CUDA_VISIBLE_DEVICES": "GPU-bbb"}
    assert device_environment("A100", node, 2, environ={}) == {"CUDA_VISIBLE_DEVICES": "GPU-bbb,GPU-ccc"}
    assert device_environment("A100", node, environ={"CUDA_VISIBLE_DEVICES": "0,2"}) == {"CUDA_VISIBLE_DEVICES": "GPU-ccc"}
    assert device_environment("H100", node, environ={}) == {}  # not here: the cell is skipped before this
