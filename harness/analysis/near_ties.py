"""Flips per near tie: how often runs depart from their reference, per chance they had to.

A batch-induced departure is a flip of a close call: the top two candidates of a step were nearly
tied, and a change in the arithmetic put the other one first. A count of departures means little
without the number of close calls the outputs went through, so each compared run is read against
its reference run's per-step top-1 minus top-2 margin (a logit gap; a log-probability gap is the
same number):

    steps at risk    the reference's steps from the first through the one where the run departs
                     (all of them, up to the shorter output's length, for a run that stays identical)
    near_ties        steps at risk whose reference margin is below eps
    near_tie_density near_ties per 1000 steps at risk
    flips            runs that departed (a run departs once: after that, it is another text)
    flips_at_near_ties  those departing at a step whose reference margin is below eps
    flips_per_near_tie  flips_at_near_ties / near_ties

By margin bucket, per setting: the steps at risk in the bucket, the departures at a step of that
bucket, and their ratio, the chance per step that a run departs given how close its reference's
call was. Runs whose reference has no margins recorded (an engine that returns none) are counted
in `runs_without_margins` and left out of the rest.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from harness.analysis.frames import setting_ids
from harness.results.columns import keys_of

#: the default eps: the margin below which a step is a near tie (also the logit probes' threshold)
NEAR_TIE = 0.1
#: margin bucket edges; the buckets are [0, e0), [e0, e1), ..., [last, inf)
EDGES = (0.01, 0.1, 0.5, 1.0, 2.0, 4.0)
SETTING_COLUMNS = ["runs", "runs_without_margins", "steps_at_risk", "near_ties", "near_tie_density", "flips",
                   "flips_at_near_ties", "flips_per_near_tie"]
BUCKET_COLUMNS = ["bucket", "margin_low", "margin_high", "steps", "flips", "flip_rate"]


def bucket_labels(edges: tuple[float, ...] = EDGES) -> list[str]:
    bounds = (0.0,) + edges
    return [f"{lo:g}-{hi:g}" for lo, hi in zip(bounds, edges)] + [f">={edges[-1]:g}"]


def reference_margins(judged: pd.DataFrame, margins_for: Callable[[pd.DataFrame], pd.Series]) -> dict:
    """Per (reference cell, prompt) of the `judged` runs, the margins of the run that stands for it: read
    by its cell and repeat, so a run is read with its reference's margins wherever that run lies (a
    part that holds some runs of a prompt need not hold its reference run)."""
    refs = (judged[["reference_cell", "prompt_id", "reference_repeat"]].drop_duplicates(["reference_cell", "prompt_id"])
            .rename(columns={"reference_cell": "cell_id", "reference_repeat": "repeat"}).reset_index(drop=True))
    return dict(zip(zip(refs["cell_id"], refs["prompt_id"]), margins_for(refs)))


def per_run(compared: pd.DataFrame, margins_for: Callable[[pd.DataFrame], pd.Series], eps: float = NEAR_TIE,
            edges: tuple[float, ...] = EDGES) -> pd.DataFrame:
    """Per compared run: steps at risk, near ties, per-bucket steps, where it departed and the
    reference's margin there (`flip_margin`, NaN where it stayed identical, departed past the
    reference's end, or the reference has no margins)."""
    judged = compared.loc[compared["matched"].notna(), list(dict.fromkeys(keys_of(compared) + [
        "cell_id", "reference_cell", "prompt_id", "repeat", "first_divergence", "n_tokens"]))]
    margins = reference_margins(compared.loc[compared["matched"].notna()], margins_for)
    buckets = len(edges) + 1
    out = np.full((len(judged), 5 + buckets), np.nan)  # steps, near, flip bucket, flip near, flip margin, bucket steps
    departed = judged["first_divergence"].to_numpy(dtype=float)
    length = judged["n_tokens"].to_numpy(dtype=float)
    groups = judged.groupby(["reference_cell", "prompt_id"], sort=False, observed=True).indices
    for key, rows in groups.items():
        values = margins.get(key)
        if values is None:
            continue
        m = np.asarray(values, dtype=float)
        known = ~np.isnan(m)
        near = np.concatenate([[0], np.cumsum(known & (m < eps))])
        which = np.where(known, np.searchsorted(edges, m, side="right"), -1)
        counts = np.zeros((buckets, len(m) + 1))
        for b in range(buckets):
            counts[b, 1:] = np.cumsum(which == b)
        idx = np.asarray(rows)
        d = departed[idx]
        window = np.where(np.isnan(d), length[idx], d + 1).astype(np.int64)
        window = np.minimum(window, len(m))
        out[idx, 0] = np.concatenate([[0], np.cumsum(known)])[window]
        out[idx, 1] = near[window]
        inside = ~np.isnan(d) & (np.nan_to_num(d, nan=-1) < len(m))
        at = np.nan_to_num(d, nan=0).astype(np.int64).clip(0, max(len(m) - 1, 0))
        flip_bucket = np.where(inside & (len(m) > 0), which[at] if len(m) else -1, -1)
        out[idx, 2] = np.where(flip_bucket >= 0, flip_bucket, np.nan)
        out[idx, 3] = np.where(flip_bucket >= 0, (m[at] < eps) if len(m) else False, np.nan)
        out[idx, 4] = np.where(flip_bucket >= 0, m[at] if len(m) else np.nan, np.nan)
        out[idx, 5:] = counts[:, window].T
    frame = judged[list(dict.fromkeys(["cell_id", "prompt_id", "repeat", "first_divergence"] + keys_of(compared)))]
    frame["has_margins"] = ~np.isnan(out[:, 0])
    frame["departed"] = ~np.isnan(departed)
    frame["steps"], frame["near"] = out[:, 0], out[:, 1]
    frame["flip_bucket"], frame["flip_near"], frame["flip_margin"] = out[:, 2], out[:, 3], out[:, 4]
    for b in range(buckets):
        frame[f"b{b}"] = out[:, 5 + b]
    return frame


def count(compared: pd.DataFrame, margins_for: Callable[[pd.DataFrame], pd.Series], eps: float = NEAR_TIE,
          edges: tuple[float, ...] = EDGES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per setting: SETTING_COLUMNS; per setting and margin bucket: BUCKET_COLUMNS)."""
    return count_runs(per_run(compared, margins_for, eps, edges), keys_of(compared), edges)


def count_runs(runs: pd.DataFrame, keys: list[str], edges: tuple[float, ...] = EDGES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """count() of per_run()'s frame, for a caller that keeps the per-run frame as well."""
    return from_sums(sums(runs, keys, edges), keys, edges)


def sums(runs: pd.DataFrame, keys: list[str], edges: tuple[float, ...] = EDGES) -> pd.DataFrame:
    """Per setting of per_run()'s frame: the counts every near-tie figure is made of (runs, steps, near
    ties, flips, per margin bucket too). Whole numbers that add up over disjoint runs, so a campaign's
    parts give the folder's figures exactly (harness.analysis.partitioned)."""
    labels = bucket_labels(edges)
    names = ["runs", "runs_without_margins", "steps_at_risk", "near_ties", "flips", "flips_at_near_ties"] + \
        [f"{what}{b}" for b in range(len(labels)) for what in ("steps", "flips")]
    if runs.empty:
        return pd.DataFrame(columns=keys + names)
    seen = runs["has_margins"].to_numpy()
    flip_bucket = runs["flip_bucket"].to_numpy()
    # one pass over the runs: every per-setting sum is a column summed by setting
    parts = {"runs": np.ones(len(runs)), "runs_without_margins": (~seen).astype(float),
             "steps_at_risk": np.where(seen, runs["steps"], 0.0), "near_ties": np.where(seen, runs["near"], 0.0),
             "flips": (seen & runs["departed"].to_numpy()).astype(float),
             "flips_at_near_ties": np.where(seen, runs["flip_near"].fillna(0), 0.0)}
    for b in range(len(labels)):
        parts[f"steps{b}"] = np.where(seen, runs[f"b{b}"], 0.0)
        parts[f"flips{b}"] = (seen & (flip_bucket == b)).astype(float)
    number, known = setting_ids(runs, keys)
    return pd.concat([known, pd.DataFrame(parts)[names].groupby(number).sum().reindex(range(len(known)), fill_value=0)],
                     axis=1)


def from_sums(summed: pd.DataFrame, keys: list[str], edges: tuple[float, ...] = EDGES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per setting: SETTING_COLUMNS; per setting and margin bucket: BUCKET_COLUMNS) from `sums`, the
    records of one setting added first (a campaign's parts each give their own)."""
    labels = bucket_labels(edges)
    if summed.empty:
        return pd.DataFrame(columns=keys + SETTING_COLUMNS), pd.DataFrame(columns=keys + BUCKET_COLUMNS)
    sums = summed.groupby(keys, dropna=False, sort=True, observed=True).sum().reset_index()
    settings = sums[keys].copy()
    for column in ("runs", "runs_without_margins", "steps_at_risk", "near_ties", "flips", "flips_at_near_ties"):
        settings[column] = sums[column].astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        settings["near_tie_density"] = np.where(sums["steps_at_risk"] > 0,
                                                1000.0 * sums["near_ties"] / sums["steps_at_risk"], np.nan)
        settings["flips_per_near_tie"] = np.where(sums["near_ties"] > 0,
                                                  sums["flips_at_near_ties"] / sums["near_ties"], np.nan)
    lows, highs = (0.0,) + edges, edges + (np.nan,)  # the last bucket has no upper edge
    buckets = []
    for b, label in enumerate(labels):
        part = sums[keys].assign(bucket=label, margin_low=lows[b], margin_high=highs[b],
                                 steps=sums[f"steps{b}"].astype(np.int64), flips=sums[f"flips{b}"].astype(np.int64))
        with np.errstate(divide="ignore", invalid="ignore"):
            part["flip_rate"] = np.where(part["steps"] > 0, part["flips"] / part["steps"], np.nan)
        part["_order"] = np.arange(len(part)) * len(labels) + b
        buckets.append(part)
    by_bucket = pd.concat(buckets, ignore_index=True).sort_values("_order").drop(columns="_order")
    return settings[keys + SETTING_COLUMNS], by_bucket[keys + BUCKET_COLUMNS].reset_index(drop=True)
