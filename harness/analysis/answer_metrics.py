"""Answer-level statistics: does non-determinism change the *answer*, and does a score move?

Per setting (the cells' axes), over the prompts that carry a parse rule:
    tar_r         share of prompts whose runs all gave the same raw output (TARr@N), over the prompts
                  with at least two ok runs (one run agrees with itself: `single_run_prompts` counts
                  those left out)
    tar_a         share of prompts whose runs all gave the same parsed answer (TARa@N), likewise
    accuracy      mean over prompts of the share of runs that are right (prompts with an answer)
    best, worst   share of prompts right in any run / in every run; spread = best - worst
    answer_agreement  share of runs whose answer equals the reference run's answer
    prompts_changed   share of prompts with a run whose answer differs from the reference's
    accuracy_diff     accuracy minus the reference setting's, over the prompts both have
Bootstrap 95 % intervals resample prompts (seeded: the same seed gives the same interval); with
fewer than two prompts there is no interval (NaN), never a point posing as one.
The reference is the one token statistics use: the same settings except the --reference axes, and
of that setting's runs the one --reference-run chooses (metrics.reference_repeats), so an answer
verdict and a token verdict of a prompt are judged against the same run.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd

from harness.analysis.divergence import reference_repeats
from harness.analysis.frames import in_run_order, select_setting
from harness.results.columns import KEY_COLUMNS, keys_of

ANSWER_ROW_COLUMNS = list(KEY_COLUMNS) + [
    "cell_id", "prompt_id", "repeat", "status", "output_hash", "n_tokens", "answer_parsed", "answer_expected",
    "answer_correct",
]
BOOTSTRAP = 2000


def answer_rows(rows: pd.DataFrame, prompts: Iterable[str]) -> pd.DataFrame:
    """The runs of prompts with a parse rule, with the columns `answer_summary` reads, in run order
    (every figure relates runs of one prompt: a campaign's parts give these rows, the parent the table)."""
    mine = rows[rows["prompt_id"].isin(set(prompts)).to_numpy()]
    return in_run_order(mine, keys_of(rows) + ANSWER_ROW_COLUMNS)


def answered(rows: pd.DataFrame, prompts: Iterable[str]) -> pd.DataFrame:
    """The ok rows of prompts with a parse rule, with `answer_key` ('no answer found' is an answer too)."""
    ok = rows[(rows["status"] == "ok") & rows["prompt_id"].isin(set(prompts))]
    return ok.assign(answer_key=ok["answer_parsed"].fillna("\0none"))


def per_prompt(ok: pd.DataFrame, reference_run: str = "first") -> pd.DataFrame:
    """One record per setting and prompt, from `answered` rows; `first_answer` and `first_repeat`
    are those of the run `reference_run` chooses."""
    keys = keys_of(ok)
    ok = ok.copy()
    ok["right"] = ok["answer_correct"].astype("boolean").astype("Float64")
    chosen = ok.merge(reference_repeats(ok, reference_run)[["cell_id", "prompt_id", "reference_repeat"]],
                      on=["cell_id", "prompt_id"])
    first = chosen[chosen["repeat"] == chosen["reference_repeat"]][keys + ["prompt_id", "answer_key", "repeat"]]
    g = ok.groupby(keys + ["prompt_id"], dropna=False)
    out = pd.DataFrame({
        "runs": g.size(),
        "raw_identical": g["output_hash"].nunique() == 1,
        "answers_identical": g["answer_key"].nunique() == 1,
        "accuracy": g["right"].mean(),
        "any_right": g["right"].max() == 1,
        "all_right": g["right"].min() == 1,
        "has_answer": g["answer_expected"].count() > 0,
        "length_spread": g["n_tokens"].max() - g["n_tokens"].min(),
    }).reset_index()
    return out.merge(first.rename(columns={"answer_key": "first_answer", "repeat": "first_repeat"}),
                     on=keys + ["prompt_id"], how="left")


def bootstrap(values: np.ndarray, seed: int, draws: int = BOOTSTRAP) -> tuple[float, float]:
    """95 % percentile interval of the mean of `values`, resampled with a seeded generator; NaN for
    fewer than two values (resampling one value gives that value back, not an interval)."""
    if len(values) < 2:
        return (np.nan, np.nan)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(draws, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def answer_summary(
    rows: pd.DataFrame, prompts: Iterable[str], reference: dict[str, Any], seed: int = 0, reference_run: str = "first"
) -> pd.DataFrame:
    """One record per setting: answer agreement, accuracy with intervals, and the change against the reference."""
    keys = keys_of(rows)
    ok = answered(rows, prompts)
    columns = keys + ["prompts", "runs", "single_run_prompts", "tar_r", "tar_a", "accuracy", "accuracy_low", "accuracy_high",
                      "best", "worst", "spread", "answer_agreement", "prompts_changed", "accuracy_diff", "diff_low",
                      "diff_high", "length_spread_median", "length_spread_max", "reference"]
    if ok.empty:  # no prompt with a parse rule (most experiments): none of the pairing below is needed
        return pd.DataFrame(columns=columns)
    table = per_prompt(ok, reference_run)
    if table.empty:
        return pd.DataFrame(columns=columns)
    records = []
    by_setting = {k: part for k, part in table.groupby(keys, dropna=False, sort=True)}
    label = ",".join(f"{k}={v}" for k, v in reference.items())
    for key, part in by_setting.items():
        setting = dict(zip(keys, key))
        ref_key = tuple((setting | reference)[k] for k in keys)
        ref = by_setting.get(ref_key)
        scored = part[part["has_answer"]]
        acc = scored["accuracy"].to_numpy(dtype=float)
        repeated = part[part["runs"] >= 2]  # a prompt with one ok run agrees with itself: not counted
        rec: dict[str, Any] = setting | {
            "prompts": len(part), "runs": int(part["runs"].sum()), "single_run_prompts": len(part) - len(repeated),
            "tar_r": float(repeated["raw_identical"].mean()) if len(repeated) else np.nan,
            "tar_a": float(repeated["answers_identical"].mean()) if len(repeated) else np.nan,
            "accuracy": float(acc.mean()) if len(acc) else np.nan,
            "best": float(scored["any_right"].mean()) if len(scored) else np.nan,
            "worst": float(scored["all_right"].mean()) if len(scored) else np.nan,
            "length_spread_median": float(part["length_spread"].median()),
            "length_spread_max": int(part["length_spread"].max()), "reference": label,
        }
        rec["spread"] = rec["best"] - rec["worst"]
        rec["accuracy_low"], rec["accuracy_high"] = bootstrap(acc, seed)
        rec.update(answer_agreement=np.nan, prompts_changed=np.nan, accuracy_diff=np.nan, diff_low=np.nan,
                   diff_high=np.nan)
        if ref is not None:
            answers = select_setting(ok, setting).merge(ref[["prompt_id", "first_answer", "first_repeat"]], on="prompt_id")
            # not the reference run itself
            judged = answers[answers["repeat"] != answers["first_repeat"]] if ref_key == key else answers
            if len(judged):
                same = judged["answer_key"] == judged["first_answer"]
                rec["answer_agreement"] = float(same.mean())
                rec["prompts_changed"] = float((~same).groupby(judged["prompt_id"]).any().mean())
            paired = scored.merge(ref[ref["has_answer"]][["prompt_id", "accuracy"]], on="prompt_id", suffixes=("", "_ref"))
            if len(paired) and ref_key != key:
                diff = (paired["accuracy"] - paired["accuracy_ref"]).to_numpy(dtype=float)
                rec["accuracy_diff"] = float(diff.mean())
                rec["diff_low"], rec["diff_high"] = bootstrap(diff, seed)
        records.append(rec)
    return pd.DataFrame(records)[columns]
