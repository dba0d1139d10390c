"""Guarantee classes: one word per setting for what its runs showed, with the evidence and its bound.

The classes, strongest first; a setting gets the strongest that holds over all its compared runs:

    bitwise       tokens and every step's log-probability bitwise equal to the reference run's
                  (needs an engine that returns log-probabilities)
    same_tokens   every run's tokens equal the reference run's
    same_answers  some tokens differ, but every run of every prompt gives the reference run's parsed
                  answer (needs a parse rule on every prompt of the setting)
    within_noise  runs depart from the reference, but no more often than the reference setting's own
                  repeats depart from its reference run: a one-sided Fisher exact test of the two
                  rates gives p >= ALPHA (the reference setting is the floor, so it never gets this class)
    diverges      none of the above

A class is what was seen, not a proof: `bound` is the 95% upper bound on the share of runs that
would break it (prompts as the unit, as in the settings table) where the class claims agreement,
and the one-sided p-value for within_noise. A setting with no compared runs has no class.
"""

from __future__ import annotations

from math import comb

import numpy as np
import pandas as pd

from harness.analysis.metrics import select_setting
from harness.experiment.config import GUARANTEES as CLASSES

#: how strong each class is: a rule `guarantee: X` passes for a setting whose class is at least X
STRENGTH = {name: len(CLASSES) - i for i, name in enumerate(CLASSES)}
ALPHA = 0.05
COLUMNS = ["guarantee", "guarantee_evidence", "guarantee_bound"]


def fisher_greater(d1: int, n1: int, d0: int, n0: int) -> float:
    """One-sided Fisher exact p: the chance, with the margins fixed, that the first group has d1 or
    more of the d1 + d0 departures when both groups depart at one rate."""
    total, departed = n1 + n0, d1 + d0
    if n1 == 0 or departed == 0:
        return 1.0
    denominator = comb(total, departed)
    top = min(departed, n1)
    return float(sum(comb(n1, k) * comb(n0, departed - k) for k in range(d1, top + 1)) / denominator)


def floors(compared: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per setting: the reference setting's own repeats against its reference runs (`floor_compared`,
    `floor_diverged`) and whether the setting is itself a reference (`is_floor`)."""
    columns = list(dict.fromkeys(keys + ["cell_id", "reference_cell", "matched", "first_divergence"]))
    judged = compared.loc[compared["matched"].notna().to_numpy(), columns]  # a million rows: only these columns
    own = judged[(judged["cell_id"] == judged["reference_cell"]).to_numpy()]
    per_ref = own.groupby("reference_cell").agg(n=("matched", "size"), d=("first_divergence", "count"))
    pairs = judged[list(dict.fromkeys(keys + ["cell_id", "reference_cell"]))].drop_duplicates(["cell_id", "reference_cell"])
    pairs = pairs.join(per_ref, on="reference_cell").fillna({"n": 0, "d": 0})
    pairs["self"] = pairs["cell_id"] == pairs["reference_cell"]
    again = pairs.duplicated(keys + ["reference_cell"])  # a reference cell's repeats count once per setting
    pairs["n"], pairs["d"] = pairs["n"].where(~again, 0), pairs["d"].where(~again, 0)
    out = pairs.groupby(keys, dropna=False, sort=False).agg(floor_compared=("n", "sum"), floor_diverged=("d", "sum"),
                                                            is_floor=("self", "all"))
    return out.reset_index()


def _answers_of(answers: pd.DataFrame | None, setting: dict, keys: list[str]) -> dict | None:
    if answers is None or answers.empty:
        return None
    found = select_setting(answers, {k: setting.get(k) for k in keys if k in answers})
    return None if found.empty else found.iloc[0].to_dict()


def classify(settings: pd.DataFrame, floor: pd.DataFrame, answers: pd.DataFrame | None = None) -> pd.DataFrame:
    """`settings` (harness.analysis.by_setting.agreement) with COLUMNS added; `floor`: floors()."""
    keys = [k for k in settings.columns if k in floor.columns and k not in ("floor_compared", "floor_diverged", "is_floor")]
    out = settings.copy()
    lookup = {tuple(None if pd.isna(v) else v for v in rec[:len(keys)]): rec[len(keys):]
              for rec in floor[keys + ["floor_compared", "floor_diverged", "is_floor"]].itertuples(index=False)}
    classes, evidence, bounds = [], [], []
    for rec in out.to_dict("records"):
        n, d = int(rec["compared"]), int(rec["diverged"])
        prompts, bound = int(rec["prompts"]), rec["upper95_prompts"]
        bound = rec["upper95_pooled"] if pd.isna(bound) else bound  # one prompt: the pooled bound, labelled
        unit = "prompts as the unit" if not pd.isna(rec["upper95_prompts"]) else "pooled over runs"
        lp_n, lp_same = int(rec.get("logprobs_compared") or 0), int(rec.get("logprobs_identical_runs") or 0)
        fc, fd, is_floor = lookup.get(tuple(None if pd.isna(rec[k]) else rec[k] for k in keys), (0, 0, False))
        answer = _answers_of(answers, rec, keys)
        if n == 0:
            classes.append(None), evidence.append("no compared runs"), bounds.append(np.nan)
        elif d == 0 and lp_n == n and lp_same == n:
            classes.append("bitwise")
            evidence.append(f"{n}/{n} runs over {prompts} prompt(s) with tokens and log-probabilities bitwise equal "
                            f"to the reference's; share that would differ < {100 * bound:.1f}% ({unit})")
            bounds.append(bound)
        elif d == 0:
            why = ("the engine recorded no log-probabilities" if lp_n < n
                   else f"{lp_n - lp_same} with other log-probabilities")
            classes.append("same_tokens")
            evidence.append(f"{n}/{n} runs over {prompts} prompt(s) with the reference's tokens ({why}); "
                            f"divergence rate < {100 * bound:.1f}% ({unit})")
            bounds.append(bound)
        elif answer is not None and answer.get("answer_agreement") == 1.0 and int(answer["prompts"]) == prompts:
            classes.append("same_answers")
            evidence.append(f"{d}/{n} runs depart in tokens, every answer over {prompts} prompt(s) equals the "
                            "reference run's")
            bounds.append(np.nan)
        elif not is_floor and fd > 0 and (p := fisher_greater(d, n, int(fd), int(fc))) >= ALPHA:
            classes.append("within_noise")
            evidence.append(f"{d}/{n} runs depart; the reference setting's own repeats depart {int(fd)}/{int(fc)}; "
                            f"one-sided Fisher p = {p:.2f} (>= {ALPHA:g})")
            bounds.append(p)
        else:
            floor_note = (f"the reference setting's own repeats depart {int(fd)}/{int(fc)}" if fc and not is_floor
                          else "this is a reference setting: its repeats against its first run" if is_floor
                          else "the reference has no repeats to compare")
            classes.append("diverges")
            evidence.append(f"{d}/{n} runs depart over {prompts} prompt(s) ({floor_note})")
            bounds.append(np.nan)
    out["guarantee"], out["guarantee_evidence"], out["guarantee_bound"] = classes, evidence, bounds
    return out


def holds(found: str | None, wanted: str) -> bool:
    """Whether a setting of class `found` keeps the guarantee `wanted` (a stronger class keeps a weaker one)."""
    return found is not None and STRENGTH[found] >= STRENGTH[wanted]
