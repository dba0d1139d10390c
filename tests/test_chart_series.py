"""Figures never pool settings: every chart of the report and of `harness plot` has one series per
distinct setting (every axis, max_tokens and swept engine option that varies), with distinct labels.

The folder has the matrix of configs/cache-and-chunking-cpu.yaml, plus a swept engine option and
batch-invariant mode on and off, with rows written by hand: every cell is its own setting, and the
batch-2 cells depart from batch 1 at a token of their own, so each chart must show each of them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from harness.analysis.folder_analysis import Analysis
from harness.experiment.axes import AXES
from harness.report import html
from harness.results.folder_rows import open_results

from .conftest import row_for, run_harness, synthetic_folder

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cache-and-chunking-cpu.yaml"


def _folder(root: Path):
    matrix = {k: v for k, v in yaml.safe_load(CONFIG.read_text())["matrix"].items() if k not in ("model", "batch_size")}
    matrix |= {"batch_size": [1, 2], "context_tokens": [0, 511], "llamacpp.n_ubatch": [16, 32],
               "batch_invariant": [False, True]}
    folder, cells = synthetic_folder(root, ["p1", "p2"], matrix, repeats=2)
    for index, cell in enumerate(cells):
        rows = []
        for prompt in ("p1", "p2"):
            for repeat in range(2):
                tokens = list(range(1, 9))
                if cell["batch_size"] == 2 and repeat == 1:  # departs at a token of its own setting
                    tokens[1 + index % 6] = 99
                rows.append(row_for(cell, prompt, repeat, tokens, margins=[0.5] * 8, logprobs=[-0.1] * 8,
                                    target_tokens_per_s=10.0 + index, batch_tokens_per_s=20.0 + index,
                                    batch_position=0, run_id="t"))
        folder.write_cell(cell.id, rows, "t")
    return folder, cells


def _settings(cells, drop=("batch_size",)):
    return {tuple((k, str(v)) for k, v in sorted(c.as_dict.items()) if k not in drop) for c in cells}


def test_every_chart_has_one_series_per_setting_with_distinct_labels(tmp_path):
    folder, cells = _folder(tmp_path / "out")
    departing = [c for c in cells if c["batch_size"] == 2]
    assert len(cells) == 128 and len(_settings(cells)) == 64  # settings apart from the batch size
    done = run_harness("plot", "out", "-o", "plots", "-f", "csv", cwd=tmp_path)  # the numbers; drawing is tested elsewhere
    assert done.returncode == 0, done.stdout + done.stderr
    plots = tmp_path / "plots"
    assert not [p for p in plots.iterdir() if p.suffix != ".csv"]  # csv alone draws nothing
    charts = {name: pd.read_csv(plots / f"{name}.csv") for name in ("identical", "divergence", "margins", "slowdown",
                                                                   "splits")}
    built = html.build(Analysis(open_results(tmp_path / "out"), {"batch_size": 1}))
    payload = built["charts"]
    for name, frame in charts.items():
        per = frame.groupby(["series", "batch_size"]).size()
        expected = {"identical": len(cells), "slowdown": len(cells) // 2}.get(name, len(departing))
        assert len(per) == expected, (name, len(per), expected)
        # no two settings share a label: each label stands for one setting at each batch size it shows
        # (this replaces an assertion on a frame without duplicates that could never fail)
        labels = frame.groupby("series")["batch_size"].nunique()
        assert (labels == frame["batch_size"].nunique()).all() and len(labels) * labels.max() == expected, name
    # a label names every setting: the 64 settings apart from batch size read as 64 distinct labels
    assert charts["identical"]["series"].nunique() == 64
    assert charts["slowdown"]["series"].nunique() == 32  # batch-invariant mode is what a slowdown compares
    for name in ("identical", "slowdown"):
        shown = {(r["series"], r["batch_size"]) for r in payload[name]}
        assert shown == set(map(tuple, charts[name][["series", "batch_size"]].to_numpy())), name
    assert {(r["series"], r["batch_size"]) for r in payload["divergence"]} == set(
        map(tuple, charts["divergence"][["series", "batch_size"]].to_numpy()))
    example = charts["identical"]["series"].iloc[0]
    for part in ("pcache=", "chunk=", "kv=", "ctx=", "llamacpp.n_ubatch=", "batch-invariant"):
        assert part in example, example
    # the report's viewer filters by every setting that varies, swept engine options included
    assert set(built["filters"]) == {
        a for a in AXES if a in ("batch_size", "prefix_cache", "prefill_chunk", "kv_cache_dtype", "context_tokens",
                                 "batch_invariant")} | {"llamacpp.n_ubatch"}
