"""One record per setting (all prompts of it together): the figures a verdict line and a gate rule
read, with the divergence rate bounded two ways, labelled:

    upper95_prompts  prompts as the independent unit (bounds.prompt_upper95): the default
    upper95_pooled   every run as an independent trial (Clopper-Pearson over all runs), which
                     runs of one prompt are not; kept because it is the figure papers quote

plus the survival median (harness.analysis.survival), the near-tie figures (harness.analysis.near_ties)
and the departures by flip class (harness.analysis.flips).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.analysis import flips as flips_module
from harness.analysis import near_ties as ties_module
from harness.analysis.bounds import prompt_upper95, upper95
from harness.results.columns import keys_of

COLUMNS = ["prompts", "compared", "diverged", "divergence_rate", "upper95_prompts", "upper95_pooled",
           "first_divergence_min", "median_tokens_to_divergence", "departed_by_median", "logprobs_compared",
           "logprobs_identical_runs"]
#: the same counts and bounds for runs compared with a reference run of their own engine load (same
#: boot) and of another load (cross boot: another boot, or another load of the run)
SCOPES = ("same_boot", "cross_boot")
BOOT_COLUMNS = [f"{scope}_{what}" for scope in SCOPES for what in ("compared", "diverged", "upper95_prompts")]


def _key(key: object) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def agreement(summary: pd.DataFrame, medians: pd.DataFrame | None = None,
              ties: pd.DataFrame | None = None, flip_counts: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per setting of the summary's compared records: COLUMNS, then the near-tie columns and the
    flip-class counts (flips.per_setting; 0 for a setting without departures) where given."""
    keys = [k for k in keys_of(summary) if k in summary]
    compared = summary[summary["compared"].fillna(0) > 0]
    records = []
    for key, part in compared.groupby(keys, dropna=False, sort=True):
        n, d = part["compared"].to_numpy(dtype=int), part["diverged"].fillna(0).to_numpy(dtype=int)
        lp_n = (part["logprobs_compared"].fillna(0).to_numpy(dtype=float) if "logprobs_compared" in part
                else np.zeros(len(part)))
        records.append(dict(zip(keys, _key(key))) | {
            "prompts": len(part), "compared": int(n.sum()), "diverged": int(d.sum()),
            "divergence_rate": d.sum() / n.sum(),
            "upper95_prompts": prompt_upper95(d, n), "upper95_pooled": upper95(int(d.sum()), int(n.sum())),
            "first_divergence_min": part["first_divergence_min"].min(),
            "median_tokens_to_divergence": np.nan,
            "departed_by_median": np.nan,
            "logprobs_compared": int(lp_n.sum()),
            "logprobs_identical_runs": int(round((part["logprobs_identical"].fillna(0) * lp_n).sum()))
            if lp_n.any() else 0,
        } | _scoped(part))
    out = pd.DataFrame(records, columns=keys + COLUMNS + BOOT_COLUMNS)
    out = _fill(out, keys, medians, ["median_tokens_to_divergence", "departed_by_median"])
    if ties is not None:
        out = _fill(out, keys, ties, [c for c in ties_module.SETTING_COLUMNS if c != "runs"])
    if flip_counts is not None:
        out = _fill(out, keys, flip_counts, flips_module.COUNT_COLUMNS)
        out[flips_module.COUNT_COLUMNS] = out[flips_module.COUNT_COLUMNS].fillna(0).astype("int64")
    return out


def _scoped(part: pd.DataFrame) -> dict[str, float]:
    """The same-boot and cross-boot counts and bounds of one setting's (cell, prompt) records."""
    out: dict[str, float] = {}
    for scope in SCOPES:
        if f"{scope}_compared" not in part:
            out |= {f"{scope}_compared": 0, f"{scope}_diverged": 0, f"{scope}_upper95_prompts": np.nan}
            continue
        n = part[f"{scope}_compared"].fillna(0).to_numpy(dtype=int)
        d = part[f"{scope}_diverged"].fillna(0).to_numpy(dtype=int)
        out |= {f"{scope}_compared": int(n.sum()), f"{scope}_diverged": int(d.sum()),
                f"{scope}_upper95_prompts": prompt_upper95(d, n) if n.sum() else np.nan}
    return out


def _fill(out: pd.DataFrame, keys: list[str], other: pd.DataFrame | None, columns: list[str]) -> pd.DataFrame:
    """`columns` of `other` put beside the records of the same setting (missing keys match missing)."""
    if other is None or other.empty:
        for column in columns:
            if column not in out:
                out[column] = np.nan
        return out
    lookup = {tuple(None if pd.isna(v) else v for v in _key(k)): rec
              for k, rec in zip(map(tuple, other[keys].itertuples(index=False)), other[columns].to_dict("records"))}
    found = [lookup.get(tuple(None if pd.isna(v) else v for v in row), {})
             for row in out[keys].itertuples(index=False)]
    for column in columns:
        out[column] = [rec.get(column, np.nan) for rec in found]
    return out
