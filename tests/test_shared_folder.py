"""Many tasks filling one results folder: a finished cell is never lost, whatever lands after it.

Each task decides what to run when it starts; these tests land another task's cell in the middle
of a run (from the run's own progress hook, so the interleaving is exact) and check what survives.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results.folder import ResultsFolder, landing_rule
from harness.results.folder_lock import exclusive
from harness.run.runner import Runner

from .conftest import PROMPTS, needs_llama, run_harness


@pytest.mark.parametrize("old, new, force, written", [
    ([], ["skipped"], False, True),                  # nothing there: even a skipped cell says so
    (["ok"], ["skipped"], False, False),             # skipped never replaces
    (["failed"], ["skipped"], False, False),
    (["skipped"], ["skipped"], False, False),
    (["ok", "ok"], ["ok", "failed"], False, False),  # not done never replaces done ...
    (["ok"], ["failed"], True, False),               # ... not even with --force
    (["unsupported"], ["failed"], False, False),
    (["ok"], ["ok"], False, False),                  # done over done only with --force
    (["ok"], ["ok"], True, True),
    (["failed"], ["failed"], False, True),           # the newer failure says more
    (["failed"], ["ok"], False, True),
    (["skipped"], ["failed"], False, True),
    (["ok", "failed"], ["ok", "ok"], False, True),
])
def test_landing_rule(old, new, force, written):
    assert (landing_rule(old, new, force) is None) == written


def _rows(cell: str, status: str, n: int = 2) -> list[dict]:
    return [{"cell_id": cell, "prompt_id": "p", "repeat": r, "status": status, "error": status} for r in range(n)]


def test_a_done_cell_survives_every_later_landing(tmp_path):
    folder = ResultsFolder(tmp_path)
    assert folder.write_cell("c", _rows("c", "ok"), "task-a").written
    for status in ("skipped", "failed"):
        landing = folder.write_cell("c", _rows("c", status), "task-b")
        assert not landing.written and "kept the done cell" in landing.reason
    assert folder.store.statuses("c") == ["ok", "ok"]
    assert folder.landed("c")["run_id"] == "task-a"


def test_checkpoints_outlive_landings_that_are_not_done_and_go_once_the_cell_is(tmp_path):
    folder = ResultsFolder(tmp_path)
    folder.checkpoint("c", "task-c-00000.parquet", _rows("c", "ok", 1))  # task C is running c
    folder.store.write_part("c", "killed-00000.parquet", _rows("c", "ok", 1))  # a task killed since
    folder.write_cell("c", _rows("c", "skipped"), "task-b")  # B's node lacked the GPU
    folder.write_cell("c", _rows("c", "failed"), "task-b")  # B's run of it failed
    assert folder.partial() == {"c": 2}  # C's checkpoint and the killed task's are kept, for a rerun
    folder.write_cell("c", _rows("c", "ok"), "task-a")  # A lands it done: no checkpoint of c is worth anything now
    assert folder.partial() == {} and not folder.store.partial_dir.exists()
    folder.checkpoint("c", "task-c-00001.parquet", _rows("c", "ok", 1))  # C goes on, then lands: refused
    assert not folder.write_cell("c", _rows("c", "ok"), "task-c").written
    assert folder.partial() == {} and not folder.store.partial_dir.exists()


def test_a_checkpoint_whose_folder_another_task_removed_meanwhile_is_written_again(tmp_path, monkeypatch):
    """Task A lands c done and removes partial/c while task C writes a checkpoint of c into it: C's
    write is tried again (c not done) or dropped (c done), and C's worker goes on either way."""
    folder = ResultsFolder(tmp_path)
    real = folder.store.write_part
    calls = []

    def removed_first(cell_id, name, rows):
        calls.append(name)
        if len(calls) == 1:
            raise FileNotFoundError(f"{tmp_path}/partial/{cell_id}/.{name}.tmp")
        return real(cell_id, name, rows)

    monkeypatch.setattr(folder.store, "write_part", removed_first)
    folder.checkpoint("c", "task-c-00000.parquet", _rows("c", "ok", 1))
    assert calls == ["task-c-00000.parquet"] * 2 and folder.partial() == {"c": 1}
    folder.write_cell("c", _rows("c", "ok"), "task-a")  # done now: a vanished folder is not made again
    calls.clear()
    folder.checkpoint("c", "task-c-00001.parquet", _rows("c", "ok", 1))
    assert calls == ["task-c-00001.parquet"] and folder.partial() == {}


class _LandsMeanwhile:
    """A progress reporter that, once the run has chosen its cells, lands another task's cell."""

    def __init__(self, folder: ResultsFolder, cell_id: str, status: str) -> None:
        self.folder, self.cell_id, self.status, self.logs = folder, cell_id, status, []

    def start(self, total: int, cells: int = 0) -> None:
        self.folder.write_cell(self.cell_id, _rows(self.cell_id, self.status, 2 * 2), "other-task")

    def advance(self, n: int) -> None: ...

    def cell_done(self, cell_id: str, status: str) -> None: ...

    def log(self, message: str) -> None:
        self.logs.append(message)


def _experiment(tmp_path: Path, matrix: str) -> Path:
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: shared\nprompts: prompts.yaml\nrepeats: 2\nmax_tokens: 4\nmatrix:\n{matrix}")
    return path


def test_skipped_rows_never_land_over_a_cell_another_node_finished(tmp_path, monkeypatch):
    """Task B (no GPU) chose the A100 cell as pending; task A lands it ok meanwhile; B's skip keeps it."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi: this node has no GPU
    loaded = load_experiment(_experiment(tmp_path, "  model: [smollm2-135m]\n  engine: [llamacpp]\n  gpu: [A100]\n"))
    folder = ResultsFolder(tmp_path / "out")
    runner = Runner(loaded, folder)
    (cell_id,) = [c.id for c in expand(loaded)]
    runner.reporter = _LandsMeanwhile(folder, cell_id, "ok")
    runner.run()
    assert set(folder.store.statuses(cell_id)) == {"ok"}
    assert folder.landed(cell_id)["run_id"] == "other-task"


@needs_llama
def test_a_failed_run_never_lands_over_a_done_cell_even_when_forced(tmp_path):
    """A task redoing a finished cell (--force, or a resubmission) whose engine fails to load keeps the old cell."""
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(4096))  # a file llama.cpp cannot load
    loaded = load_experiment(_experiment(tmp_path, "  model: [broken.gguf]\n  engine: [llamacpp]\n"))
    folder = ResultsFolder(tmp_path / "out")
    (cell_id,) = [c.id for c in expand(loaded)]
    folder.write_cell(cell_id, _rows(cell_id, "ok", 4), "earlier-task")
    reporter = _LandsMeanwhile(folder, cell_id, "ok")
    Runner(loaded, folder, reporter).run(force=True)
    assert set(folder.store.statuses(cell_id)) == {"ok"}
    assert folder.landed(cell_id)["run_id"] == "earlier-task"
    assert any("kept the done cell" in m for m in reporter.logs), reporter.logs


def _hold(path: str, seconds: float, ready: str) -> None:
    with exclusive(Path(path)):
        Path(ready).touch()
        time.sleep(seconds)


def test_the_folder_lock_excludes_other_processes_and_breaks_a_dead_holders(tmp_path):
    lock = tmp_path / ".manifest.lock"
    ctx = multiprocessing.get_context("spawn")
    holder = ctx.Process(target=_hold, args=(str(lock), 1.0, str(tmp_path / "ready")))
    holder.start()
    while not (tmp_path / "ready").exists():
        time.sleep(0.01)
    with pytest.raises(HarnessError, match="waited"):
        with exclusive(lock, wait_s=0.2):
            pass
    t0 = time.monotonic()
    with exclusive(lock):
        assert time.monotonic() - t0 > 0.3  # it waited for the holder to let go
    holder.join()
    # a holder killed while holding it: a process of this host that is gone
    lock.write_text(f"{socket.gethostname()} 999999999 0 0")
    with exclusive(lock, wait_s=1):
        assert lock.read_text().split()[1] == str(os.getpid())
    assert not lock.exists()
    # a holder on another node whose lock is older than any update: broken after stale_s
    lock.write_text("other-node 12 0 0")
    os.utime(lock, (time.time() - 5, time.time() - 5))
    with exclusive(lock, wait_s=1, stale_s=2):
        pass


# -- the gate sees the whole experiment --------------------------------------------------------


def _gate(root: Path, rules: str) -> subprocess.CompletedProcess:
    """`harness check` with these rules, its table wide enough to keep each verdict on one line."""
    (root.parent / "rules.yaml").write_text(rules)
    return run_harness("check", str(root), "--expect", str(root.parent / "rules.yaml"), env={"COLUMNS": "400"})


def test_the_gate_fails_on_cells_that_never_ran_or_were_skipped(tmp_path):
    from .conftest import row_for, synthetic_folder

    folder, cells = synthetic_folder(tmp_path / "out", ["p1", "p2"], {"batch_size": [1, 2, 4, 8]}, repeats=2)
    by = {c["batch_size"]: c for c in cells}
    for size in (1, 2):  # batch 4's task never ran; batch 8's node lacked its GPU
        folder.write_cell(by[size].id, [row_for(by[size], p, r, [1, 2, 3]) for p in ("p1", "p2") for r in range(2)], "t")
    folder.write_cell(by[8].id, [row_for(by[8], p, r, status="skipped", error="no A100 here")
                                 for p in ("p1", "p2") for r in range(2)], "t")
    whole = _gate(folder.root, "expect:\n  - unique_outputs: 1\n")
    assert whole.returncode == 1
    assert f"1 selected cell(s) never ran (missing: {by[4].id})" in whole.stdout, whole.stdout
    assert "1 selected cell(s) were skipped" in whole.stdout and "no A100 here" in whole.stdout
    assert _gate(folder.root, "expect:\n  - unique_outputs: 1\n    allow_missing: true\n").returncode == 0
    only_missing = _gate(folder.root, "expect:\n  - where: {batch_size: 4}\n    unique_outputs: 1\n")
    assert only_missing.returncode == 1 and "never ran" in only_missing.stdout  # not "matches no cell"
    ran = _gate(folder.root, "expect:\n  - where: {batch_size: 2}\n    unique_outputs: 1\n")
    assert ran.returncode == 0, ran.stdout
    # every condition must judge something: batch 2 has runs to count but no batch-invariant pairs
    idle = _gate(folder.root, "expect:\n  - where: {batch_size: 2}\n    unique_outputs: 1\n    slowdown_max: 4\n")
    assert idle.returncode == 1 and "judged nothing for slowdown_max" in idle.stdout, idle.stdout
    # a key the rows do not have selects nothing (it used to select everything)
    foreign = _gate(folder.root, "expect:\n  - where: {llamacpp.flash_attn: 'on'}\n    unique_outputs: 1\n")
    assert foreign.returncode == 1 and "matches no cell" in foreign.stdout, foreign.stdout


def test_an_experiments_rule_on_an_option_it_does_not_sweep_is_refused_at_load(write):
    from harness.core.errors import ConfigError
    from harness.experiment.config import load_experiment

    write("p.yaml", PROMPTS)
    path = write("exp.yaml", "name: x\nprompts: p.yaml\nmatrix:\n  model: [m]\nexpect:\n"
                             "  - where: {llamacpp.flash_attn: 'on'}\n    unique_outputs: 1\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:6: expect\[0\].where.llamacpp.flash_attn: unknown axis"):
        load_experiment(path)


# -- jobs that ask for what they need ------------------------------------------------------------


def test_submitted_jobs_ask_for_a_gpu_and_a_dry_run_writes_nothing(write, tmp_path):
    from .conftest import run_harness

    write("p.yaml", PROMPTS)
    write("exp.yaml", "name: jobs\nprompts: p.yaml\nmatrix:\n  model: [m]\n  gpu: ['RTX 4090', any]\n"
                      "cluster:\n  gpus:\n    any: {partition: cpu}\n")
    out = tmp_path / "out"
    for scheduler in ("slurm", "pbs"):
        dry = run_harness("submit", str(tmp_path / "exp.yaml"), "-s", scheduler, "--out", str(out), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert not out.exists()  # neither the manifest nor the scripts
        text = dry.stdout
        if scheduler == "slurm":
            assert "#SBATCH --job-name=harness-jobs-RTX_4090\n" in text
            rtx = text[text.index("RTX_4090"):text.index("harness-jobs-any")]
            assert "#SBATCH --gres=gpu:1\n" in rtx  # a GPU type asks for one GPU without a cluster entry
            assert "--gres" not in text[text.index("harness-jobs-any"):]  # 'any' runs anywhere
        else:
            assert "#PBS -N h-jobs-RTX_4090\n" in text and ":ngpus=1\n" in text


# -- one comparison, one machine -----------------------------------------------------------------


def test_runs_of_two_machines_are_paired_only_on_purpose(tmp_path):
    from harness.analysis import metrics
    from harness.results.folder_rows import open_results

    from .conftest import row_for, run_harness, synthetic_folder

    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2], "batch_invariant": [False, True]})
    for cell in cells:  # batch 1 ran on node-a; batch 2 and the batch-invariant twins on node-b
        host = "node-a" if cell["batch_size"] == 1 and not cell["batch_invariant"] else "node-b"
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2], host=host, gpu_uuid="GPU-" + host,
                                            target_tokens_per_s=10.0, batch_tokens_per_s=10.0)], "t")
    results = open_results(folder.root)
    rows = results.read_rows(metrics.ROW_COLUMNS)
    split = r"host differs between paired rows .* node-b \(GPU-node-b\) vs .* node-a \(GPU-node-a\)"
    with pytest.raises(HarnessError, match=split):
        metrics.summarize(rows, results.tokens_for)
    summary = metrics.summarize(rows, results.tokens_for, allow_mixed={"host"})  # on purpose
    from harness.report.table import machine_lines

    lines = machine_lines(summary)  # the output says which machine each side ran on
    assert len(lines) == 1 and "ran on node-b (GPU-node-b" in lines[0] and "on node-a (GPU-node-a" in lines[0]
    assert set(summary.node) == {"node-a (GPU-node-a)", "node-b (GPU-node-b)"}
    two, cells = synthetic_folder(tmp_path / "two", ["p1"], {"batch_size": [1, 2]})  # no twins: no slowdown
    for cell in cells:
        two.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2], host=f"node-{cell['batch_size']}")], "t")
    done = run_harness("summarize", str(two.root), "--allow-mixed", "host")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compared across machines: cell" in done.stdout and "ran on node-2; its reference" in done.stdout
    with pytest.raises(HarnessError, match="pairing batch-invariant off/on runs: host differs"):
        metrics.slowdown(rows, allow_mixed={"host"})  # a slowdown never divides two machines' throughputs


@needs_llama
def test_two_harness_runs_into_one_folder_one_killed_lose_and_double_nothing(tmp_path):
    """Two real `harness run` processes fill one folder; the first is killed -9 once it has landed a cell.
    The second finishes; every run of every cell is there once, and no checkpoint is left behind."""

    import pandas as pd

    path = _experiment(tmp_path, "  model: [smollm2-135m]\n  engine: [llamacpp]\n  batch_size: [1, 2, 3, 4]\n")
    path.write_text(path.read_text().replace("max_tokens: 4", "max_tokens: 24")
                    + "engine_options:\n  llamacpp: {n_threads: 1, ignore_eos: true}\n")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "harness", "run", str(path), "--out", str(out), "--no-summary", "--checkpoint-every", "0"]
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    second = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list((out / "cells").glob("*.parquet")):
        time.sleep(0.1)
    first.kill()
    first.wait()
    told, _ = second.communicate(timeout=600)
    assert second.returncode == 0, told
    rows = pd.read_parquet(out / "cells")
    assert len(rows) == 4 * 2 * 2 and set(rows.status) == {"ok"}  # 4 cells x 2 prompts x 2 repeats
    assert not rows.duplicated(["cell_id", "prompt_id", "repeat"]).any()
    landed = [ResultsFolder(out).landed(c) for c in rows.cell_id.unique()]
    assert len({r["run_id"] for r in landed}) >= 1 and all(r["statuses"] == {"ok": 4} for r in landed)
    assert not (out / "partial").exists()
    assert "ran" in told and "already done" in told


def _contend(path: str, inside: str, rounds: int, barrier, index: int, clashes) -> None:
    """One of several waiters: each round, all meet at a stale lock (a dead holder's) and take it in turn;
    a second holder inside the lock at once is a clash."""
    lock = Path(path)
    for _ in range(rounds):
        barrier.wait()
        if index == 0:
            lock.write_text(f"{socket.gethostname()} 999999999 0 0")
        barrier.wait()
        with exclusive(lock, wait_s=30):
            try:
                fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                with clashes.get_lock():
                    clashes.value += 1
                continue
            os.close(fd)
            time.sleep(0.002)
            os.unlink(inside)


def test_many_waiters_at_a_stale_lock_never_hold_it_together(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    waiters, rounds = 6, 25
    barrier, clashes = ctx.Barrier(waiters), ctx.Value("i", 0)
    procs = [ctx.Process(target=_contend, args=(str(tmp_path / ".lock"), str(tmp_path / "inside"), rounds, barrier,
                                                i, clashes)) for i in range(waiters)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [p.exitcode for p in procs] == [0] * waiters
    assert clashes.value == 0
    assert not list(tmp_path.glob(".lock*"))  # neither the lock nor a breaker's file is left behind
