"""Issue 65: the CPUs a job was given. A SLURM job given 4 of a node's 64 cores ran 64 threads on 4
(os.cpu_count() is the node's). Engines take the CPUs the process may use by default: the affinity
mask, the cgroup's CPU quota and SLURM_CPUS_PER_TASK, and the rows record that count."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.core import cpus

from .conftest import PROMPTS, needs_llama


def _cgroup(root: Path, text: str, v1: tuple[int, int] | None = None) -> Path:
    """A stand-in cgroup tree (a folder of files shaped as the kernel's) with this cpu.max at its top."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text)
    if v1:
        for name in ("cpu", "cpu,cpuacct"):
            (root / name).mkdir(exist_ok=True)
            (root / name / "cpu.cfs_quota_us").write_text(str(v1[0]))
            (root / name / "cpu.cfs_period_us").write_text(str(v1[1]))
    return root


def test_the_cgroup_quota_and_slurm_limit_the_cpus(tmp_path):
    affinity = cpus.usable_cpus({}, tmp_path / "none")
    assert affinity >= 1
    assert cpus.cgroup_quota(_cgroup(tmp_path / "unlimited", "max 100000")) is None
    assert cpus.cgroup_quota(_cgroup(tmp_path / "half", "50000 100000")) == 0.5
    assert cpus.usable_cpus({}, tmp_path / "half") == 1  # half a CPU's time still runs one thread
    assert cpus.usable_cpus({"SLURM_CPUS_PER_TASK": "1"}, tmp_path / "unlimited") == 1
    assert cpus.usable_cpus({"SLURM_CPUS_PER_TASK": "512"}, tmp_path / "unlimited") == affinity
    assert cpus.usable_cpus({"SLURM_CPUS_PER_TASK": "x"}, tmp_path / "unlimited") == affinity


def test_an_affinity_of_one_cpu_is_one(tmp_path):
    if not shutil.which("taskset"):
        pytest.skip("taskset (util-linux) not installed")
    code = "from harness.core.cpus import usable_cpus; print(usable_cpus())"
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "1"


@needs_llama
def test_rows_of_a_run_on_one_allowed_cpu_record_one_thread(tmp_path):
    """llama.cpp's threads defaulted to os.cpu_count(): on a job allowed one CPU the rows said the node's
    count and it ran that many threads on one core. Under `taskset -c 0` the rows say 1 and 1."""
    if not shutil.which("taskset"):
        pytest.skip("taskset (util-linux) not installed")
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text("name: one-cpu\nprompts: prompts.yaml\nrepeats: 1\nmax_tokens: 2\n"
                                       "matrix: {model: [smollm2-135m], engine: [llamacpp], batch_size: [1]}\n")
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out",
                           "--progress", "plain"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = pd.concat(pd.read_parquet(f) for f in (tmp_path / "out").rglob("*.parquet") if "cells" in str(f))
    ok = rows[rows["status"] == "ok"]
    assert len(ok) and set(ok["cpu_count"]) == {1}
    assert {json.loads(info)["n_threads"] for info in ok["engine_info"]} == {1}
