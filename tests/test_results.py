"""The results folder: manifest, stale cells, enforced provenance, schema, statuses, gates, cluster safety."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.core import gpu_names
from harness.core.errors import HarnessError
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results import provenance
from harness.results.folder import ResultsFolder
from harness.results.folder_rows import open_results
from harness.results.store import Store

from .conftest import PROMPTS, fake_nvidia_smi, needs_llama, row_for, run_harness, synthetic_folder

ROOT = Path(__file__).resolve().parent.parent


# -- GPU names ---------------------------------------------------------------------------

#: real `nvidia-smi --query-gpu=name` strings, and which wanted types each is
DRIVER_NAMES = {
    "NVIDIA A100-SXM4-80GB": {"A100", "A100-80GB", "A100 SXM4"},
    "NVIDIA A100-SXM4-40GB": {"A100", "A100 40GB", "A100 SXM4"},
    "NVIDIA A100-PCIE-40GB": {"A100", "A100-PCIe", "A100 40GB"},
    "NVIDIA A100 80GB PCIe": {"A100", "A100-80GB", "A100-PCIe"},
    "NVIDIA A10": {"A10"},
    "NVIDIA A10G": {"A10G"},
    "NVIDIA L4": {"L4"},
    "NVIDIA L40": {"L40"},
    "NVIDIA L40S": {"L40S"},
    "NVIDIA H100 80GB HBM3": {"H100", "H100-80GB"},
    "NVIDIA H100 PCIe": {"H100", "H100-PCIe"},
    "NVIDIA H100 NVL": {"H100", "H100 NVL"},
    "NVIDIA H200": {"H200"},
    "NVIDIA GH200 480GB": {"GH200"},
    "NVIDIA GeForce RTX 4090": {"RTX 4090", "4090"},
    "NVIDIA GeForce RTX 3090": {"RTX 3090", "3090"},
    "NVIDIA GeForce RTX 3090 Ti": {"RTX 3090 Ti"},
    "NVIDIA RTX A6000": {"RTX A6000", "A6000"},
    "NVIDIA RTX 6000 Ada Generation": {"RTX 6000 Ada", "6000 Ada"},
    "Quadro RTX 6000": {"RTX 6000"},
    "Tesla V100-SXM2-32GB": {"V100", "V100-32GB"},
    "Tesla V100-PCIE-16GB": {"V100"},
    "Tesla T4": {"T4"},
    "Tesla P100-PCIE-16GB": {"P100"},
}
WANTED = sorted({w for ws in DRIVER_NAMES.values() for w in ws} | {"A800", "H800", "B200", "L4S", "A1"})


@pytest.mark.parametrize("driver_name", sorted(DRIVER_NAMES))
def test_gpu_types_match_whole_names_only(driver_name):
    matched = {w for w in WANTED if gpu_names.matches(w, driver_name)}
    assert matched == DRIVER_NAMES[driver_name]


def test_gpu_type_pitfalls_of_substring_matching():
    assert not gpu_names.matches("A10", "NVIDIA A100-SXM4-80GB")
    assert gpu_names.matches("a100", "NVIDIA A100-SXM4-80GB") and gpu_names.matches("l40s", "NVIDIA L40S")
    assert not gpu_names.matches("L4", "NVIDIA L40S") and not gpu_names.matches("L40", "NVIDIA L40S")
    assert not gpu_names.matches("H100", "NVIDIA GH200 480GB")
    assert not gpu_names.matches("A100-80GB", "NVIDIA A100-PCIE-40GB")
    assert not gpu_names.matches("RTX 3090", "NVIDIA GeForce RTX 3090 Ti")


def test_cells_for_a_similar_gpu_name_are_skipped_not_run(write, tmp_path):
    """With an A100 reported (by a stand-in nvidia-smi), A10 and L4 cells do not run; they are skipped."""
    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB")
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", "name: g\nprompts: prompts.yaml\nmatrix:\n  model: [smollm2-135m]\n  gpu: [A10, L4]\n")
    done = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--no-summary"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = Store(tmp_path / "out").read_rows()
    assert set(rows.status) == {"skipped"} and len(rows) == 2 * 2
    assert rows.error.str.contains("this machine has NVIDIA A100-SXM4-80GB").all()
    assert set(rows.gpu_name) == {"NVIDIA A100-SXM4-80GB"}
    status = subprocess.run([sys.executable, "-m", "harness", "status", "out", "--ids", "skipped"],
                            cwd=tmp_path, env=env, capture_output=True, text=True)
    assert len(status.stdout.strip().split(",")) == 2  # skipped is not done: listed for a rerun
    again = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--no-summary"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "0 already done" in again.stdout  # a rerun tries them again
    assert set(Store(tmp_path / "out").read_rows().run_id) == set(rows.run_id)  # a skip leaves a cell alone


# -- statuses and exit codes ----------------------------------------------------------------

BROKEN = """
name: broken
prompts: prompts.yaml
max_tokens: 4
matrix:
  model: [smollm2-135m, broken.gguf]
engine_options:
  llamacpp: {n_threads: 2}
"""


@needs_llama
def test_a_model_that_does_not_load_fails_exits_1_and_is_retried(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", BROKEN)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + os.urandom(4096))  # not a loadable model
    first = run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 cell(s) failed" in first.stdout
    rows = Store(tmp_path / "out").read_rows()
    bad = rows[rows.model == "broken.gguf"]
    assert set(bad.status) == {"failed"} and set(rows[rows.model != "broken.gguf"].status) == {"ok"}
    status = run_harness("status", "out", "--ids", "failed", cwd=tmp_path)
    assert status.stdout.strip() == bad.cell_id.iloc[0]
    again = run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path)
    assert again.returncode == 1 and "1 already done" in again.stdout  # the ok cell kept, the failed one retried
    retried = Store(tmp_path / "out").read_rows()
    assert set(retried[retried.model == "broken.gguf"].run_id) != set(bad.run_id)


# -- the gate -------------------------------------------------------------------------------


def _gate_folder(root: Path, failed_batch2: bool):
    folder, cells = synthetic_folder(root, ["p1", "p2"], {"batch_size": [1, 2]}, repeats=2)
    by = {c["batch_size"]: c for c in cells}
    folder.write_cell(by[1].id, [row_for(by[1], p, r, [1, 2, 3]) for p in ("p1", "p2") for r in range(2)], "t")
    if failed_batch2:
        rows = [row_for(by[2], p, r, status="failed", error="CUDA out of memory") for p in ("p1", "p2") for r in range(2)]
    else:
        rows = [row_for(by[2], p, r, [1, 2, 3] if r == 0 else [1, 2, 4]) for p in ("p1", "p2") for r in range(2)]
    folder.write_cell(by[2].id, rows, "t")
    return folder


def _check(root: Path, rules: str) -> subprocess.CompletedProcess:
    (root.parent / "rules.yaml").write_text(rules)
    return run_harness("check", str(root), "--expect", str(root.parent / "rules.yaml"))


def test_gate_fails_when_every_selected_run_failed(tmp_path):
    root = _gate_folder(tmp_path / "out", failed_batch2=True).root
    done = _check(root, "expect:\n  - where: {batch_size: 2}\n    divergence_rate_max: 0.5\n")
    assert done.returncode == 1 and "FAIL" in done.stdout
    assert "judged nothing" in done.stdout and "failed" in done.stdout
    allowed = _check(root, "expect:\n  - where: {batch_size: 2}\n    divergence_rate_max: 0.5\n    allow_failed: true\n")
    assert allowed.returncode == 1 and "judged nothing" in allowed.stdout  # still nothing to judge
    mixed = _check(root, "expect:\n  - divergence_rate_max: 0.5\n")  # batch 1 judged, batch 2 failed
    assert mixed.returncode == 1 and "4 selected run(s) failed" in mixed.stdout
    tolerant = _check(root, "expect:\n  - divergence_rate_max: 0.5\n    allow_failed: true\n")
    assert tolerant.returncode == 0, tolerant.stdout


def test_gate_fails_a_rule_that_matches_no_cell_and_passes_a_real_judgement(tmp_path):
    root = _gate_folder(tmp_path / "out", failed_batch2=False).root
    nothing = _check(root, "expect:\n  - where: {batch_size: 8}\n    unique_outputs: 1\n")
    assert nothing.returncode == 1 and "matches no cell" in nothing.stdout
    ok = _check(root, "expect:\n  - where: {batch_size: 2}\n    divergence_rate_max: 0.5\n")
    assert ok.returncode == 0, ok.stdout  # 1 of 2 runs per prompt diverged
    strict = _check(root, "expect:\n  - where: {batch_size: 2}\n    divergence_rate_max: 0.4\n")
    assert strict.returncode == 1


# -- provenance and schema ----------------------------------------------------------------


def _versions_folder(root: Path, version_b1: str, version_b2: str, sha_b2: str = "a" * 64):
    folder, cells = synthetic_folder(root, ["p1"], {"batch_size": [1, 2]})
    for cell, version, sha in ((cells[0], version_b1, "a" * 64), (cells[1], version_b2, sha_b2)):
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2, 3], engine_version=version, model_sha256=sha,
                                            host="node-" + version[-1])], "t")
    return folder


def test_runs_made_with_another_engine_version_are_not_compared(tmp_path):
    root = _versions_folder(tmp_path / "out", "llama-cpp-python 0.3.16", "llama-cpp-python 0.3.36").root
    refused = run_harness("summarize", str(root), "--format", "json")
    assert refused.returncode == 1
    assert "engine_version differs" in refused.stderr and "0.3.16" in refused.stderr and "0.3.36" in refused.stderr
    assert "--allow-mixed engine_version" in refused.stderr
    allowed = run_harness("summarize", str(root), "--format", "json", "--allow-mixed", "engine_version")
    assert allowed.returncode == 0, allowed.stderr
    assert [r["match_rate"] for r in json.loads(allowed.stdout) if r["batch_size"] == 2] == [1.0]


def test_another_model_file_is_refused_unless_it_is_the_compared_axis(tmp_path):
    root = _versions_folder(tmp_path / "out", "v 1", "v 1", sha_b2="b" * 64).root
    refused = run_harness("summarize", str(root))
    assert refused.returncode == 1 and "model_sha256 differs" in refused.stderr


def test_compare_refuses_other_versions_and_lists_what_differs(tmp_path):
    def one(root: Path, gpu: str, version: str, host: str) -> Path:
        folder, cells = synthetic_folder(root, ["p1"], {"gpu": [gpu]})
        folder.write_cell(cells[0].id, [row_for(cells[0], "p1", 0, [1, 2], engine_version=version, host=host,
                                                gpu_driver="550.54" if gpu == "A100" else "535.1")], "t")
        return root

    a = one(tmp_path / "a", "A100", "vllm 0.11.0", "node-a")
    b = one(tmp_path / "b", "L40S", "vllm 0.11.0", "node-b")
    shown = run_harness("compare", str(a), str(b))
    assert shown.returncode == 0, shown.stderr
    assert "differs host: A node-a | B node-b" in shown.stdout and "gpu_driver" in shown.stdout
    c = one(tmp_path / "c", "L40S", "vllm 0.12.0", "node-b")
    refused = run_harness("compare", str(a), str(c))
    assert refused.returncode == 1 and "engine_version differs" in refused.stderr
    assert run_harness("compare", str(a), str(c), "--allow-mixed", "engine_version").returncode == 0


def test_newer_schema_is_refused_with_who_wrote_it(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {})
    folder.write_cell(cells[0].id, [row_for(cells[0], "p1", 0, [1], schema_version=99, harness_version="0.7.0")], "t")
    done = run_harness("summarize", str(folder.root))
    assert done.returncode == 1 and "row schema version 99 by a newer harness (0.7.0)" in done.stderr
    manifest = json.loads(folder.manifest_path.read_text())
    folder.manifest_path.write_text(json.dumps(manifest | {"manifest_version": 7, "harness_version": "9.9"}))
    with pytest.raises(HarnessError, match="manifest_version 7 was written by a newer harness \\(9.9\\)"):
        open_results(folder.root)


def test_two_cells_claiming_one_setting_are_named_not_picked(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2]})
    folder.write_cell(cells[0].id, [row_for(cells[0], "p1", 0, [1, 2])], "t")
    twin = ResultsFolder(tmp_path / "out").store
    twin.write_cell("feedfacecafe", [row_for(cells[0], "p1", 0, [1, 3]) | {"cell_id": "feedfacecafe"}])
    assert run_harness("summarize", str(folder.root)).returncode == 0  # the stray cell is stale: left out
    done = run_harness("summarize", str(folder.root), "--all-cells")
    assert done.returncode == 1 and cells[0].id in done.stderr and "feedfacecafe" in done.stderr


# -- the manifest and stale cells ---------------------------------------------------------------

STALE = """
name: stale
prompts: prompts.yaml
repeats: 2
max_tokens: 6
matrix:
  model: [smollm2-135m]
  batch_size: [1, 2]
engine_options:
  llamacpp: {n_threads: 2}
"""


@needs_llama
def test_an_edited_prompt_never_compares_with_or_pools_stale_cells(write, tmp_path):
    """The issue's scenario: run, edit a prompt, rerun batch 2 only: no 0 % against the old text."""
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", STALE)
    assert run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path).returncode == 0
    old = {p.stem for p in (tmp_path / "out" / "cells").glob("*.parquet")}
    write("prompts.yaml", PROMPTS.replace("Write a two-sentence story about a fox.", "Name three rivers."))
    rerun = run_harness("run", "exp.yaml", "--out", "out", "--where", "batch_size=2", "--no-summary", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "2 cell(s) on disk are now stale" in rerun.stdout

    summary = run_harness("summarize", "out", "--format", "json", cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    records = json.loads(summary.stdout)
    assert {r["cell_id"] for r in records}.isdisjoint(old)  # no stale cell pooled
    assert {r["batch_size"] for r in records} == {2}
    assert all(r["match_rate"] is None and r["reference_cell"] is None for r in records)  # reference missing
    assert "stale cell(s)" in summary.stderr

    status = run_harness("status", "out", cwd=tmp_path)
    assert "1 done, 1 missing" in status.stdout and "2 stale cell file(s)" in status.stdout
    assert all(cell in status.stdout for cell in old)
    assert set(run_harness("status", "out", "--ids", "stale", cwd=tmp_path).stdout.strip().split(",")) == old

    # batch 1 runs again under the current experiment: now there is a reference
    assert run_harness("run", "exp.yaml", "--out", "out", "--no-summary", cwd=tmp_path).returncode == 0
    records = json.loads(run_harness("summarize", "out", "--format", "json", cwd=tmp_path).stdout)
    assert all(r["match_rate"] is not None for r in records if r["batch_size"] == 2)
    assert {r["cell_id"] for r in records}.isdisjoint(old)


def test_readers_use_the_snapshot_not_the_live_yaml(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    path = write("exp.yaml", STALE)
    loaded = load_experiment(path)
    folder = ResultsFolder(tmp_path / "out")
    folder.adopt(loaded)
    (tmp_path / "prompts.yaml").unlink()
    path.write_text("this is: [not an experiment")
    assert [c.id for c in folder.current_cells()] == [c.id for c in expand(loaded)]
    snap = folder.experiment().prompt_set
    assert (snap.prompts, snap.fillers) == (loaded.prompt_set.prompts, loaded.prompt_set.fillers)
    status = run_harness("status", str(tmp_path / "out"))
    assert status.returncode == 0 and "2 cells: 2 missing" in status.stdout


def test_a_folder_from_an_older_harness_is_refused_with_the_way_to_adopt_it(tmp_path):
    Store(tmp_path / "old").write_cell("abc", [{"cell_id": "abc", "prompt_id": "p", "status": "ok"}])
    done = run_harness("summarize", str(tmp_path / "old"))
    assert done.returncode == 1 and "no manifest.json" in done.stderr and "harness run EXPERIMENT" in done.stderr


# -- cluster safety ----------------------------------------------------------------------------------


def _writer(root: str, names: list[str]) -> None:
    folder = ResultsFolder(Path(root))
    for name in names:
        folder.write_cell(name, [{"cell_id": name, "prompt_id": "p", "status": "ok"}], "w")


def test_two_concurrent_writers_into_one_folder_lose_nothing(tmp_path):
    folder, _ = synthetic_folder(tmp_path / "out", ["p1"], {})
    names = [[f"w{w}-{i:03d}" for i in range(40)] for w in range(2)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(folder.root), n)) for n in names]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    every = {n for ns in names for n in ns}
    assert {p.stem for p in folder.store.cell_files()} == every
    assert len({folder.landed(n)["writer"] for n in every}) == 2  # each cell says which writer landed it


def test_cleanup_removes_only_temporary_files_of_dead_writers(tmp_path):
    store = Store(tmp_path)
    store.cells_dir.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        host = socket.gethostname()
        files = {
            "live": store.cells_dir / f".a.parquet.{host}.{live.pid}.tmp",
            "dead": store.cells_dir / f".b.parquet.{host}.{dead.pid}.tmp",
            "other host": store.cells_dir / f".c.parquet.some-other-node.{dead.pid}.tmp",
        }
        for path in files.values():
            path.write_bytes(b"half a file")
        assert store.clean_stale() == 1
        assert files["live"].exists() and files["other host"].exists() and not files["dead"].exists()
    finally:
        live.kill()


LONG = """
name: long
prompts: [{id: story, text: "Write a long story about a fox."}]
max_tokens: 3000
matrix:
  model: [smollm2-135m]
engine_options:
  llamacpp: {n_threads: 1, ignore_eos: true}
"""


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@needs_llama
def test_worker_ends_when_its_parent_is_killed(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", LONG)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--no-summary"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while time.monotonic() < deadline and not workers:
        workers = [c for c in _children(proc.pid) if "harness.run.worker" in Path(f"/proc/{c}/cmdline").read_text()]
        time.sleep(0.2)
    assert workers, "no worker process appeared"
    while time.monotonic() < deadline and _cpu_seconds(workers[0]) < 3:
        time.sleep(0.2)  # let the engine load and start generating
    os.kill(proc.pid, signal.SIGKILL)  # mid-generation: one long generation, no progress event for many seconds
    proc.wait()
    gone_by = time.monotonic() + 5
    while time.monotonic() < gone_by and _alive(workers[0]):
        time.sleep(0.1)
    alive = _alive(workers[0])
    if alive:
        os.kill(workers[0], signal.SIGKILL)
    assert not alive, "the worker outlived its parent"


# -- code layout ----------------------------------------------------------------------------------


def test_no_import_cycles_in_harness():
    modules = {}
    for path in (ROOT / "harness").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("harness"))
        modules[name] = found
    graph = {m: {d for d in deps if d in modules and d != m} for m, deps in modules.items()}
    graph = {m: {d for d in deps if d != "harness"} for m, deps in graph.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    return path + [dep]
                if dep not in path:
                    stack.append((dep, path + [dep]))
        return None

    cycles = [c for m in graph if (c := cycle_from(m))]
    assert not cycles, cycles[0]


def test_summaries_of_a_run_folder_read_current_cells_only(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2]})
    for cell in cells:
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2])], "t")
    folder.store.write_cell("0ldce11", [row_for(cells[1], "p1", 0, [9, 9]) | {"cell_id": "0ldce11"}])
    results = open_results(folder.root)
    assert sorted(results.cell_ids) == sorted(c.id for c in cells) and results.stale == ["0ldce11"]
    rows = results.read_rows()
    assert set(rows.cell_id) == {c.id for c in cells}
    assert isinstance(rows, pd.DataFrame) and set(results.tokens_for({rows.output_hash.iloc[0]})) == {
        rows.output_hash.iloc[0]}
    assert "0ldce11" in open_results(folder.root, all_cells=True).cell_ids
    assert provenance.gpu_matches("A100", [{"name": "NVIDIA A100-PCIE-40GB"}]) is None


def test_merge_takes_done_cells_refuses_two_runs_of_one_cell_and_other_experiments(tmp_path):
    def shard(root: Path, batch: int, tokens: list[int], status: str = "ok"):
        folder, cells = synthetic_folder(root, ["p1"], {"batch_size": [1, 2]})
        cell = next(c for c in cells if c["batch_size"] == batch)
        row = row_for(cell, "p1", 0, tokens) if status == "ok" else row_for(cell, "p1", 0, status=status, error="x")
        folder.write_cell(cell.id, [row], "t")
        return folder, cell

    a, cell1 = shard(tmp_path / "a", 1, [1, 2])
    b, cell2 = shard(tmp_path / "b", 2, [1, 2])
    c, _ = shard(tmp_path / "c", 2, [0], status="failed")  # a failed copy of b's cell
    done = run_harness("merge", str(a.root), str(c.root), str(b.root), "--out", str(tmp_path / "all"))
    assert done.returncode == 0, done.stderr
    merged = open_results(tmp_path / "all")
    assert sorted(merged.cell_ids) == sorted([cell1.id, cell2.id]) and merged.stale == []
    assert set(merged.read_rows().status) == {"ok"}  # the done copy won over the failed one
    assert {c: merged.folder.landed(c)["statuses"] for c in merged.cell_ids} == {cell1.id: {"ok": 1}, cell2.id: {"ok": 1}}

    d, _ = shard(tmp_path / "d", 2, [3, 4])  # another run of the same cell, also done
    clash = run_harness("merge", str(b.root), str(d.root), "--out", str(tmp_path / "clash"))
    assert clash.returncode == 1 and "done in two places" in clash.stderr
    assert str(b.store.cell_path(cell2.id)) in clash.stderr and str(d.store.cell_path(cell2.id)) in clash.stderr
    assert not (tmp_path / "clash" / "cells").exists()  # nothing copied

    other, cells = synthetic_folder(tmp_path / "other", ["p9"], {})
    other.write_cell(cells[0].id, [row_for(cells[0], "p9", 0, [5])], "t")
    refused = run_harness("merge", str(a.root), str(other.root), "--out", str(tmp_path / "mixed"))
    assert refused.returncode == 1 and "--allow-mixed experiment" in refused.stderr
    allowed = run_harness("merge", str(a.root), str(other.root), "--out", str(tmp_path / "mixed2"),
                          "--allow-mixed", "experiment")
    assert allowed.returncode == 0, allowed.stderr
    assert len(open_results(tmp_path / "mixed2").cell_ids) == 2


def test_readers_give_the_values_a_plain_read_gives(tmp_path):
    """Text columns come back dictionary-read (shared strings, or categoricals for provenance);
    every value, missing ones included, must equal what pyarrow reads from the files, and the
    per-output and per-run lookups must find each row's own lists, in whichever file they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, cells = synthetic_folder(tmp_path / "r", ["a", "b"], {"batch_size": [1, 2, 4]}, repeats=3)
    for n, cell in enumerate(cells):
        folder.write_cell(cell.id, [
            row_for(cell, p, r, [n, r, i], host=None if r == 1 else f"node{n}", engine_info=json.dumps({"n": n}),
                    error=None if r else "", margins=[float(n), float(r)], token_texts=[f"{n}", f"{r}", p])
            for i, p in enumerate(("a", "b")) for r in range(3)], "x")
    store = folder.store
    got = store.read_rows()
    plain = pa.concat_tables([pq.read_table(p) for p in store.cell_files()]).to_pandas()
    compact = store.read_rows(provenance_as_categories=True)
    assert len(got) == len(plain) == len(compact) == 18
    assert isinstance(compact["engine_info"].dtype, pd.CategoricalDtype) and got["engine_info"].dtype == object

    def norm(values):
        return [None if v is None or (isinstance(v, float) and v != v) else
                (list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v) for v in values]

    for column in plain.columns:
        assert norm(got[column].tolist()) == norm(plain[column].tolist()), column
        assert norm(compact[column].astype(object).tolist()) == norm(plain[column].tolist()), column
    assert got["host"].isna().sum() == 6 and got["error"].isna().sum() == 12
    # one row per wanted output, from whichever file holds it; an unknown hash is absent
    hashes = dict(zip(plain["output_hash"], plain["token_ids"].map(list)))
    assert store.tokens_for(set(hashes) | {"nope"}) == hashes
    last = plain["output_hash"].iloc[-1]
    assert store.texts_for({last}) == {last: list(plain["token_texts"].iloc[-1])}
    # per-run lists for some runs only, in the order asked, None for a run not on disk
    runs = plain[["cell_id", "prompt_id", "repeat"]].iloc[[17, 3, 8]]
    runs.loc[99] = [cells[0].id, "a", 7]
    wanted = [list(m) for m in plain["margins"].iloc[[17, 3, 8]]] + [None]
    assert [None if m is None else list(m) for m in store.values_at("margins", runs)] == wanted


def test_every_declared_provenance_field_is_a_row_column_and_every_role_is_used():
    from harness.results import provenance_fields
    from harness.results.schema import ROW_SCHEMA

    assert set(provenance_fields.NAMES) <= set(ROW_SCHEMA.names)
    # the machine label reads its columns by position: host, GPU uuid, driver, CUDA
    assert provenance_fields.MACHINE == ("host", "gpu_uuid", "gpu_driver", "cuda_version")
    assert set(provenance_fields.SAME_LOAD) == {
        "model_sha256", "engine_version", "schema_version", "host", "gpu_uuid", "gpu_driver", "cuda_version",
        "library_versions", "harness_version", "git_commit", "engine_info", "cpu_kernels", "env"}
    mixable = {"model_sha256", "engine_version", "schema_version", "chat_template", "host", "cpu_kernels"}
    assert mixable == set(provenance_fields.MIXABLE)
    assert set(provenance_fields.PAIRED) <= set(provenance_fields.SAME_LOAD)  # a kept row pairs with the new ones


def test_merge_lands_by_the_landing_rule_under_the_cell_lock(tmp_path):
    """A merge copies a cell the way a task lands one: under the cell's lock (it waits for a writer),
    and never a failed copy over a cell a task landed done meanwhile."""
    import threading
    import time

    from harness.results.folder_lock import exclusive

    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1]})
    cell = cells[0]
    source, _ = synthetic_folder(tmp_path / "src", ["p1"], {"batch_size": [1]})
    source.write_cell(cell.id, [row_for(cell, "p1", 0, status="failed", error="x")], "t")
    folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2])], "task")  # a task landed it done after the plan
    kept = folder.land_file(cell.id, source.store.cell_path(cell.id), source.store.statuses(cell.id))
    assert not kept.written and "kept the done cell" in kept.reason
    assert folder.store.statuses(cell.id) == ["ok"]

    other = cells[0].id + "x"
    source.store.write_cell(other, [row_for(cell, "p1", 0, [3]) | {"cell_id": other}])
    held = threading.Event()

    def hold() -> None:
        with exclusive(folder.store.cells_dir / f".{other}.lock"):
            held.set()
            time.sleep(0.5)

    writer = threading.Thread(target=hold)
    writer.start()
    held.wait()
    t0 = time.monotonic()
    assert folder.land_file(other, source.store.cell_path(other), ["ok"]).written
    assert time.monotonic() - t0 > 0.4  # it waited for the writer to let go
    writer.join()


def test_every_engine_names_the_weights_it_ran_never_an_empty_identity(tmp_path, monkeypatch):
    """vLLM on a Hugging Face folder or hub id recorded an empty model_sha256, which pairs with anything."""
    import os as _os

    from harness.models import catalog

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    path, first = catalog.hf_model(str(folder), None, print)
    assert path == str(folder.resolve()) and first.startswith("files-sha256:") and len(first) == 13 + 64
    (folder / "model.safetensors").write_bytes(b"wEights")
    _os.utime(folder / "model.safetensors", ns=(1, 2))  # another file: another identity, whatever the clock
    assert catalog.hf_model(str(folder), None, print)[1] not in ("", first)
    refs = tmp_path / "hf-home" / "hub" / "models--org--m" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0123abc\n")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    assert catalog.hf_model("org/m", None, print) == ("org/m", "hf-revision:0123abc")
    assert catalog.hf_model("org/other", None, print)[1] == "unverified hub id:org/other"
    # a snapshot of the hub cache links its files to blobs named by their hashes: those names are read
    blobs = tmp_path / "hf-home" / "hub" / "models--org--m" / "blobs"
    blobs.mkdir()
    sha = "a" * 64
    (blobs / sha).write_bytes(b"big weights")
    snap = tmp_path / "hf-home" / "hub" / "models--org--m" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blobs / sha)
    import hashlib as _hashlib

    expected = _hashlib.sha256(f"model.safetensors\0{sha}\n".encode()).hexdigest()
    assert catalog.hf_model(str(snap), None, print)[1] == f"files-sha256:{expected}"
