"""The numbers behind the charts, computed once for both the HTML report and `harness plot`.

Every chart is a small table, so a paper's figure can be redrawn or checked from the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.analysis.folder_analysis import Analysis
from harness.analysis.near_ties import reference_margins
from harness.analysis.splits import joined_splits, part_splits
from harness.experiment.axes import describe
from harness.experiment.varying import varying
from harness.results.columns import keys_of

#: the x axis of the agreement charts; every other setting that varies names a series
X_AXIS = "batch_size"


@dataclass
class Charts:
    identical: pd.DataFrame  # series, batch_size, compared, identical, share
    divergence: pd.DataFrame  # series, batch_size, first_divergence (one record per diverged run)
    #: one record per departed run, indexed like the annotated rows it came from
    margins: pd.DataFrame  # series, batch_size, prompt_id, first_divergence, margin_run, margin_reference
    slowdown: pd.DataFrame  # metrics.slowdown
    reference: str
    varying: list[str]  # the axes that vary in these results (they name the series)
    #: answer_metrics.answer_summary, with a series label (empty without prompts that carry answers)
    answers: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: harness.analysis.splits records with a series label and each split's depth (see `add_splits`)
    splits: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: harness.analysis.survival curves: series, batch_size, tokens, at_risk, departed, censored, identical, low, high
    survival: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: harness.analysis.near_ties per margin bucket: series, batch_size, bucket, margin_low, margin_high, steps, flips, flip_rate
    flips_by_margin: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: per traced step, each module's largest difference from the reference run's pass, in pass order
    #: (harness.run.locate.located_by_module; filled by the command that reads the traces)
    located: pd.DataFrame = field(default_factory=pd.DataFrame)


def series_labels(frame: pd.DataFrame, varying: list[str]) -> pd.Series:
    """'llamacpp f32 pcache=warm' style labels from the settings that vary in these results (engine
    always shown): one label per distinct setting, so no two settings share a bar or a line."""
    axes = ["engine"] + [a for a in varying if a != "engine" and a in frame]
    if not len(frame):
        return pd.Series([], dtype=str)
    # one label per distinct combination of the axes, then each row takes its combination's
    group = frame.groupby(axes, dropna=False, sort=False).ngroup().to_numpy()
    firsts = frame[axes][~pd.Series(group).duplicated().to_numpy()]
    labels = [" ".join(describe(a, v) for a, v in zip(axes, values)) for values in firsts.itertuples(index=False)]
    return pd.Series(pd.Series(labels, dtype=object).to_numpy()[group], index=frame.index, dtype=object)


def varying_axes(rows: pd.DataFrame) -> list[str]:
    """Every setting that varies in these rows except the x axis: the axes, max_tokens and swept engine
    options (columns.keys_of), so a chart never pools two settings into one series."""
    return varying(rows, keys_of(rows, drop=[X_AXIS]))


def _labelled(frame: pd.DataFrame, varying: list[str]) -> pd.DataFrame:
    """`frame` with a series label in front (empty frames get the column too)."""
    frame = frame.copy()
    frame.insert(0, "series", series_labels(frame, varying) if len(frame) else pd.Series([], dtype=object))
    return frame


def step_value(values: Any, k: int) -> float | None:
    """A per-step list's value at step k; None where the list is shorter or the value unknown."""
    if values is None or k >= len(values):
        return None
    value = float(values[k])
    return None if math.isnan(value) else value


@dataclass
class ChartPart:
    """One part's per-run chart data, by cell: the series are named once every part is in, since
    which settings vary is a fact of the whole folder (harness.analysis.partitioned)."""

    cells: pd.DataFrame  # cell_id and the setting columns, a record per cell (a cut cell's in each of its parts)
    identical: pd.DataFrame  # cell_id, compared, identical: counts, added up across parts
    divergence: pd.DataFrame  # cell_id, prompt_id, first_divergence: a record per departed run, in row order
    #: a record per departed run, indexed like the part's paired rows: cell_id, prompt_id,
    #: first_divergence, margin_run, margin_reference
    margins: pd.DataFrame
    #: harness.analysis.splits.part_splits: the part's split trees, and the output counts of a prompt it
    #: holds some runs of (its trees drawn once the parts' counts are added up)
    splits: tuple[pd.DataFrame, pd.DataFrame]


def chart_part(analysis: Analysis) -> ChartPart:
    """The per-run chart data of one analysis (a folder, or one part of a campaign): its report
    rows paired with the reference. Margins are read for the departing runs and their references only."""

    rows, annotated, r = analysis.report_rows, analysis.paired, analysis.results
    keys = keys_of(rows)
    judged = annotated[annotated["matched"].notna()]
    identical = (judged.assign(identical=judged["matched"].astype(bool)).groupby("cell_id", sort=False)
                 .agg(compared=("identical", "size"), identical=("identical", "sum")).reset_index())
    split = judged[judged["first_divergence"].notna()]
    margin_of = reference_margins(split, r.margins_for)  # of the runs that stand for the departed runs' cells
    records = {}
    runs = split[["cell_id", "prompt_id", "first_divergence", "reference_cell"]].itertuples(index=False)
    for index, run, run_margins in zip(split.index, runs, r.margins_for(split)):
        k = int(run.first_divergence)
        records[index] = {
            "cell_id": run.cell_id, "prompt_id": run.prompt_id, "first_divergence": k,
            "margin_run": step_value(run_margins, k),
            "margin_reference": step_value(margin_of.get((run.reference_cell, run.prompt_id)), k),
        }
    margins = pd.DataFrame.from_dict(records, orient="index", columns=[
        "cell_id", "prompt_id", "first_divergence", "margin_run", "margin_reference"])
    return ChartPart(
        cells=rows.drop_duplicates("cell_id")[["cell_id"] + keys].reset_index(drop=True),
        identical=identical,
        divergence=split[["cell_id", "prompt_id", "first_divergence"]].astype({"first_divergence": int})
        .reset_index(drop=True),
        margins=margins,
        splits=part_splits(analysis),  # its rows are the report rows, read above
    )


def by_cell_and_prompt(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Per-run records of the parts in cell then prompt order, each (cell, prompt)'s runs as stored: a
    part holds every run of its prompts (a unit is cut by prompt), so whole and part by part agree."""
    present = [f for f in frames if not f.empty]
    table = pd.concat(present, ignore_index=True) if len(present) > 1 else (present or frames)[0]
    return table.sort_values(["cell_id", "prompt_id"], kind="stable").reset_index(drop=True)


def joined_cells(parts: list[ChartPart]) -> pd.DataFrame:
    """The folder's cells, a record each, from its parts' (a cut cell is in several)."""
    cells = pd.concat([p.cells for p in parts], ignore_index=True)
    return cells.drop_duplicates("cell_id").sort_values("cell_id", kind="stable").reset_index(drop=True)


def joined(parts: list[ChartPart], analysis: Analysis) -> Charts:
    """The charts of a folder from its parts' chart data and the analysis's statistics tables
    (answers, slowdown, survival, near ties)."""
    cells = joined_cells(parts)
    varying = varying_axes(cells)
    series = dict(zip(cells["cell_id"], series_labels(cells, varying)))
    x = dict(zip(cells["cell_id"], cells[X_AXIS]))

    def labelled(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
        return frame.assign(**{"series": frame["cell_id"].map(series).astype(object),
                               X_AXIS: frame["cell_id"].map(x)})[["series", X_AXIS] + columns]

    identical = (labelled(pd.concat([p.identical for p in parts], ignore_index=True), ["compared", "identical"])
                 .groupby(["series", X_AXIS], sort=True).sum().reset_index())
    identical["share"] = identical["identical"] / identical["compared"]
    answers = analysis.answers
    charts = Charts(
        identical=identical,
        divergence=labelled(by_cell_and_prompt([p.divergence for p in parts]), ["first_divergence"]),
        margins=labelled(by_cell_and_prompt([p.margins for p in parts]),
                         ["prompt_id", "first_divergence", "margin_run", "margin_reference"]),
        slowdown=_labelled(analysis.slowdown, [v for v in varying if v != "batch_invariant"]),
        reference=_reference_label(analysis),
        varying=varying,
        answers=answers if answers.empty else _labelled(answers, varying),
        survival=_series_first(analysis.survival, varying),
        flips_by_margin=_series_first(analysis.flips_by_margin, varying),
    )
    tree = joined_splits([p.splits for p in parts], analysis.results)
    if not tree.empty:
        add_splits(charts, tree)
    return charts


def _reference_label(analysis: Any) -> str:
    """'batch_size=1' (first run) or 'batch_size=1, modal run'."""
    label = ",".join(f"{k}={v}" for k, v in analysis.reference.items())
    return label if analysis.reference_run == "first" else f"{label}, {analysis.reference_run} run"


def _series_first(frame: pd.DataFrame, varying: list[str]) -> pd.DataFrame:
    """A per-setting frame as a chart reads it: series and batch size, then its own columns."""
    keys = keys_of(frame)
    out = _labelled(frame, varying)
    return out[["series", X_AXIS] + [c for c in frame.columns if c not in keys]]


def add_splits(ch: Charts, tree: pd.DataFrame) -> Charts:
    """The split trees (harness.analysis.splits), labelled like the other charts' series.

    `depth` is 0 for a cell's first split, 1 for a split inside one of its branches, and so on.
    """
    tree = tree.copy()
    tree.insert(0, "series", series_labels(tree, ch.varying))
    depth: dict[tuple[str, str, int], int] = {}
    levels = []
    for cell, prompt, node, parent in zip(tree["cell_id"], tree["prompt_id"], tree["node"], tree["parent_node"]):
        level = depth.setdefault((cell, prompt, node), depth.get((cell, prompt, parent), -1) + 1)
        levels.append(level)
    tree.insert(tree.columns.get_loc("node"), "depth", levels)
    ch.splits = tree
    return ch


def of_analysis(analysis: Analysis) -> Charts:
    """The data of every chart (report and `harness plot`), splits included, part by part where the
    analysis reads a campaign in parts."""
    return joined(analysis.per_part(chart_part), analysis)
