"""Is B within A's own noise? (`harness compare A B --score`)

An engine upgrade, a provider or a quantised copy (B) is judged against a trusted setting (A) by
how far B's runs are from A's own re-scoring, measured against how far A's own runs are from it:

- A's scorer is A's setting, loaded alone with no cache (harness.run.rescore.Scorer).
- Every run, of A and of B, gets one value: the mean over its tokens of
  |decode-time log-probability - A's scoring log-probability|. A run whose tokens A would not
  have chosen, or whose probabilities A would not have given, scores high.
- A's runs (all its repeats and batch sizes of the setting) are the noise floor; B's runs of the
  same setting (but the ignored axes and batch size) and the same prompts are the sample.
- The statistic is B's mean value minus A's, each prompt weighing by B's runs on it; its p-value
  comes from a permutation test that shuffles the A/B labels within each prompt (seeded,
  PERMUTATIONS draws): the chance that A's noise alone gives a difference this large.
- Verdict: 'beyond A's noise' when p < ALPHA and the difference is positive; otherwise 'within'.

Runs of prompts that A does not have, or has with another text, are left out and counted.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd

PERMUTATIONS = 4000
ALPHA = 0.05
WITHIN, BEYOND = "within A's noise", "beyond A's noise"
COLUMNS = ["a_runs", "b_runs", "prompts", "a_floor", "b_value", "difference", "p_value", "b_identical",
           "verdict", "left_out"]


def permutation_p(a: pd.DataFrame, b: pd.DataFrame, seed: int = 0, draws: int = PERMUTATIONS) -> tuple[float, float]:
    """(difference, one-sided p) for frames with `prompt_id` and `value`; labels shuffled within prompts."""
    strata = []
    for prompt, part_b in b.groupby("prompt_id"):
        part_a = a[a["prompt_id"] == prompt]
        if len(part_a):
            strata.append((part_a["value"].to_numpy(), part_b["value"].to_numpy()))
    if not strata:
        return float("nan"), float("nan")
    weight = sum(len(vb) for _, vb in strata)

    def statistic(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
        return sum(len(vb) * (vb.mean() - va.mean()) for va, vb in pairs) / weight

    observed = statistic(strata)
    rng = np.random.default_rng(seed)
    pooled = [(np.concatenate([va, vb]), len(va)) for va, vb in strata]
    hits = 0
    for _ in range(draws):
        shuffled = []
        for values, n_a in pooled:
            order = rng.permutation(len(values))
            shuffled.append((values[order[:n_a]], values[order[n_a:]]))
        hits += statistic(shuffled) >= observed - 1e-15
    return observed, (1 + hits) / (1 + draws)


def judge(scored: Iterable[dict[str, Any]], keys: list[str]) -> pd.DataFrame:
    """One record per setting (`keys` + COLUMNS) from what scoring gave each (harness.run.noise_scoring):
    the setting, `left_out`, and either `why` it was not scored or the frames `a` and `b` of each run's
    `value`, `prompt_id` and `output_hash`."""
    records = []
    for item in scored:
        setting, left_out = item["setting"], item["left_out"]
        if item.get("why"):
            records.append(setting | {"verdict": f"not scored: {item['why']}", "left_out": left_out})
            continue
        va, vb = item["a"], item["b"]
        difference, p = permutation_p(va, vb)
        modal = va.groupby("prompt_id")["output_hash"].agg(lambda s: s.value_counts().index[0])
        beyond = p == p and p < ALPHA and difference > 0
        records.append(setting | {
            "a_runs": len(va), "b_runs": len(vb), "prompts": int(vb["prompt_id"].nunique()),
            "a_floor": float(va["value"].mean()), "b_value": float(vb["value"].mean()), "difference": difference,
            "p_value": p, "b_identical": float((vb["output_hash"] == vb["prompt_id"].map(modal)).mean()),
            "verdict": BEYOND if beyond else WITHIN, "left_out": left_out,
        })
    return pd.DataFrame(records, columns=keys + COLUMNS)


def describe(record: dict[str, Any]) -> str:
    """One verdict line: 'B is beyond A's noise: ... (p = ...)'."""
    if "not scored" in str(record["verdict"]):
        return str(record["verdict"])
    return (f"B is {record['verdict']}: mean |delta logprob| under A's scorer {record['b_value']:.3g} over "
            f"{record['b_runs']} run(s) of B vs A's own {record['a_floor']:.3g} over {record['a_runs']} "
            f"(p = {record['p_value']:.2g}, permutation within {record['prompts']} prompt(s)); "
            f"{100 * record['b_identical']:.0f}% of B's outputs equal A's most frequent")


def all_within(frame: pd.DataFrame) -> bool:
    """Every setting of B within A's noise (what `compare --score --gate` requires)."""
    return bool((frame["verdict"] == WITHIN).all())
