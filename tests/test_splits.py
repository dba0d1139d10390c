"""The split view: where the outputs of a cell and prompt part, branch by branch."""

from __future__ import annotations

import json

import pandas as pd

from harness.analysis.splits import END, Output, split_tree, splits


def _out(tokens, runs):
    return Output(tokens, [f"t{t}" for t in tokens], runs)


def test_thousand_runs_split_at_token_103_into_992_and_8():
    shared = list(range(103))
    queens = [_out(shared + [7, 8], 992)]
    city = [_out(shared + [9, 50 + k], 1) for k in range(8)]  # 8 runs, 8 distinct endings
    tree = split_tree(queens + city)
    first = [r for r in tree if r["node"] == 0]
    assert [(r["split_at"], r["token_text"], r["runs"], r["unique_outputs"]) for r in first] == [
        (103, "t7", 992, 1), (103, "t9", 8, 8)]
    assert abs(first[0]["share"] - 0.992) < 1e-12
    below = [r for r in tree if r["parent_node"] == 0]
    assert {r["parent_branch"] for r in below} == {1} and {r["split_at"] for r in below} == {104}
    assert sum(r["runs"] for r in below) == 8 and len(below) == 8


def test_identical_outputs_have_no_split_and_a_prefix_ends_as_its_own_branch():
    assert split_tree([_out([1, 2, 3], 5)]) == []
    tree = split_tree([_out([1, 2, 3], 3), _out([1, 2], 1)])
    assert [(r["split_at"], r["token_id"], r["token_text"], r["runs"]) for r in tree] == [
        (2, 3, "t3", 3), (2, None, END, 1)]


def test_splits_per_cell_and_prompt_from_rows():
    rows = pd.DataFrame({
        "cell_id": ["a"] * 4 + ["b"] * 2, "prompt_id": ["p"] * 6, "batch_size": [8] * 4 + [1] * 2,
        "status": ["ok"] * 6, "output_hash": ["x", "x", "y", "x", "x", "x"],
    })
    tokens = {"x": [1, 2, 3], "y": [1, 5]}
    frame = splits(rows, lambda h: {k: tokens[k] for k in h}, lambda h: {k: [str(t) for t in tokens[k]] for k in h},
                   ["batch_size"])
    assert list(frame[["cell_id", "batch_size", "split_at", "token_text", "runs"]].itertuples(index=False, name=None)) == [
        ("a", 8, 1, "2", 3), ("a", 8, 1, "5", 1)]  # cell b agrees with itself: no records
    assert json.loads(frame.to_json(orient="records"))[0]["unique_outputs"] == 1


def test_summarize_what_splits_on_a_results_folder(tmp_path):
    from .conftest import row_for, run_harness, synthetic_folder

    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1]}, repeats=10)
    outputs = [[5, 6, 7, 8]] * 9 + [[5, 6, 9]]
    folder.write_cell(cells[0].id, [row_for(cells[0], "p1", r, t, token_texts=[f"w{x}" for x in t])
                                    for r, t in enumerate(outputs)], "t")
    as_json = run_harness("summarize", str(folder.root), "--what", "splits", "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    records = json.loads(as_json.stdout)
    assert [(r["split_at"], r["token_text"], r["runs"]) for r in records] == [(2, "w7", 9), (2, "w9", 1)]
    table = run_harness("summarize", str(folder.root), "--what", "splits")
    assert table.returncode == 0 and "'w7'" in table.stdout and "90.0%" in table.stdout
