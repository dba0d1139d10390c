"""Upper bounds on a divergence rate: exact (Clopper-Pearson) for independent runs, and a cluster
bootstrap over prompts where runs of one prompt are not independent."""

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


#: resamples of the prompt-clustered bound (seeded: the same rows give the same bound)
CLUSTER_DRAWS = 2000


def prompt_upper95(diverged: Sequence[int], compared: Sequence[int], seed: int = 0) -> float:
    """A one-sided 95 % upper bound on a setting's divergence rate with prompts, not runs, as the
    independent unit (runs of one prompt share its text and its near ties: they are not
    independent evidence). Arrays hold one entry per prompt.

    No divergence: 1 - 0.05 ** (1 / prompts), the exact bound as if each prompt were one trial.
    Divergences over two or more prompts: the 95th percentile of the pooled rate over prompts
    resampled with replacement (a cluster bootstrap), and never below the pooled bound
    (`upper95` over all runs), which accounts for the binomial noise inside each prompt.
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
    pick = np.random.default_rng(seed).integers(0, len(n), size=(CLUSTER_DRAWS, len(n)))
    rates = d[pick].sum(axis=1) / n[pick].sum(axis=1)
    return float(max(np.percentile(rates, 95), upper95(total, int(n.sum())) or 0.0))
