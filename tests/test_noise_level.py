"""Issue 65: `within_noise` holds its level. A seeded simulation of folders whose setting truly departs
more often than its floor by more than the margin (0.12 and 0.20 against 0.10): the share of folders
called within_noise stays at or below 5 % at every prompt count (1 to 50) and repeat count (2 to 100),
both where the excess is spread over every prompt and where it sits in a few prompts (the case a
percentile bootstrap over prompts misses: no spread when the departing prompts coincide)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.analysis import guarantees

FOLDERS = 150


def _concentrated(rng, prompts: int, excess: float):
    """A share `excess` of prompts departs in every run of the setting and never in the floor; the rest
    depart alike in both (never, or at 10 % or 50 %)."""
    hit = rng.random(prompts) < excess
    shared = rng.choice([0.0, 0.0, 0.1, 0.5], size=prompts)
    return np.where(hit, 1.0, shared), np.where(hit, 0.0, shared)


def _spread(rng, prompts: int, excess: float):
    """Every prompt departs in the floor at a rate up to 30 %, and `excess` more often in the setting."""
    floor = rng.uniform(0.0, 0.3, size=prompts)
    return np.clip(floor + excess, 0, 1), floor


def _within_share(shape, prompts: int, repeats: int, excess: float, seed: int) -> float:
    rng = np.random.default_rng(seed)
    called = 0
    for _ in range(FOLDERS):
        rate1, rate0 = shape(rng, prompts, excess)
        d1, d0 = rng.binomial(repeats, rate1), rng.binomial(repeats, rate0)
        n = np.full(prompts, repeats)
        if d0.sum() == 0:  # a floor that never departs gives no within_noise at all
            continue
        called += guarantees.excess_upper(d1, n, d0, n) <= guarantees.NOISE_MARGIN
    return called / FOLDERS


@pytest.mark.parametrize("shape", [_concentrated, _spread], ids=["concentrated", "spread"])
@pytest.mark.parametrize("excess", [0.12, 0.20])
def test_false_within_noise_stays_at_or_below_five_percent(shape, excess):
    rates = {(k, r): _within_share(shape, k, r, excess, seed=1000 * k + r)
             for k in (1, 3, 10, 30, 50) for r in (2, 10, 100)}
    worst = max(rates, key=rates.get)
    assert rates[worst] <= 0.05, f"{worst}: within_noise in {rates[worst]:.1%} of folders; all: {rates}"


def test_the_prompt_count_alone_bounds_the_excess():
    """Ten prompts, one departing in every run both in the setting and in its floor: counted by prompt,
    nothing tighter than about 26 points is allowed; the verdict is undecided and says how many prompts
    would be needed. One prompt gives no prompt-level evidence, whatever its runs."""
    found, evidence, bound = guarantees.noise_class([10] + [0] * 9, [10] * 10, [10] + [0] * 9, [10] * 10)
    assert found == "undecided" and bound >= 1 - 0.05 ** (1 / 10), evidence
    assert "needs at least 35 prompts" in evidence
    assert guarantees.noise_class(150, 1000, 99, 990)[0] != "within_noise"
    assert guarantees.least_prompt_bound(1) > 0.9
    # enough prompts, none departing more in the setting than in the floor: within the margin
    many = guarantees.noise_class([1] * 10 + [0] * 40, [10] * 50, [1] * 10 + [0] * 40, [10] * 50)
    assert many[0] == "within_noise" and many[2] <= guarantees.NOISE_MARGIN
