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
`first_divergence` (the index of the first token that differs); NaN when the curve never falls to
one half. "<= 0.5" is judged with a tolerance of HALF_TOLERANCE: a product of factors such as
0.7 * (5 / 7) comes out as 0.5000000000000001 in floating point, and the median must not jump to
the next departure for that. `departed_by_median` counts the runs that had departed by then: with
runs that ended early (censored) it can be fewer than half of them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.analysis.frames import setting_ids
from harness.results.columns import keys_of

CURVE_COLUMNS = ["tokens", "at_risk", "departed", "censored", "identical", "low", "high"]
#: S(t) this close above one half counts as one half (floating-point products of exact fractions)
HALF_TOLERANCE = 1e-9
Z95 = 1.959963984540054


def times(compared: pd.DataFrame) -> pd.DataFrame:
    """Each compared run's (time, event): event runs at first_divergence + 1, identical runs
    censored at their length."""
    judged = compared.loc[compared["matched"].notna(),
                          keys_of(compared) + ["cell_id", "first_divergence", "n_tokens"]]
    event = judged["first_divergence"].notna().to_numpy()
    time = np.where(event, judged["first_divergence"].fillna(0).to_numpy(dtype=float) + 1,
                    judged["n_tokens"].to_numpy(dtype=float))
    return judged.assign(time=time.astype(np.int64), event=event)


def counts(compared: pd.DataFrame) -> pd.DataFrame:
    """Per setting and time: the compared runs that ended there (`ended`) and those of them that
    departed (`departed`). Counts of disjoint runs add up, so a campaign's parts give the folder's
    curves exactly (harness.analysis.partitioned): `curves` is `from_counts` of these."""
    keys = keys_of(compared)
    runs = times(compared)
    if runs.empty:
        return pd.DataFrame(columns=keys + ["tokens", "ended", "departed"])
    group, settings = setting_ids(runs, keys)
    per = (pd.DataFrame({"group": group, "tokens": runs["time"].to_numpy(), "event": runs["event"].to_numpy(np.int64)})
           .groupby(["group", "tokens"], sort=True).agg(ended=("event", "size"), departed=("event", "sum"))
           .reset_index())
    front = settings.iloc[per["group"].to_numpy()].reset_index(drop=True)
    return pd.concat([front, per[["tokens", "ended", "departed"]]], axis=1)


def from_counts(counted: pd.DataFrame) -> pd.DataFrame:
    """One curve per setting of `counts` (rows of the same setting and time added first), in long form:
    the setting's keys, then CURVE_COLUMNS, each setting from t = 0 on."""
    keys = [c for c in counted.columns if c not in ("tokens", "ended", "departed")]
    if counted.empty:
        return pd.DataFrame(columns=keys + CURVE_COLUMNS)
    summed = (counted.groupby(keys + ["tokens"], dropna=False, sort=True, observed=True)[["ended", "departed"]]
              .sum().reset_index())
    group = summed.groupby(keys, dropna=False, sort=True, observed=True).ngroup().to_numpy()
    settings = summed.loc[~pd.Series(group).duplicated().to_numpy(), keys].reset_index(drop=True)
    out = _curves(group, summed["tokens"].to_numpy(np.int64), summed["ended"].to_numpy(np.int64),
                  summed["departed"].to_numpy(np.int64))
    return pd.concat([settings.iloc[out["group"].to_numpy()].reset_index(drop=True), out[CURVE_COLUMNS]], axis=1)


def _curves(group: np.ndarray, time: np.ndarray, ended: np.ndarray, departed_at: np.ndarray) -> pd.DataFrame:
    """Every group's curve at once (hundreds of settings in one pass) from its runs ended and departed
    per time (`group` sorted, times sorted within it): the `group` column, then CURVE_COLUMNS."""
    counts = pd.DataFrame({"group": group, "tokens": time, "ended": ended, "departed": departed_at})
    by = counts.groupby("group", sort=False)
    at_risk = (by["ended"].transform("sum") - by["ended"].cumsum() + counts["ended"]).to_numpy(dtype=float)
    departed = counts["departed"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.log1p(-departed / at_risk)  # -inf where every run at risk departs
        survive = np.exp(pd.Series(step).groupby(counts["group"].to_numpy()).cumsum().to_numpy())
        term = np.where(at_risk > departed, departed / (at_risk * (at_risk - departed)), 0.0)
        greenwood = pd.Series(term).groupby(counts["group"].to_numpy()).cumsum().to_numpy()
        se = np.sqrt(greenwood) / np.abs(np.log(survive))
        low = survive ** np.exp(Z95 * se)
        high = survive ** np.exp(-Z95 * se)
    untouched, gone = survive >= 1.0, survive <= 0.0
    low = np.where(gone, 0.0, np.where(untouched, 0.025 ** (1.0 / at_risk), low))
    high = np.where(gone, 1.0 - 0.025 ** (1.0 / at_risk), np.where(untouched, 1.0, high))
    body = pd.DataFrame({"group": counts["group"], "tokens": counts["tokens"], "at_risk": at_risk.astype(np.int64),
                         "departed": departed.astype(np.int64),
                         "censored": (counts["ended"] - counts["departed"]).to_numpy(), "identical": survive,
                         "low": low, "high": high})
    # t = 0 stands for the step up to the first time: S is 1 there, known from all of the group's runs
    sizes = counts.groupby("group", sort=True)["ended"].sum()
    head = pd.DataFrame({"group": sizes.index, "tokens": 0, "at_risk": sizes.to_numpy(), "departed": 0, "censored": 0,
                         "identical": 1.0, "low": 0.025 ** (1.0 / sizes.to_numpy()), "high": 1.0})
    out = pd.concat([head, body[body["tokens"] > 0]], ignore_index=True)
    return out.sort_values(["group", "tokens"], kind="stable").reset_index(drop=True)[["group"] + CURVE_COLUMNS]


def curves(compared: pd.DataFrame) -> pd.DataFrame:
    """One curve per setting (the compared runs' keys, all prompts together), in long form: the
    setting's keys, then CURVE_COLUMNS."""
    return from_counts(counts(compared))


def medians(curve_frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting of `curves`: runs, runs that departed, the median tokens to divergence and the runs
    that had departed by it."""
    keys = [c for c in curve_frame.columns if c not in CURVE_COLUMNS]
    columns = keys + ["runs", "departed", "median_tokens_to_divergence", "departed_by_median"]
    if curve_frame.empty:
        return pd.DataFrame(columns=columns)
    group = curve_frame.groupby(keys, dropna=False, sort=False, observed=True).ngroup()
    by = curve_frame.groupby(group, sort=False)
    first = curve_frame[~group.duplicated()].set_index(group[~group.duplicated()])
    so_far = by["departed"].cumsum()
    below = curve_frame[curve_frame["identical"] <= 0.5 + HALF_TOLERANCE]
    at = below.groupby(group[below.index], sort=False).head(1)
    median = pd.Series(at["tokens"].to_numpy() - 1, index=group[at.index].to_numpy())
    by_then = pd.Series(so_far[at.index].to_numpy(), index=median.index)
    return pd.DataFrame({**{k: first[k] for k in keys}, "runs": first["at_risk"], "departed": by["departed"].sum(),
                         "median_tokens_to_divergence": median.reindex(first.index).astype(float),
                         "departed_by_median": by_then.reindex(first.index).astype(float)})[columns] \
        .reset_index(drop=True)
