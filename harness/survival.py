"""Survival of agreement: the share of runs still identical to their reference after t tokens.

A run that departs from its reference at token index d (its first d tokens agree) is an event at
t = d + 1: it is identical through d tokens, not through d + 1. A run identical to its reference
is censored at its length n: it agreed through n tokens, and what it would have done after is
unknown (both outputs ended, or max_tokens cut them). The Kaplan-Meier estimate is

    S(t) = prod over event times u <= t of (1 - e_u / r_u)

with e_u the runs departing at u and r_u the runs still at risk there (time >= u). Its pointwise
95 % band is Greenwood's variance on the log(-log S) scale; where S is still 1 (no run has
departed yet) the band's low end is the exact binomial bound for r of r (0.025 ** (1 / r)), and
where S is 0 its high end is that for 0 of r: a band never claims more than the runs show.
The median tokens to divergence is the smallest d with S(d + 1) <= 0.5, in the units of
`first_divergence` (the index of the first token that differs); NaN when fewer than half depart.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.metrics import keys_of

CURVE_COLUMNS = ["tokens", "at_risk", "departed", "censored", "identical", "low", "high"]
Z95 = 1.959963984540054


def times(compared: pd.DataFrame) -> pd.DataFrame:
    """Each compared run's (time, event): event runs at first_divergence + 1, identical runs
    censored at their length."""
    judged = compared[compared["matched"].notna()]
    event = judged["first_divergence"].notna().to_numpy()
    time = np.where(event, judged["first_divergence"].fillna(0).to_numpy(dtype=float) + 1,
                    judged["n_tokens"].to_numpy(dtype=float))
    return judged.assign(time=time.astype(np.int64), event=event)


def kaplan_meier(time: np.ndarray, event: np.ndarray) -> pd.DataFrame:
    """The step curve at t = 0 and at each distinct time (CURVE_COLUMNS)."""
    order = np.argsort(time, kind="stable")
    time, event = np.asarray(time)[order], np.asarray(event, dtype=bool)[order]
    at, first = np.unique(time, return_index=True)
    departed = np.add.reduceat(event.astype(np.int64), first) if len(time) else np.array([], dtype=np.int64)
    ended = np.diff(np.append(first, len(time)))
    at_risk = len(time) - first
    with np.errstate(divide="ignore", invalid="ignore"):
        step = 1.0 - departed / at_risk
        survive = np.cumprod(step)
        greenwood = np.cumsum(np.where(at_risk > departed, departed / (at_risk * (at_risk - departed)), 0.0))
        log_s = np.log(survive)
        se = np.sqrt(greenwood) / np.abs(log_s)
        low = survive ** np.exp(Z95 * se)
        high = survive ** np.exp(-Z95 * se)
    untouched = survive >= 1.0
    low = np.where(untouched, 0.025 ** (1.0 / at_risk), low)
    high = np.where(untouched, 1.0, high)
    gone = survive <= 0.0
    low = np.where(gone, 0.0, low)
    high = np.where(gone, 1.0 - 0.025 ** (1.0 / at_risk), high)
    # t = 0 stands for the step up to the first time: S is 1 there, known from all the runs
    head = pd.DataFrame({"tokens": [0], "at_risk": [len(time)], "departed": [0], "censored": [0], "identical": [1.0],
                         "low": [0.025 ** (1.0 / len(time)) if len(time) else np.nan], "high": [1.0]})
    body = pd.DataFrame({"tokens": at, "at_risk": at_risk, "departed": departed, "censored": ended - departed,
                         "identical": survive, "low": low, "high": high})
    return pd.concat([head, body[body["tokens"] > 0]], ignore_index=True)[CURVE_COLUMNS]


def median_tokens(curve: pd.DataFrame) -> float:
    """The smallest first-divergence index d with S(d + 1) <= 0.5; NaN when the curve stays above."""
    below = curve[curve["identical"] <= 0.5]
    return float(below["tokens"].iloc[0] - 1) if len(below) else float("nan")


def curves(compared: pd.DataFrame) -> pd.DataFrame:
    """One curve per setting (the compared runs' keys, all prompts together), in long form: the
    setting's keys, then CURVE_COLUMNS."""
    keys = keys_of(compared)
    runs = times(compared)
    parts = []
    for key, part in runs.groupby(keys, dropna=False, sort=True, observed=True):
        curve = kaplan_meier(part["time"].to_numpy(), part["event"].to_numpy())
        for column, value in zip(keys, key if isinstance(key, tuple) else (key,)):
            curve.insert(len(curve.columns) - len(CURVE_COLUMNS), column, value)
        parts.append(curve)
    if not parts:
        return pd.DataFrame(columns=keys + CURVE_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def medians(curve_frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting of `curves`: runs, runs that departed, and the median tokens to divergence."""
    keys = [c for c in curve_frame.columns if c not in CURVE_COLUMNS]
    records = []
    for key, curve in curve_frame.groupby(keys, dropna=False, sort=True, observed=True):
        records.append(dict(zip(keys, key if isinstance(key, tuple) else (key,))) | {
            "runs": int(curve["at_risk"].iloc[0]), "departed": int(curve["departed"].sum()),
            "median_tokens_to_divergence": median_tokens(curve),
        })
    return pd.DataFrame(records, columns=keys + ["runs", "departed", "median_tokens_to_divergence"])
