"""Differential: a folder read part by part gives exactly what one whole read gives, refusals
included, whatever the folder's shape. Folders are generated (hypothesis) with swept engine options,
an edited experiment's stale cells read with --all-cells, twin cells, cell files without rows, several
prompts and repeats, batch-invariant pairs and references that land in other parts; parts are made
tiny so every unit stands apart. The cases issue 54 found are examples of their own."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.analysis.folder_analysis import TABLES, Analysis
from harness.analysis.partitioned import PartitionedAnalysis, streamed
from harness.analysis.splits import folder_splits
from harness.core.errors import HarnessError
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results.folder import ResultsFolder
from harness.results.folder_rows import open_results
from harness.results.rows import logprobs_hash

from .conftest import row_for


@dataclass(frozen=True)
class Shape:
    """What a generated folder holds."""

    prompts: int
    repeats: int
    batch_sizes: tuple[int, ...]
    seeds: tuple[int, ...]
    option: bool  # the experiment sweeps llamacpp.flash_attn
    invariant: bool  # batch_invariant off and on
    edited: tuple[int, ...] | None  # batch sizes of a second version of the experiment (the first's cells stale)
    edited_repeats: int  # repeats of the second version (other repeats: same settings, new cell ids: twins)
    empty: bool  # one more stale cell file, without rows
    departs: float  # the chance that a run departs
    seed: int
    boots: int = 1  # engine loads per cell: a run's load is its repeat modulo this
    answers: bool = False  # the first prompt has an answer and a parse rule; runs record theirs
    probes: bool = False  # runs carry logit-probe figures
    environments: bool = False  # the cells run under two environments


def _spec(shape: Shape, batch_sizes: tuple[int, ...], repeats: int) -> dict:
    matrix: dict = {"model": ["m"], "batch_size": list(batch_sizes), "seed": list(shape.seeds)}
    if shape.option:
        matrix["llamacpp.flash_attn"] = ["on"]
    if shape.invariant:
        matrix["batch_invariant"] = [False, True]
    prompts = [{"id": f"p{i}", "text": f"prompt {i}"} for i in range(shape.prompts)]
    spec = {"name": "shape", "prompts": prompts, "fillers": ["other"], "repeats": repeats, "max_tokens": 8,
            "matrix": matrix}
    if shape.answers:
        prompts[0] |= {"answer": 50, "parse": "number"}
    if shape.environments:
        matrix["environment"] = ["current", "other"]
        spec["environments"] = {"other": {"python": "/usr/bin/python3"}}
    return spec


def _rows(cell, shape: Shape, repeats: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for i in range(shape.prompts):
        base = [50 + 10 * i + j for j in range(8)]
        for repeat in range(repeats):
            tokens = list(base)
            if rng.random() < shape.departs:
                at = int(rng.integers(0, 8))
                tokens[at:] = [int(t) for t in rng.integers(900, 903, size=8 - at)]
            if rng.random() < 0.1:
                rows.append(row_for(cell, f"p{i}", repeat, status="failed", error="seeded failure"))
                continue
            lp = [-0.5 * j - (0.001 if rng.random() < 0.3 else 0.0) for j in range(len(tokens))]
            extra = {}
            if shape.answers and i == 0:
                said = str(tokens[-1] - 7) if rng.random() < 0.8 else None
                extra |= {"answer_parsed": said, "answer_expected": "50", "answer_correct": said == "50"}
            if shape.probes:
                moved = int(rng.integers(0, 3))
                extra |= {"probe_reference": "batch 1", "probe_steps": 4, "probe_steps_differed": moved,
                          "probe_logits_compared": 400, "probe_logits_differed": 37 * moved,
                          "probe_max_abs_diff": float(rng.uniform(0, 1e-3)) * moved,
                          "probe_low_margin_frac": float(rng.uniform(0, 0.5))}
            rows.append(row_for(
                cell, f"p{i}", repeat, tokens, schema_version=3, logprobs=lp, logprobs_hash=logprobs_hash(lp),
                margins=[float(m) for m in rng.choice([0.02, 0.3, 2.0], size=len(tokens))],
                load_id=f"{cell.id}-{repeat % shape.boots}", target_tokens_per_s=float(rng.uniform(10, 50)),
                batch_tokens_per_s=float(rng.uniform(20, 90)), ttft_s=float(rng.uniform(0.01, 0.2)),
                itl_s=[float(x) for x in rng.uniform(0.01, 0.05, size=len(tokens) - 1)], **extra))
    return rows


def _version(root, shape: Shape, batch_sizes, repeats, rng) -> list[str]:
    path = root.parent / f"{root.name}.yaml"
    path.write_text(yaml.safe_dump(_spec(shape, batch_sizes, repeats)))
    loaded = load_experiment(path)
    folder = ResultsFolder(root)
    folder.adopt(loaded)
    written = []
    for cell in expand(loaded):
        folder.write_cell(cell.id, _rows(cell, shape, repeats, rng), "t")
        written.append(cell.id)
    return written


def build(root, shape: Shape):
    """The folder of `shape`, and whether it is read with --all-cells."""
    rng = np.random.default_rng(shape.seed)
    first = _version(root, shape, shape.batch_sizes, shape.repeats, rng)
    if shape.edited is None:
        return open_results(root)
    _version(root, shape, shape.edited, shape.edited_repeats, rng)
    if shape.empty:  # a stale cell with a file but no rows, sorted before every other
        ResultsFolder(root).store.write_cell("0" * 12, [], None)
    return open_results(root, all_cells=True) if first else open_results(root)


def _csv(frame) -> str:
    out = io.StringIO()
    frame.to_csv(out, index=False)
    return out.getvalue()


def _outcome(read) -> str:
    """A table's CSV, or the refusal it ended in (its kind: which twin pair a read names first may differ)."""
    try:
        return _csv(read())
    except HarnessError as error:
        return "refused: both claim prompt" if "both claim prompt" in str(error) else f"refused: {error}"


def assert_parts_equal_whole(results, budget: int, reference: dict | None = None,
                             reference_run: str = "first", twice: bool = True) -> PartitionedAnalysis | None:
    """Every table, the latency, the split trees and the report's data alike read part by part and whole
    (`twice`: the report built a second time from the same parts, as item 9 of issue 65 asked)."""
    options = {"reference": reference, "allow_mixed": frozenset(), "reference_run": reference_run}
    whole = Analysis(results, **options)
    parts = streamed(Analysis(results, **options), budget=budget, workers=1)
    for name in TABLES:
        assert _outcome(lambda n=name: parts.table(n)) == _outcome(lambda n=name: whole.table(n)), name
    assert _outcome(lambda: parts.latency) == _outcome(lambda: whole.latency)
    assert _outcome(lambda: folder_splits(parts)) == _outcome(lambda: folder_splits(whole))
    if not _outcome(lambda: whole.summary).startswith("refused"):
        from harness.report import html

        payloads = [html.build(parts), html.build(whole)] + ([html.build(parts)] if twice else [])
        for payload in payloads:
            payload["meta"].pop("generated_at")
        texts = [json.dumps(payload, sort_keys=True, default=str) for payload in payloads]
        assert texts[0] == texts[1] and texts[-1] == texts[0]
    return parts if isinstance(parts, PartitionedAnalysis) else None


#: the cases issue 54 found on 0af8f6c, each a shape of its own
FOUND = {
    # a swept option, then the experiment edited from batch 1, 2 to 2, 4 and read with --all-cells:
    # the stale reference cell was planned into another part than the cells it is the reference of
    "swept option, stale reference": Shape(2, 2, (1, 2), (0, 1), True, False, (2, 4), 2, False, 0.4, 1),
    # the same settings again under other repeats (new cell ids): twins the whole read refuses
    "swept option, twins": Shape(2, 2, (1, 2), (0, 1), True, False, (1, 2), 3, False, 0.4, 2),
    # a stale cell file without rows sorted first (an IndexError in the planner)
    "empty stale file first": Shape(2, 2, (1, 2), (0, 1), False, False, (2, 4), 2, True, 0.4, 3),
}


@pytest.mark.parametrize("case", list(FOUND))
def test_the_cases_issue_54_found_read_alike_part_by_part(tmp_path, case):
    parts = assert_parts_equal_whole(build(tmp_path / "results", FOUND[case]), budget=1)
    assert parts is not None and len(parts.parts) > 1


#: shapes that are one unit each (every cell differs only in a reference axis): cut by prompt
CUT = {
    # the product card's first experiment: a batch-size sweep, batch-invariant off and on
    "batch-size sweep": (Shape(4, 3, (1, 2, 4), (0,), True, True, None, 1, False, 0.5, 4), None),
    # a reference-axis sweep: every seed and batch size against seed 0 at batch 1
    "seed and batch size against one cell": (Shape(3, 2, (1, 2), (0, 1), False, False, None, 1, False, 0.5, 5),
                                             {"seed": 0, "batch_size": 1}),
    # stale cells and an empty file beside a cut unit
    "edited sweep read with --all-cells": (Shape(3, 2, (1, 2), (0,), False, False, (2, 4), 2, True, 0.5, 6), None),
}


@pytest.mark.parametrize("case", list(CUT))
def test_a_unit_over_a_part_is_cut_by_prompt_and_reads_alike(tmp_path, monkeypatch, case):
    from harness.report import html

    shape, reference = CUT[case]
    read, report_part = [], html.report_part  # the prompts each report part reads, the parts' then the whole's
    monkeypatch.setattr(html, "report_part", lambda a: read.append(set(a.report_rows["prompt_id"])) or report_part(a))
    results = build(tmp_path / "results", shape)
    largest = int(results.folder.store.read_rows(["prompt_id"], results.cell_ids)["prompt_id"].value_counts().max())
    parts = assert_parts_equal_whole(results, budget=largest, reference=reference)
    assert parts is not None
    cut = [part for part in parts.parts if part.prompts is not None]
    assert all(part.runs is None for part in parts.parts)  # no prompt is over a part: none is cut by its runs
    assert len(cut) >= 2 and len({part.cells for part in cut}) == 1  # one unit's cells, its prompts apart
    assert sorted(p for part in cut for p in part.prompts) == [f"p{i}" for i in range(shape.prompts)]
    # the report reads the same parts, not the cut unit whole (a 10M-row sweep would not fit a worker)
    assert len(read) == 2 * len(parts.parts) + 1  # the parts' page is built twice (the same page both times)
    assert all(seen <= set(part.prompts) for seen, part in zip(read, parts.parts) if part.prompts)


@pytest.mark.parametrize("reference_run", ["first", "modal"])
def test_one_prompt_over_a_part_is_cut_by_its_runs_and_reads_alike(tmp_path, monkeypatch, reference_run):
    """The textbook experiment: one prompt, many repeats, batch 1 to 8. Its one unit is cut by runs, each
    part reading the runs that stand for their cells besides its own, and every table, the splits and the
    report read alike, under either reference-run rule, with loads, answers and probes in the rows."""
    from harness.report import html

    shape = Shape(1, 30, (1, 2, 4, 8), (0,), False, True, None, 1, False, 0.3, 11, boots=2, answers=True,
                  probes=True)
    read, report_part = [], html.report_part
    monkeypatch.setattr(html, "report_part", lambda a: read.append(len(a.report_rows)) or report_part(a))
    parts = assert_parts_equal_whole(build(tmp_path / "results", shape), budget=50, reference_run=reference_run)
    assert parts is not None and len(parts.parts) >= 5
    assert all(part.prompts == ("p0",) and part.runs is not None for part in parts.parts)
    assert max(read[:len(parts.parts)]) <= 8 * 7  # each part read its slice of 240 rows (7 runs a cell), not all
    starts = sorted(part.runs[0] for part in parts.parts)
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))  # every run in one part


def test_the_run_that_stands_for_a_cell_is_chosen_over_all_its_runs(tmp_path):
    """Under --reference-run modal the reference cell's most frequent output may lie wholly in other parts
    than a run's: the run compared against is the whole read's all the same."""
    shape = Shape(1, 12, (1, 2), (0,), False, False, None, 1, False, 0.6, 12)
    results = build(tmp_path / "results", shape)
    whole = Analysis(results, reference_run="modal")
    parts = streamed(Analysis(results, reference_run="modal"), budget=4, workers=1)
    assert isinstance(parts, PartitionedAnalysis) and all(part.runs is not None for part in parts.parts)
    first = parts.summary[["cell_id", "reference_repeat", "reference_share"]]
    assert first.equals(whole.summary[["cell_id", "reference_repeat", "reference_share"]])


shapes = st.builds(
    Shape,
    prompts=st.integers(1, 3), repeats=st.integers(1, 3),
    batch_sizes=st.sampled_from([(1,), (1, 2), (2, 4), (1, 2, 4)]), seeds=st.sampled_from([(0,), (0, 1)]),
    option=st.booleans(), invariant=st.booleans(),
    edited=st.sampled_from([None, (1,), (2, 4), (1, 2)]), edited_repeats=st.integers(1, 3), empty=st.booleans(),
    departs=st.sampled_from([0.0, 0.3, 0.8]), seed=st.integers(0, 1000),
    boots=st.integers(1, 3), answers=st.booleans(), probes=st.booleans(), environments=st.booleans(),
)


# ten generated folders a run, drawn as two tests of five so that two test workers share them. The budget
# is drawn as the parts wanted (each part costs a fixed half second, whatever its rows): 2 to 8 parts of a
# folder of up to 200 rows cut prompts into parts of their runs, down to one run a part in small folders.
@pytest.mark.parametrize("draw", ["first five", "second five"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, parts=st.integers(2, 8), by_seed=st.booleans(), modal=st.booleans())
def test_generated_folders_read_alike_part_by_part(tmp_path_factory, draw, shape, parts, by_seed, modal):
    results = build(tmp_path_factory.mktemp("shape") / "results", shape)
    reference = {"seed": 0} if by_seed and len(shape.seeds) > 1 else None
    budget = max(1, -(-len(results.read_rows(columns=["cell_id"])) // parts))
    assert_parts_equal_whole(results, budget, reference, "modal" if modal else "first", twice=False)


def _dies_in_its_second_part(analysis) -> int:
    """Run in a worker: the part holding the folder's last cell is killed as the kernel kills a process
    out of memory; the others wait long enough that waiting for them would show."""
    import os
    import signal
    import time

    if analysis.results.cell_ids[-1] == analysis.results.folder.store.cell_files()[-1].stem:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return 0


def _fails_in_its_second_part(analysis) -> int:
    import time

    if analysis.results.cell_ids[-1] == analysis.results.folder.store.cell_files()[-1].stem:
        raise ValueError("a part's own error")
    time.sleep(60)
    return 0


@pytest.mark.parametrize("fn, said", [(_dies_in_its_second_part, "a worker process reading this folder part by part died"),
                                      (_fails_in_its_second_part, "a part's own error")])
def test_a_dead_worker_or_a_failing_part_ends_the_read_at_once(tmp_path, fn, said):
    import time

    results = build(tmp_path / "results", Shape(1, 1, (1, 2), (0, 1), False, False, None, 1, False, 0.0, 0))
    parts = streamed(Analysis(results), budget=1, workers=2)
    assert isinstance(parts, PartitionedAnalysis) and len(parts.parts) == 2
    began = time.monotonic()
    with pytest.raises((HarnessError, ValueError), match=said):
        parts.per_part(fn, with_statistics=False)
    assert time.monotonic() - began < 30  # the other part sleeps 60 s: it was not waited for


def test_a_worker_the_executor_does_not_watch_is_seen_dead_between_parts():
    """The executor sees a death only among the workers it watched when it last waited; a worker spawned
    after that (one per submit) dies unseen until another part ends. The read looks at every worker
    itself: a dead one ends it, with the signal, while parts are still to come."""
    from concurrent.futures.process import BrokenProcessPool
    from types import SimpleNamespace

    from harness.analysis.partitioned import _raise_on_a_dead_worker

    alive, killed = SimpleNamespace(exitcode=None, pid=1), SimpleNamespace(exitcode=-9, pid=2)
    pool = SimpleNamespace(_processes={1: alive, 2: killed})
    with pytest.raises(BrokenProcessPool, match="worker process 2 ended \\(killed by signal 9\\)"):
        _raise_on_a_dead_worker(pool, {"a part still to come"})
    _raise_on_a_dead_worker(pool, set())  # nothing pending: the pool is ending, a worker gone is no news
    _raise_on_a_dead_worker(SimpleNamespace(_processes={1: alive}), {"part"})


def test_a_part_reads_only_the_row_groups_of_its_prompts(tmp_path, monkeypatch):
    """A cut part asks a cell file for some prompts: it gets exactly their rows, and reads only the
    row groups that hold them (the runner writes a prompt's runs together)."""
    import pyarrow.parquet as pq

    from harness.results import store as store_module

    monkeypatch.setattr(store_module, "ROW_GROUP_ROWS", 4)
    results = build(tmp_path / "results", Shape(3, 4, (1,), (0,), False, False, None, 1, False, 0.5, 8))
    (cell,) = results.cell_ids
    path = results.folder.store.cell_path(cell)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3  # a prompt's 4 runs a group
    asked = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: asked.append(list(groups)) or real(self, groups, **kw))
    whole = results.folder.store.read_rows(["prompt_id", "repeat", "output_hash"], [cell])
    some = results.folder.store.read_rows(["prompt_id", "repeat", "output_hash"], [cell], prompt_ids=("p2",))
    assert asked == [[2]]
    assert some.to_dict("records") == whole[whole["prompt_id"] == "p2"].reset_index(drop=True).to_dict("records")
    assert results.folder.store.read_rows(["repeat"], [cell], prompt_ids=("p9",)).empty  # nobody's prompt


def test_margins_of_some_runs_read_only_their_row_groups(tmp_path, monkeypatch):
    """A part wants the per-step margins of a few departed runs: it gets each run's own list, in the
    order asked, and reads the margins of only the row groups that hold those runs."""
    import pandas as pd
    import pyarrow.parquet as pq

    from harness.results import store as store_module

    monkeypatch.setattr(store_module, "ROW_GROUP_ROWS", 4)
    results = build(tmp_path / "results", Shape(3, 4, (1,), (0,), False, False, None, 1, False, 0.5, 9))
    (cell,) = results.cell_ids
    store = results.folder.store
    whole = store.read_rows(["prompt_id", "repeat", "margins"], [cell])
    whole = whole[whole["margins"].notna()]
    runs = pd.concat([whole[whole["prompt_id"] == "p2"].iloc[::-1], whole[whole["prompt_id"] == "p0"].head(2)])
    runs = runs.assign(cell_id=cell).set_axis([f"r{i}" for i in range(len(runs))])
    asked = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: asked.append((list(groups), kw.get("columns"))) or
                        real(self, groups, **kw))
    found = store.values_at("margins", runs[["cell_id", "prompt_id", "repeat"]])
    assert list(found.index) == list(runs.index)
    assert [list(m) for m in found] == [list(m) for m in runs["margins"]]
    assert asked == [([0, 2], ["margins"])]  # p1's group is not read


def test_a_part_of_a_prompt_cut_by_runs_reads_only_the_row_groups_of_its_runs(tmp_path, monkeypatch):
    """A part that holds some runs of a prompt asks each cell file for the runs at its positions, and for
    the runs that stand for the cells: it gets exactly those rows, from only the row groups holding them."""
    import pyarrow.parquet as pq

    from harness.results import store as store_module
    from harness.results.store_reading import RunPick, RunSlice

    monkeypatch.setattr(store_module, "ROW_GROUP_ROWS", 4)
    results = build(tmp_path / "results", Shape(1, 12, (1,), (0,), False, False, None, 1, False, 0.5, 13))
    (cell,) = results.cell_ids
    store = results.folder.store
    whole = store.read_rows(["prompt_id", "repeat", "output_hash"], [cell])
    asked = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: asked.append(list(groups)) or real(self, groups, **kw))
    some = store.read_rows(["prompt_id", "repeat", "output_hash"], [cell], prompt_ids=("p0",), runs=RunSlice(5, 9))
    assert asked == [[1, 2]]
    assert some.to_dict("records") == whole.iloc[5:9].reset_index(drop=True).to_dict("records")
    picked = store.read_rows(["output_hash"], [cell], prompt_ids=("p0",), runs=RunPick(((cell, 10), ("other", 1))))
    assert asked[-1] == [2] and picked["output_hash"].tolist() == whole.loc[whole["repeat"] == 10, "output_hash"].tolist()
    assert store.read_rows(["repeat"], [cell], prompt_ids=("p0",), runs=RunPick((("other", 1),))).empty
