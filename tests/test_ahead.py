"""The first engine load started ahead, in the spare worker, before the work order (harness.run.ahead):
started only where the run surely launches it, and used only by the launch it was started for."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines.parts.server_process import LOG_DIR_ENV
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand, group
from harness.experiment.selection import Selection, apply
from harness.results import layout
from harness.run.ahead import first_load, group_environment, launch_key
from harness.run.spare import SpareWorker
from tests.conftest import PROMPTS, needs_llama

EXPERIMENT = """
name: ahead
prompts: prompts.yaml
repeats: {repeats}
max_tokens: 4
{extra}
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2]
  {axis}
"""


def _chosen(root: Path, extra: str = "", axis: str = ""):
    root.mkdir(exist_ok=True)
    (root / "prompts.yaml").write_text(PROMPTS)
    (root / "exp.yaml").write_text(EXPERIMENT.format(extra=extra, axis=axis, repeats=2 if "boots" in extra else 1))
    loaded = load_experiment(root / "exp.yaml")
    return loaded, apply(group(expand(loaded)), Selection())


def test_a_load_is_started_ahead_only_where_the_run_surely_launches_it_first(tmp_path):
    loaded, chosen = _chosen(tmp_path)
    out = tmp_path / "out"
    ahead = first_load(loaded, chosen, out)
    grp = chosen[0][0]
    assert ahead is not None and ahead.spec == grp.spec and ahead.log == str(layout.group_log(out, grp.id))
    # what the runner's launch computes for that group, whatever GPUs the node has (gpu: any)
    env = group_environment(grp.spec, [{"name": "NVIDIA H200", "uuid": "GPU-1"}], Path(ahead.log))
    assert env[LOG_DIR_ENV] == str((out / "logs").resolve())
    assert ahead.key == launch_key(env, grp.spec, ahead.log, loaded.base)

    first_cell = chosen[0][1][0]  # a resumed folder: some cell of the group may be done
    layout.cell_file(out, first_cell.id).parent.mkdir(parents=True)
    layout.cell_file(out, first_cell.id).write_bytes(b"")
    assert first_load(loaded, chosen, out) is None
    assert first_load(loaded, [], out) is None

    named = _chosen(tmp_path / "named", axis="gpu: [H200]")  # which GPU it gets needs the node's list
    assert first_load(*named, tmp_path / "named" / "out") is None
    boots = _chosen(tmp_path / "boots", extra="boots: 2")  # a fresh worker per boot
    assert first_load(*boots, tmp_path / "boots" / "out") is None


def test_a_spare_loading_ahead_is_killed_for_another_launch_and_at_release(tmp_path):
    """Its environment is set for the load it was sent: no other launch may take it."""
    loaded, chosen = _chosen(tmp_path)
    ahead = first_load(loaded, chosen, tmp_path / "out")
    assert ahead is not None
    wrong = dataclasses.replace(ahead, spec=dataclasses.replace(ahead.spec, model="no-such-model"))  # fails fast
    with SpareWorker() as spare:
        proc = spare.proc
        spare.ahead(wrong, wrong.key)
        assert spare.take(ahead.key) is None and proc.returncode == -9 and spare.take(wrong.key) is None
    with SpareWorker() as spare:
        proc = spare.proc
        spare.ahead(wrong, wrong.key)
    assert proc.returncode == -9  # released while it loads: killed, not waited for


@needs_llama
@pytest.mark.parametrize("same", [True, False], ids=["its own launch", "another launch"])
def test_a_run_takes_the_spare_that_loaded_its_first_group_ahead_and_gets_the_same_rows(tmp_path, same):
    """The run's rows are whole either way; the spare serves the run only where it loaded its first group
    (it then exits 0 when the group is done, having loaded once; one killed for another launch ends by
    SIGKILL, and a fresh worker serves the group)."""
    from harness.results.folder import ResultsFolder
    from harness.results.folder_rows import open_results
    from harness.run.runner import Runner, SilentReporter

    class Logged(SilentReporter):
        def __init__(self) -> None:
            self.lines: list[str] = []

        def log(self, message: str) -> None:
            self.lines.append(message)

    loaded, chosen = _chosen(tmp_path)
    out = tmp_path / "out"
    ahead = first_load(loaded, chosen, out)
    assert ahead is not None
    if not same:
        ahead = dataclasses.replace(ahead, spec=dataclasses.replace(ahead.spec, model="no-such-model"))
    with SpareWorker() as spare:
        proc = spare.proc
        spare.ahead(ahead, ahead.key)
        reporter = Logged()
        result = Runner(loaded, ResultsFolder(out), reporter, spare=spare).run()
    assert proc.returncode == (0 if same else -9)
    # one load: the spare's own was used, not made again (a killed spare's lines never reach the run)
    assert sum(line.startswith("loading ") for line in reporter.lines) == 1, reporter.lines
    rows = open_results(out).read_rows()
    assert not result.failed and len(rows) == 2 * 2 and set(rows["status"]) == {"ok"}
    assert rows["load_id"].nunique() == 1  # one group, one load


@needs_llama
def test_an_order_larger_than_a_pipe_waits_for_no_load_sent_ahead_and_the_timeout_holds(tmp_path):
    """The spare reads its order while the engine it was sent ahead loads: the parent's write of an order
    larger than a pipe holds (here 40 prompts of 4 kB) does not wait for the load, so `--timeout` still
    ends a load that hangs (a llama-server 'binary' that never answers `--version`, which the engine
    waits 30 s for)."""
    import yaml

    from harness.results.folder_rows import open_results

    binary = tmp_path / "hangs"
    binary.write_text("#!/bin/sh\nexec sleep 600\n")
    binary.chmod(0o755)
    prompts = {"prompts": [{"id": f"p{i}", "text": f"{i} " + "word " * 800} for i in range(40)]}
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump(prompts))
    (tmp_path / "exp.yaml").write_text(
        "name: hang\nprompts: prompts.yaml\nrepeats: 1\nmax_tokens: 2\n"
        "matrix: {model: [smollm2-135m], engine: [llama-server]}\n"
        f"engine_options: {{llama-server: {{binary: '{binary}'}}}}\n")
    # `--timeout 5` is kept when the run ends within minutes, not when it waits out the hanging load first
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(tmp_path / "exp.yaml"), "--out",
                           str(tmp_path / "out"), "--timeout", "5", "--no-summary", "--progress", "none"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = open_results(tmp_path / "out").read_rows()
    assert len(rows) == 40 and set(rows["status"]) == {"failed"}
    assert all(e.startswith("timed out after 5 s") for e in rows["error"]), rows["error"].iloc[0]
