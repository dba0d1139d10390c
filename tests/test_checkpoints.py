"""Long cells survive preemption: finished batches are checkpointed, and a killed run resumes inside the cell.

Also the batches that give a cell's runs (`batch_fill: fillers | copies`), which the checkpoints count in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.engines.base import Sampling
from harness.experiment.config import load_experiment
from harness.experiment.prompts import Prompt, PromptSet, plan_batches
from harness.results.folder import ResultsFolder
from harness.results.store import Store

from .conftest import PROMPTS, needs_llama, run_harness

LONG_CELL = """
name: preempted
prompts: prompts.yaml
repeats: 10
max_tokens: 12
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [2]
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 2}
"""

COPIES = """
name: copies
prompts:
  - id: feynman
    text: "Tell me about Richard Feynman"
batch_fill: copies
repeats: 7
max_tokens: 6
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [3]
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 2}
"""


# -- planning: which batch gives which run --------------------------------------------------------


def _prompts() -> PromptSet:
    return PromptSet((Prompt("a", "alpha"),), (Prompt("filler-00", "x"), Prompt("filler-01", "y")))


def test_fillers_plan_one_run_per_batch_at_the_targets_position():
    plans = plan_batches(_prompts(), _prompts().prompts[0], 3, 5, 0)
    assert [p.runs[0][1] for p in plans] == [0, 1, 2, 3, 4] and all(len(p.runs) == 1 for p in plans)
    for plan in plans:
        position = plan.runs[0][0]
        assert plan.batch.target_position == position and plan.batch.prompts[position].id == "a"


def test_copies_plan_every_member_a_run_and_keep_the_last_batch_full():
    target = _prompts().prompts[0]
    plans = plan_batches(_prompts(), target, 3, 7, 0, "copies")
    assert [len(p.batch.prompts) for p in plans] == [3, 3, 3]  # the batch shape is the setting
    assert [p.runs for p in plans] == [((0, 0), (1, 1), (2, 2)), ((0, 3), (1, 4), (2, 5)), ((0, 6),)]
    assert all(set(p.batch.prompts) == {target} and not p.batch.filler_ids for p in plans)


def test_copies_give_every_member_the_cells_seed():
    copies = Sampling(1.0, 1.0, 0, 42, 8, copies=True)
    fillers = Sampling(1.0, 1.0, 0, 42, 8)
    assert [copies.seed_for(i, 0) for i in range(3)] == [42, 42, 42]
    assert fillers.seed_for(0, 0) == 42 and len({fillers.seed_for(i, 0) for i in range(3)}) == 3


def test_copies_refuse_settings_that_need_a_single_target(write):
    write("prompts.yaml", PROMPTS)
    path = write("exp.yaml", COPIES.replace("batch_fill: copies", "batch_fill: copies\nprobe_logits: true"))
    with pytest.raises(ConfigError, match=r"exp.yaml:\d+: batch_fill: copies .* probe_logits"):
        load_experiment(path)
    path = write("exp.yaml", COPIES.replace("batch_fill: copies", "batch_fill: all"))
    with pytest.raises(ConfigError, match=r"exp.yaml:\d+.*batch_fill"):
        load_experiment(path)


def test_copies_enter_the_cell_id_and_fillers_keep_old_ids(write):
    from harness.experiment.matrix import expand

    text = COPIES.replace("batch_fill: copies\n", "fillers: [x]\nbatch_fill: copies\n")
    copies = expand(load_experiment(write("a.yaml", text)))[0].id
    fillers = expand(load_experiment(write("b.yaml", text.replace("batch_fill: copies\n", ""))))[0].id
    explicit = expand(load_experiment(write("c.yaml", text.replace("batch_fill: copies", "batch_fill: fillers"))))[0].id
    assert copies != fillers == explicit


# -- checkpoints in the results folder ------------------------------------------------------------


def _row(prompt: str, repeat: int, status: str = "ok") -> dict:
    return {"cell_id": "c1", "prompt_id": prompt, "repeat": repeat, "status": status, "engine_version": "e",
            "model_sha256": "m", "token_ids": [1, 2, repeat]}


def test_checkpoints_are_whole_part_files_in_write_order_and_never_touch_the_manifest(tmp_path):
    """At 1000 array tasks, a shared file rewritten per checkpoint or landing is the bottleneck:
    checkpoints and landings write files of their own, the manifest stays as adopt wrote it."""
    folder = ResultsFolder(tmp_path)
    folder.store.write_meta("manifest.json", json.dumps(folder.manifest()))
    before = (folder.manifest_path.read_bytes(), folder.manifest_path.stat().st_mtime_ns)
    folder.checkpoint("c1", "r1-00000.parquet", [_row("a", 0), _row("a", 1)])
    time.sleep(0.01)
    folder.checkpoint("c1", "r1-00001.parquet", [_row("a", 2)])
    (folder.store.part_dir("c1") / ".r1-00002.parquet.host.1.tmp").write_bytes(b"PAR1 half")  # a write cut short
    assert folder.partial() == {"c1": 3}
    assert [(r["prompt_id"], r["repeat"]) for r in folder.checkpointed("c1")] == [("a", 0), ("a", 1), ("a", 2)]
    assert not folder.store.cell_files()  # readers never see a partial cell
    assert folder.write_cell("c2", [_row("a", 0)], "r1").written
    assert folder.landed("c2")["run_id"] == "r1" and folder.landed("c1") == {}
    assert (folder.manifest_path.read_bytes(), folder.manifest_path.stat().st_mtime_ns) == before


def test_a_done_cell_drops_its_checkpoints_and_a_failed_one_keeps_them(tmp_path):
    folder = ResultsFolder(tmp_path)
    folder.checkpoint("c1", "p0.parquet", [_row("a", 0)])
    folder.write_cell("c1", [_row("a", 0), _row("a", 1, "failed")], "r1")
    assert folder.partial() == {"c1": 1} and len(folder.checkpointed("c1")) == 1
    folder.write_cell("c1", [_row("a", 0), _row("a", 1)], "r2")
    assert folder.partial() == {} and folder.checkpointed("c1") == []
    assert not (tmp_path / "partial").exists()


# -- the real engine: runs of copies, and a cell killed in its middle ------------------------------


@needs_llama
def test_copies_rows_one_per_member(write, tmp_path):
    write("exp.yaml", COPIES)
    done = run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = Store(tmp_path / "out").read_rows()
    assert list(rows.repeat) == list(range(7)) and list(rows.batch_position) == [0, 1, 2, 0, 1, 2, 0]
    assert (rows.status == "ok").all() and (rows.n_tokens == 6).all()
    assert all(len(f) == 0 for f in rows.filler_ids)
    assert all(len(lp) == 6 for lp in rows.logprobs) and (rows.batch_size == 3).all()


def _manifest(root: Path) -> dict:
    try:
        return json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _comparable(root: Path):
    rows = Store(root).read_rows()
    keep = ["prompt_id", "repeat", "batch_position", "status", "output_hash", "n_tokens", "text"]
    return rows.sort_values(["prompt_id", "repeat"])[keep + ["filler_ids", "token_ids"]].reset_index(drop=True), rows


@needs_llama
def test_sigkill_mid_cell_resumes_inside_it_and_rows_equal_an_uninterrupted_run(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", LONG_CELL)
    args = [sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "killed", "--no-summary",
            "--checkpoint-every", "0"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    kept = 0
    while time.monotonic() < deadline and proc.poll() is None:
        kept = sum(Store(tmp_path / "killed").part_rows().values())
        if kept >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed mid-cell"
    os.kill(proc.pid, signal.SIGKILL)  # the parent, mid-cell; its worker follows it
    proc.wait()
    time.sleep(1.5)  # the worker's parent watch ends it within its poll
    killed = tmp_path / "killed"
    assert not Store(killed).cell_files(), "the cell must not land before it is complete"
    checkpointed = sum(Store(killed).part_rows().values())
    assert 4 <= checkpointed < 20

    status = run_harness("status", "killed", cwd=tmp_path)
    assert "hold checkpoints" in status.stdout and f"{checkpointed} run(s) kept" in status.stdout, status.stdout

    resumed = run_harness("run", "exp.yaml", "--out", "killed", "--no-summary", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "kept from checkpoints" in resumed.stdout + resumed.stderr
    whole = run_harness("run", "exp.yaml", "--out", "whole", "--no-summary", cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    mine, rows = _comparable(killed)
    theirs, _ = _comparable(tmp_path / "whole")
    assert len(mine) == 20 and not mine.duplicated(["prompt_id", "repeat"]).any()  # nothing lost, nothing doubled
    assert mine.drop(columns=["filler_ids", "token_ids"]).equals(theirs.drop(columns=["filler_ids", "token_ids"]))
    assert [list(x) for x in mine.filler_ids] == [list(x) for x in theirs.filler_ids]
    assert [list(x) for x in mine.token_ids] == [list(x) for x in theirs.token_ids]
    runs = rows.groupby("run_id").size()  # run ids sort by start time: the killed run's first
    assert len(runs) == 2 and runs.iloc[0] == checkpointed  # its batches were kept, not redone
    assert Store(killed).part_rows() == {} and not (killed / "partial").exists()
