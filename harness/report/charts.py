"""The numbers behind the charts, computed once for both the HTML report and `harness plot`.

Every chart is a small table, so a paper's figure can be redrawn or checked from the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from harness.analysis.folder_analysis import Analysis
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


def compute(analysis: Analysis) -> Charts:
    """The charts of one analysis: its report rows, their pairing with the reference, and its answer,
    slowdown, survival and near-tie statistics. Margins are read for the departing runs and their
    references only."""
    rows, annotated = analysis.report_rows, analysis.paired
    margins_for = analysis.results.margins_for
    varying = varying_axes(rows)
    answers = analysis.answers
    if not answers.empty:
        answers = _labelled(answers, varying)
    judged = annotated[annotated["matched"].notna()].copy()
    judged["series"] = series_labels(judged, varying)
    identical = (
        judged.assign(identical=judged["matched"].astype(bool))
        .groupby(["series", "batch_size"], sort=True)
        .agg(compared=("identical", "size"), identical=("identical", "sum"))
        .reset_index()
    )
    identical["share"] = identical["identical"] / identical["compared"]

    split = judged[judged["first_divergence"].notna()].copy()
    divergence = split[["series", "batch_size", "first_divergence"]].astype({"first_divergence": int})

    first = annotated[annotated["is_reference"]]  # the runs that stand for their cells
    first = first[first["cell_id"].isin(set(split["reference_cell"].dropna()))]
    margin_of = {(c, p): m for c, p, m in zip(first["cell_id"], first["prompt_id"], margins_for(first))}
    records = {}
    for index, r, run_margins in zip(split.index, split.itertuples(index=False), margins_for(split)):
        k = int(r.first_divergence)
        records[index] = {
            "series": r.series, "batch_size": r.batch_size, "prompt_id": r.prompt_id, "first_divergence": k,
            "margin_run": step_value(run_margins, k),
            "margin_reference": step_value(margin_of.get((r.reference_cell, r.prompt_id)), k),
        }
    margins = pd.DataFrame.from_dict(records, orient="index", columns=[
        "series", "batch_size", "prompt_id", "first_divergence", "margin_run", "margin_reference"])
    return Charts(
        identical=identical,
        divergence=divergence.reset_index(drop=True),
        margins=margins,
        slowdown=_labelled(analysis.slowdown, [v for v in varying if v != "batch_invariant"]),
        reference=_reference_label(analysis),
        varying=varying,
        answers=answers,
        survival=_series_first(analysis.survival, varying),
        flips_by_margin=_series_first(analysis.flips_by_margin, varying),
    )


def _reference_label(analysis: Any) -> str:
    """'batch_size=1' (first run) or 'batch_size=1, modal run'."""
    label = ",".join(f"{k}={v}" for k, v in analysis.reference.items())
    return label if analysis.reference_run == "first" else f"{label}, {analysis.reference_run} run"


def _series_first(frame: pd.DataFrame, varying: list[str]) -> pd.DataFrame:
    """A per-setting frame as a chart reads it: series and batch size, then its own columns."""
    keys = keys_of(frame)
    out = _labelled(frame, varying)
    return out[["series", X_AXIS] + [c for c in frame.columns if c not in keys]]


def add_splits(ch: Charts, rows: pd.DataFrame, tokens_for: Any, texts_for: Any) -> Charts:
    """The split trees of these rows (harness.analysis.splits), labelled like the other charts' series.

    `depth` is 0 for a cell's first split, 1 for a split inside one of its branches, and so on.
    """
    from harness.analysis.splits import splits

    tree = splits(rows, tokens_for, texts_for, keys_of(rows))
    if tree.empty:
        return ch
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
    """The data of every chart (report and `harness plot`), splits included."""
    r = analysis.results
    data = compute(analysis)
    add_splits(data, analysis.report_rows, r.tokens_for, r.texts_for)
    return data
