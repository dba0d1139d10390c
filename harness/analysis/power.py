"""How many runs and prompts an experiment needs to bound a divergence rate (`harness plan`).

With no divergence seen in n independent trials, the exact one-sided 95 % upper bound on the rate
is 1 - 0.05 ** (1 / n) (bounds.upper95), so bounding the rate below a target p takes
n = ceil(ln 0.05 / ln(1 - p)) trials: 299 for 1 %, about 3 / p for small p. Runs count as trials
in the pooled bound; prompts count as trials in the bound with prompts as the unit
(bounds.prompt_upper95), the honest one when runs of a prompt move together. A plan also says
how likely it is to see at least one divergence if the true per-run rate is p: 1 - (1 - p) ** runs.
"""

from __future__ import annotations

import math

import pandas as pd

#: the divergence rates the table is drawn for
TARGETS = (0.10, 0.05, 0.01, 0.005, 0.001)


def trials_for(target: float) -> int:
    """Trials with no divergence that bound the rate below `target` (95 %, one-sided)."""
    return math.ceil(math.log(0.05) / math.log1p(-target))


def table(prompts: int, repeats: int, targets: tuple[float, ...] = TARGETS) -> pd.DataFrame:
    """Per target rate: the runs and prompts needed, what this plan has, and its chance to see a
    divergence at that rate. A compared setting has prompts x repeats runs (the reference setting
    one repeat fewer: its first run is the reference)."""
    runs = prompts * repeats
    return pd.DataFrame([{
        "rate": p,
        "runs_needed": trials_for(p),
        "repeats_needed": math.ceil(trials_for(p) / prompts),
        "prompts_needed": trials_for(p),
        "bounded_pooled": runs >= trials_for(p),
        "bounded_prompts": prompts >= trials_for(p),
        "chance_to_see_one": 1.0 - (1.0 - p) ** runs,
    } for p in targets])


def reachable(prompts: int, repeats: int) -> tuple[float, float]:
    """(pooled, prompts as the unit): the bounds this plan reaches per compared setting when no run departs."""
    return 1.0 - 0.05 ** (1.0 / (prompts * repeats)), 1.0 - 0.05 ** (1.0 / prompts)
