"""Upper bounds on a divergence rate: exact (Clopper-Pearson) for independent runs, and a test by
betting over prompts where runs of one prompt are not independent."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np


@lru_cache(maxsize=65536)
def upper95(diverged: int, runs: int) -> float | None:
    """Exact one-sided 95 % upper bound on the divergence rate (Clopper-Pearson).

    The largest rate p under which seeing at most `diverged` of `runs` still has probability
    0.05. For 0 of n that is 1 - 0.05**(1/n) (0.259 for n = 10; the "rule of three", 3/n, is
    its large-n approximation); for n of n it is 1. Monotone in `diverged`.
    """
    if runs <= 0:
        return None
    if diverged <= 0:
        return 1.0 - 0.05 ** (1.0 / runs)
    if diverged >= runs:
        return 1.0
    k = np.arange(diverged + 1)
    log_choose = math.lgamma(runs + 1) - np.array([math.lgamma(i + 1) + math.lgamma(runs - i + 1) for i in k])

    def tail(p: float) -> float:  # P(X <= diverged | runs, p), decreasing in p
        logs = log_choose + k * math.log(p) + (runs - k) * math.log1p(-p)
        top = logs.max()
        return float(math.exp(top) * np.exp(logs - top).sum())

    lo, hi = diverged / runs, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > 0.05:
            lo = mid
        else:
            hi = mid
    return hi


#: resamples of a paired cluster bootstrap (seeded: the same rows give the same figure); used for a
#: one-sided p only (guarantees.excess_by_prompt), never for a bound
CLUSTER_DRAWS = 2000


def prompt_upper95(diverged: Sequence[int], compared: Sequence[int]) -> float:
    """A one-sided 95 % upper bound on a setting's divergence rate with prompts, not runs, as the
    independent unit (runs of one prompt share its text and its near ties: they are not
    independent evidence): the mean over prompts of each prompt's rate. Arrays hold one entry per prompt.

    No divergence: 1 - 0.05 ** (1 / prompts), the exact bound as if each prompt were one trial (a
    prompt of rate r shows no divergence with chance at most 1 - r). Divergences over two or more
    prompts: a test by betting on the prompts' observed rates, each in [0, 1] (bounded_mean_upper),
    valid at every prompt count, and never below the pooled bound (`upper95` over all runs), which
    accounts for the binomial noise inside each prompt. A percentile bootstrap over prompts, used
    before, held 90 % where 95 % was promised at 10 prompts (tests/test_deeper_stats.py).
    Divergences in a single prompt: NaN, since one prompt cannot speak for others.
    """
    d = np.asarray(diverged, dtype=float)
    n = np.asarray(compared, dtype=float)
    keep = n > 0
    d, n = d[keep], n[keep]
    if not len(n):
        return float("nan")
    total = int(d.sum())
    if total == 0:
        return 1.0 - 0.05 ** (1.0 / len(n))
    if len(n) < 2:
        return float("nan")
    return float(max(bounded_mean_upper(d / n, 0.0, 1.0), upper95(total, int(n.sum())) or 0.0))


#: the bets a prompt-level bound mixes (harness.analysis.bounds.bounded_mean_upper): fractions of the
#: largest stake a test may make, and how much of the capital each one starts with. Fixed before any
#: data, so the mixture is itself a test martingale; the largest stake gets most, since most prompts of
#: a determinism run show no excess at all, where the largest stake is the one that learns fastest.
_STAKES = np.array([1.0, 0.75, 0.5, 0.25, 0.1])
_STAKE_WEIGHTS = np.array([0.4, 0.15, 0.15, 0.15, 0.15])


def bounded_mean_upper(values: Sequence[float], low: float, high: float, alpha: float = 0.05) -> float:
    """A one-sided (1 - alpha) upper bound on the mean of independent draws known to lie in [low, high],
    valid at every sample size: a test by betting (Waudby-Smith and Ramdas, 2023). For each candidate
    mean m, a gambler who bets against "the mean is m" with stakes fixed in advance grows capital
    K(m) = prod_i (1 + s (m - y_i) / (1 - m)) (values scaled to [0, 1]); under "the mean is m" that
    capital is a fair game, so by Ville's inequality it reaches 1/alpha with chance at most alpha.
    The bound is the smallest m at which the mixture over stakes reaches 1/alpha (K grows with m).

    No shape is assumed and no resampling is done, so few draws give wide bounds, as they must: n
    draws all at `low` give at least low + (high - low) * (1 - alpha ** (1 / n)), the exact bound of
    n all-or-nothing trials that all came out nothing (0.259 of the range for n = 10). No draws: high.
    """
    y = (np.asarray(values, dtype=float) - low) / (high - low)
    if not len(y):
        return float(high)
    y = np.clip(y, 0.0, 1.0)
    threshold = math.log(1.0 / alpha)

    def log_capital(m: float) -> float:
        factors = 1.0 + _STAKES[:, None] * (m - y[None, :]) / (1.0 - m)
        with np.errstate(divide="ignore"):
            logs = np.log(np.clip(factors, 0.0, None)).sum(axis=1) + np.log(_STAKE_WEIGHTS)
        top = logs.max()
        return float(top + math.log(np.exp(logs - top).sum())) if np.isfinite(top) else -math.inf

    lo, hi = float(y.mean()), 1.0
    if lo >= 1.0:  # every draw at the top: nothing above it to bet on
        return float(high)
    if log_capital(lo) >= threshold:  # cannot happen for a mean at the data's own mean; kept for safety
        return float(low + (high - low) * lo)
    for _ in range(36):  # to 1e-11 of the range
        mid = (lo + hi) / 2
        if log_capital(mid) >= threshold:
            hi = mid
        else:
            lo = mid
    return float(low + (high - low) * hi)
