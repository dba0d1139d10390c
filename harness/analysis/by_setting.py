"""One record per setting (all prompts of it together): the figures a verdict line and a gate rule
read, with the divergence rate bounded two ways, labelled:

    upper95_prompts  prompts as the independent unit (metrics.prompt_upper95): the default
    upper95_pooled   every run as an independent trial (Clopper-Pearson over all runs), which
                     runs of one prompt are not; kept because it is the figure papers quote

plus the survival median (harness.analysis.survival) and the near-tie figures (harness.analysis.near_ties).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.analysis import near_ties as ties_module
from harness.analysis.metrics import keys_of, prompt_upper95, upper95

COLUMNS = ["prompts", "compared", "diverged", "divergence_rate", "upper95_prompts", "upper95_pooled",
           "first_divergence_min", "median_tokens_to_divergence", "logprobs_compared", "logprobs_identical_runs"]


def _key(key: object) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def agreement(summary: pd.DataFrame, medians: pd.DataFrame | None = None,
              ties: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per setting of the summary's compared records: COLUMNS, then the near-tie columns where given."""
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
            "logprobs_compared": int(lp_n.sum()),
            "logprobs_identical_runs": int(round((part["logprobs_identical"].fillna(0) * lp_n).sum()))
            if lp_n.any() else 0,
        })
    out = pd.DataFrame(records, columns=keys + COLUMNS)
    out = _fill(out, keys, medians, ["median_tokens_to_divergence"])
    if ties is not None:
        out = _fill(out, keys, ties, [c for c in ties_module.SETTING_COLUMNS if c != "runs"])
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
