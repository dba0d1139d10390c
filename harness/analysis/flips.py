"""Flip classes: which departures from the reference are expected noise and which are likely bugs.

A greedy run departs from its reference where another token came first. How surprising that is
depends on the reference's top-1 minus top-2 margin at that step (a logit gap, which is also the
log-probability gap):

    exact_tie     margin 0: the two candidates were equal, and either order is right
    near_tie      0 < margin < eps (the near-tie threshold, NEAR_TIE = 0.1 by default): the size of
                  the moves batch order and rounding make (bf16 rounding alone is up to 0.0625 near 16)
    ordinary      eps <= margin < confident
    confident     margin >= confident (CONFIDENT = 2.0 by default): top-1 was at least e^2 = 7.4
                  times as likely as top-2. A change of summation order moves logits by far less
                  (measured on these CPUs: at most 2.5e-5 in F32 and 0.05 in F16 between batch
                  sizes, shared/brief.md), so a flip here is a likely bug (vLLM #51902: a kernel
                  broke batch invariance when an unrelated prefill crossed 9 -> 10 tokens), not noise
    sampled       the run sampled (temperature > 0): a draw that falls near a boundary of the
                  cumulative distribution flips at any margin, so the margin does not classify it
    unclassified  the reference has no margin at that step (an engine that returns none, or the
                  run departs after the reference's last token)

`per_run` classifies each departed run of near_ties.per_run's frame; `per_setting` counts the
classes per setting (`flips_<class>`), beside the near-tie figures of the settings table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.analysis.near_ties import NEAR_TIE

#: the default margin (nats) at or above which a flip is confident: a likely bug
CONFIDENT = 2.0
CLASSES = ("exact_tie", "near_tie", "ordinary", "confident", "sampled", "unclassified")
#: the per-setting count columns, one per class
COUNT_COLUMNS = [f"flips_{c}" for c in CLASSES]
RUN_COLUMNS = ["cell_id", "prompt_id", "repeat", "first_divergence", "flip_margin", "flip_class"]


def check_thresholds(eps: float, confident: float) -> None:
    """A near tie is a smaller margin than a confident one: refuse thresholds the other way round."""
    if not 0 <= eps <= confident:
        raise ValueError(f"near-tie threshold {eps:g} must be at least 0 and at most the confident margin {confident:g}")


def classify(margin: np.ndarray, sampled: np.ndarray, eps: float = NEAR_TIE, confident: float = CONFIDENT) -> np.ndarray:
    """The class of each departure from its reference margin (NaN: none) and whether it sampled."""
    check_thresholds(eps, confident)
    margin = np.asarray(margin, dtype=float)
    return np.select(
        [np.asarray(sampled, dtype=bool), np.isnan(margin), margin <= 0, margin < eps, margin < confident],
        ["sampled", "unclassified", "exact_tie", "near_tie", "ordinary"], default="confident").astype(object)


def per_run(runs: pd.DataFrame, keys: list[str], eps: float = NEAR_TIE, confident: float = CONFIDENT) -> pd.DataFrame:
    """The departed runs of near_ties.per_run's frame, with the setting `keys`, RUN_COLUMNS and
    the class of each; the runs that stayed identical are not flips and are left out."""
    departed = runs[runs["departed"]] if not runs.empty else runs
    out = departed[[c for c in dict.fromkeys(keys + RUN_COLUMNS[:-1]) if c in departed]].copy()
    sampled = (out["temperature"].astype(float) > 0).to_numpy() if "temperature" in out else np.zeros(len(out), bool)
    out["flip_class"] = classify(out["flip_margin"].to_numpy(dtype=float), sampled, eps, confident) if len(out) else []
    return out.reset_index(drop=True)


def per_setting(flips: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per setting that has departures: how many of them fell in each class (COUNT_COLUMNS)."""
    if flips.empty:
        return pd.DataFrame(columns=keys + COUNT_COLUMNS)
    counts = (flips.groupby(keys + ["flip_class"], dropna=False, observed=True).size()
              .unstack("flip_class", fill_value=0).reindex(columns=list(CLASSES), fill_value=0))
    counts.columns = COUNT_COLUMNS
    return counts.reset_index()


def likely_bugs(flips: pd.DataFrame) -> pd.DataFrame:
    """The confident flips, largest margin first: the departures a report marks as likely bugs."""
    if flips.empty:
        return flips
    return flips[flips["flip_class"] == "confident"].sort_values("flip_margin", ascending=False, kind="stable")
