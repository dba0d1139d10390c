"""Is B within A's own noise? (`harness compare A B --score`)

An engine upgrade, a provider or a quantised copy (B) is judged against a trusted setting (A) by
how far B's runs are from A's own re-scoring, measured against how far A's own runs are from it:

- A's scorer is A's setting, loaded alone with no cache (harness.analysis.rescore.Scorer).
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

from typing import Any, Callable

import numpy as np
import pandas as pd

from harness.experiment.matrix import expand
from harness.analysis.metrics import KEY_COLUMNS, keys_of
from harness.analysis.rescore import Scorer, deltas, not_here, scorable, scorer_spec, scoring_machine
from harness.results.folder import Results

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


def _values(results: Results, runs: pd.DataFrame, scorer: Scorer, texts: dict[str, str]) -> pd.DataFrame:
    """Each run's mean |decode - score| under `scorer`."""
    tokens = results.tokens_for(set(runs["output_hash"]))
    decode = results.folder.store.values_at("logprobs", runs)
    values = []
    for r, lp in zip(runs.itertuples(index=False), decode):
        d = deltas(lp, scorer(texts[r.prompt_id], r.output_hash, tokens[r.output_hash]))
        values.append(float(np.abs(d).mean()) if len(d) else np.nan)
    return runs.assign(value=values)


def within_noise(a: Results, b: Results, ignore: tuple[str, ...] = ("gpu",),
                 log: Callable[[str], None] = print, any_device: bool = False) -> pd.DataFrame:
    """One record per A setting (its keys but batch size and the ignored axes) that B has: COLUMNS.
    A's scorer computes here: a setting whose A runs ran on a GPU this machine lacks is not scored
    unless `any_device` (harness.analysis.rescore.misplaced)."""
    runs_a, runs_b = scorable(a, log), scorable(b, log)
    here = scoring_machine()
    setting_a = a.read_rows(columns=["cell_id", *KEY_COLUMNS]).drop_duplicates("cell_id")
    setting_b = b.read_rows(columns=["cell_id", *KEY_COLUMNS]).drop_duplicates("cell_id")
    keys = [k for k in keys_of(setting_a, drop=set(ignore) | {"batch_size"}) if k in setting_a and k in setting_b]
    runs_a = runs_a.drop(columns="context_tokens").merge(setting_a, on="cell_id")
    runs_b = runs_b.drop(columns="context_tokens").merge(setting_b, on="cell_id")
    cells = {c.id: (c, loaded) for loaded in a.experiments for c in expand(loaded)}
    texts_b = {p.id: p.text for loaded in b.experiments for p in loaded.prompt_set.prompts}
    records = []
    for key, part_a in runs_a.groupby(keys, dropna=False, sort=True):
        setting = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        mask = np.ones(len(runs_b), dtype=bool)
        for k, v in setting.items():
            mask &= (runs_b[k].isna() if pd.isna(v) else runs_b[k] == v).to_numpy()
        part_b = runs_b[mask]
        if part_b.empty:
            continue
        cell, loaded = cells[part_a["cell_id"].iloc[0]]
        texts = {p.id: p.text for p in loaded.prompt_set.prompts}
        same_text = part_b["prompt_id"].map(lambda p: p in texts and texts_b.get(p) == texts[p]).astype(bool)
        left_out = int((~same_text).sum())
        part_b = part_b[same_text]
        scorer = Scorer(scorer_spec(cell.load_spec()), loaded.base, log, here)
        why = scorer.refusal or not_here(part_a, here, any_device)
        if why:
            records.append(setting | {"verdict": f"not scored: {why}", "left_out": left_out})
            continue
        log(f"scoring {len(part_a)} run(s) of A and {len(part_b)} of B with {scorer.label}")
        with scorer:
            va = _values(a, part_a, scorer, texts)
            vb = _values(b, part_b, scorer, texts)
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
