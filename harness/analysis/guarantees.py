"""Guarantee classes: one word per setting for what its runs showed, with the evidence and its bound.

The classes, strongest first; a setting gets the strongest that holds over all its compared runs:

    bitwise       tokens and every step's log-probability bitwise equal to the reference run's
                  (needs an engine that returns log-probabilities)
    same_tokens   every run's tokens equal the reference run's
    same_answers  some tokens differ, but every run of every prompt gives the reference run's parsed
                  answer (needs a parse rule on every prompt of the setting)
    within_noise  runs depart from the reference, and are shown to depart at most NOISE_MARGIN more often
                  than the reference setting's own repeats depart from its reference run (the floor): the
                  one-sided 95% upper bound on the difference of the two rates (Newcombe's score method)
                  is at most the margin, a non-inferiority test at ALPHA. The reference setting is the
                  floor, so it never gets this class; a floor with no repeats, or whose repeats never
                  depart (no noise to be within), gives none
    undecided     runs depart, and the data can tell neither: not shown within the margin, nor shown to
                  depart more often than the floor (one-sided Fisher exact test, p >= ALPHA)
    diverges      none of the above: no floor to compare with, or shown to depart more often than it

A class is what was seen, not a proof: `bound` is the 95% upper bound on the share of runs that
would break it (prompts as the unit, as in the settings table) where the class claims agreement,
the upper bound on the rate's excess over the floor for within_noise and undecided, and the Fisher
p-value for a setting shown to diverge beyond its floor. A setting with no compared runs has no class.
The within_noise evidence also says the test's power: the chance that it would have shown
equivalence had both rates truly been the floor's (normal approximation).
"""

from __future__ import annotations

from math import comb, erf, sqrt

import numpy as np
import pandas as pd

from harness.analysis.frames import select_setting
from harness.experiment.schema import GUARANTEES as CLASSES

#: how strong each class is: a rule `guarantee: X` passes for a setting whose class is at least X
STRENGTH = {name: len(CLASSES) - i for i, name in enumerate(CLASSES)}
ALPHA = 0.05
#: how much more often than the floor a setting may depart and still be within its noise (a share of runs)
NOISE_MARGIN = 0.10
#: the one-sided 95% normal quantile
Z = 1.6448536269514722
COLUMNS = ["guarantee", "guarantee_evidence", "guarantee_bound", "floor_compared", "floor_diverged"]


def _wilson(d: int, n: int) -> tuple[float, float]:
    """The Wilson score interval of d / n at one-sided 95% each side."""
    p, z2 = d / n, Z * Z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z * sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def excess_bound(d1: int, n1: int, d0: int, n0: int) -> float:
    """One-sided 95% upper bound on rate1 - rate0 (Newcombe's hybrid score method, his method 10):
    sound with small counts and with rates of 0 or 1, where a Wald bound is not."""
    p1, p0 = d1 / n1, d0 / n0
    low0, high0 = _wilson(d0, n0)
    low1, high1 = _wilson(d1, n1)
    return p1 - p0 + sqrt((high1 - p1) ** 2 + (p0 - low0) ** 2)


def equivalence_power(n1: int, d0: int, n0: int, margin: float) -> float:
    """The chance that the bound falls within `margin` when both rates are truly the floor's (normal
    approximation with the floor's rate, kept off 0 by half a run)."""
    p = min(max(d0, 0.5) / n0, 1 - 0.5 / n0)
    se = sqrt(p * (1 - p) * (1 / n1 + 1 / n0))
    return float(0.5 * (1 + erf((margin / se - Z) / sqrt(2))))


def noise_class(d: int, n: int, fd: int, fc: int, margin: float = NOISE_MARGIN) -> tuple[str, str, float]:
    """(class, evidence, bound) of a setting whose runs depart d of n, against a floor of fd of fc:
    within_noise, undecided or diverges (see the module's doc)."""
    if fc == 0:
        return "diverges", f"{d}/{n} runs depart (the reference has no repeats to compare)", float("nan")
    floor = f"the reference setting's own repeats depart {fd}/{fc}"
    if fd == 0:
        return "diverges", f"{d}/{n} runs depart; {floor}: no noise to be within", float("nan")
    bound = excess_bound(d, n, fd, fc)
    if bound <= margin:
        power = equivalence_power(n, fd, fc, margin)
        return "within_noise", (f"{d}/{n} runs depart; {floor}; its rate exceeds theirs by at most "
                                f"{100 * bound:.1f} points (95%, Newcombe), within the margin of {100 * margin:g}; "
                                f"power at equal rates {100 * power:.0f}%"), bound
    p = fisher_greater(d, n, fd, fc)
    if p >= ALPHA:
        return "undecided", (f"{d}/{n} runs depart; {floor}; the data cannot decide: the excess may be up to "
                             f"{100 * bound:.1f} points (over the margin of {100 * margin:g}), yet is not shown "
                             f"(one-sided Fisher p = {p:.2f}); more runs would tell"), bound
    return "diverges", f"{d}/{n} runs depart; {floor}; more often than the floor (one-sided Fisher p = {p:.3g})", p


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


def classify(settings: pd.DataFrame, floor: pd.DataFrame, answers: pd.DataFrame | None = None,
             margin: float = NOISE_MARGIN) -> pd.DataFrame:
    """`settings` (harness.analysis.by_setting.agreement) with COLUMNS added; `floor`: floors()."""
    keys = [k for k in settings.columns if k in floor.columns and k not in ("floor_compared", "floor_diverged", "is_floor")]
    out = settings.copy()
    lookup = {tuple(None if pd.isna(v) else v for v in rec[:len(keys)]): rec[len(keys):]
              for rec in floor[keys + ["floor_compared", "floor_diverged", "is_floor"]].itertuples(index=False)}
    classes, evidence, bounds, floor_n, floor_d = [], [], [], [], []
    for rec in out.to_dict("records"):
        n, d = int(rec["compared"]), int(rec["diverged"])
        prompts, bound = int(rec["prompts"]), rec["upper95_prompts"]
        bound = rec["upper95_pooled"] if pd.isna(bound) else bound  # one prompt: the pooled bound, labelled
        unit = "prompts as the unit" if not pd.isna(rec["upper95_prompts"]) else "pooled over runs"
        lp_n, lp_same = int(rec.get("logprobs_compared") or 0), int(rec.get("logprobs_identical_runs") or 0)
        fc, fd, is_floor = lookup.get(tuple(None if pd.isna(rec[k]) else rec[k] for k in keys), (0, 0, False))
        fc, fd = (0, 0) if is_floor else (int(fc), int(fd))
        floor_n.append(fc), floor_d.append(fd)
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
        elif is_floor:
            classes.append("diverges")
            evidence.append(f"{d}/{n} runs depart over {prompts} prompt(s) (this is a reference setting: its "
                            "repeats against its first run)")
            bounds.append(np.nan)
        else:
            found, said, bound = noise_class(d, n, fd, fc, margin)
            classes.append(found), evidence.append(said), bounds.append(bound)
    out["guarantee"], out["guarantee_evidence"], out["guarantee_bound"] = classes, evidence, bounds
    out["floor_compared"], out["floor_diverged"] = floor_n, floor_d
    return out


def holds(found: str | None, wanted: str) -> bool:
    """Whether a setting of class `found` keeps the guarantee `wanted` (a stronger class keeps a weaker one)."""
    return found is not None and STRENGTH[found] >= STRENGTH[wanted]


def holds_with_margin(record: dict, wanted: str, margin: float) -> tuple[bool, str]:
    """`holds` for a settings record, with within_noise judged again at `margin` (a rule's own) from the
    record's counts: whether it holds, and the class and evidence found."""
    found, evidence = record["guarantee"], record["guarantee_evidence"]
    if found in ("within_noise", "undecided", "diverges") and int(record.get("floor_compared") or 0) > 0:
        found, evidence, _ = noise_class(int(record["diverged"]), int(record["compared"]),
                                         int(record["floor_diverged"]), int(record["floor_compared"]), margin)
    return holds(found, wanted), f"{found}: {evidence}"
