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
    mode_ineffective  batch-invariant mode on (by flag), and a run inside a batch is not bitwise the same
                  prompt's reference run of the same mode (tokens, or log-probabilities where recorded):
                  the mode did not take effect, whatever the rates. Judged only where the setting differs
                  from its reference in the batch's composition alone (axes.COMPOSITION_AXES: batch size,
                  batch-mates' length): the mode promises batch invariance, not equality across GPUs,
                  seeds, dtypes, models or environments, so a reference across those gives the setting
                  its ordinary class, and the evidence says the mode was not judged

A class is what was seen, not a proof: `bound` is the 95% upper bound on the share of runs that
would break it (prompts as the unit, as in the settings table) where the class claims agreement,
the upper bound on the rate's excess over the floor for within_noise and undecided, and the Fisher
p-value for a setting shown to diverge beyond its floor. A setting with no compared runs has no class.
Where the prompts at hand are too few to show the margin at all, the evidence says so and how many
would be needed.
"""

from __future__ import annotations

from functools import lru_cache
from math import comb, sqrt

import numpy as np
import pandas as pd

from harness.analysis.bounds import bounded_mean_upper
from harness.analysis.frames import select_setting
from harness.experiment.axes import COMPOSITION_AXES
from harness.experiment.schema import GUARANTEES as CLASSES

#: how strong each class is: a rule `guarantee: X` passes for a setting whose class is at least X
STRENGTH = {name: len(CLASSES) - i for i, name in enumerate(CLASSES)}
ALPHA = 0.05
#: how much more often than the floor a setting may depart and still be within its noise (a share of runs)
NOISE_MARGIN = 0.10
#: the one-sided 95% normal quantile
Z = 1.6448536269514722
#: the noise test's figures, kept so that a gate rule's own margin judges again without the rows:
#: the upper bound on the excess over the floor, the one-sided p that it is above 0, and the excess's
#: standard error (for the power)
NOISE_COLUMNS = ["noise_excess_upper95", "noise_excess_p", "noise_excess_se"]
COLUMNS = ["guarantee", "guarantee_evidence", "guarantee_bound", "floor_compared", "floor_diverged", *NOISE_COLUMNS]


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


@lru_cache(maxsize=1024)
def least_prompt_bound(prompts: int) -> float:
    """The smallest upper bound on the excess that `prompts` prompts can give, reached when no prompt
    departs more in the setting than in the floor: what the prompt count alone allows."""
    return bounded_mean_upper([0.0] * prompts, -1.0, 1.0, ALPHA) if prompts else float("inf")


def prompt_excess_upper(d1, n1, d0, n0) -> float:
    """A one-sided 95% upper bound on the mean over prompts of the excess (the setting's departure rate
    minus the floor's, per prompt), valid at every prompt count: each prompt's excess is a draw in
    [-1, 1] (prompts the unit, its runs' noise inside the draw) and the bound is a test by betting
    (bounds.bounded_mean_upper), which assumes no shape and never undercuts what the prompt count
    allows. Prompts with no runs on either side are left out; none left: infinity."""
    d1, n1, d0, n0 = (np.asarray(a, dtype=float) for a in (d1, n1, d0, n0))
    keep = (n1 > 0) & (n0 > 0)
    if not keep.any():
        return float("inf")
    return bounded_mean_upper(d1[keep] / n1[keep] - d0[keep] / n0[keep], -1.0, 1.0, ALPHA)


def excess_upper(d1, n1, d0, n0) -> float:
    """The noise test's upper bound on the excess (arrays per prompt, the setting's runs with n1 > 0):
    the larger of the prompt-level bound and Newcombe's with runs as the unit."""
    totals = int(np.sum(d1)), int(np.sum(n1)), int(np.sum(d0)), int(np.sum(n0))
    return max(excess_bound(*totals), prompt_excess_upper(d1, n1, d0, n0))


def _pooled_se(n1: int, d0: int, n0: int) -> float:
    """The standard error of the excess at equal rates, runs as the unit (the floor's rate kept off 0 by half a run)."""
    p = min(max(d0, 0.5) / n0, 1 - 0.5 / n0)
    return sqrt(p * (1 - p) * (1 / n1 + 1 / n0))


def excess_by_prompt(d1, n1, d0, n0, seed: int = 0) -> tuple[float, float]:
    """A paired cluster bootstrap of rate1 - rate0 over prompts (arrays hold one entry per prompt, the
    setting's runs and the floor's of the same prompt): the share of draws at or below 0 (a one-sided p
    that the excess is above 0) and its standard deviation. Used for the p of a divergence only: a
    percentile bootstrap over few prompts is too narrow to bound an excess (it has no spread when the
    departing prompts coincide), so the bound is prompt_excess_upper."""
    from harness.analysis.bounds import CLUSTER_DRAWS

    d1, n1, d0, n0 = (np.asarray(a, dtype=float) for a in (d1, n1, d0, n0))
    pick = np.random.default_rng(seed).integers(0, len(n1), size=(CLUSTER_DRAWS, len(n1)))
    runs1, runs0 = n1[pick].sum(axis=1), n0[pick].sum(axis=1)
    kept = (runs1 > 0) & (runs0 > 0)  # a draw with no floor runs says nothing of the excess
    excess = d1[pick].sum(axis=1)[kept] / runs1[kept] - d0[pick].sum(axis=1)[kept] / runs0[kept]
    if not len(excess):
        return 1.0, float("inf")
    return float(np.mean(excess <= 0)), float(np.std(excess))


def noise_test(d1, n1, d0, n0) -> tuple[float, float, float]:
    """(upper bound on the excess, one-sided p that it is above 0, its standard error) of a setting
    departing d1 of n1 against a floor of d0 of n0, per prompt (scalars: one prompt). The bound is the
    larger of the prompt-level bound (prompt_excess_upper: one prompt cannot bound it below 0.95) and
    Newcombe's with runs as the unit; the p, over two or more prompts, the larger of Fisher's over runs
    and a bootstrap's over prompts."""
    d1, n1, d0, n0 = (np.atleast_1d(np.asarray(a, dtype=int)) for a in (d1, n1, d0, n0))
    keep = n1 > 0
    d1, n1, d0, n0 = d1[keep], n1[keep], d0[keep], n0[keep]
    totals = int(d1.sum()), int(n1.sum()), int(d0.sum()), int(n0.sum())
    upper = excess_upper(d1, n1, d0, n0)
    p, se = fisher_greater(*totals), _pooled_se(totals[1], totals[2], totals[3])
    if len(n1) >= 2:
        cluster_p, cluster_se = excess_by_prompt(d1, n1, d0, n0)
        p, se = max(p, cluster_p), max(se, cluster_se)
    return upper, p, se


def noise_verdict(d: int, n: int, fd: int, fc: int, prompts: int, upper: float, p: float, se: float,
                  margin: float = NOISE_MARGIN) -> tuple[str, str, float]:
    """(class, evidence, bound) from a noise test's figures (noise_test): within_noise, undecided or
    diverges (see the module's doc); the bound is the excess's upper bound, or the p of a divergence."""
    few = least_prompt_bound(prompts) > margin
    unit = "prompts as the unit" + (f"; with no excess seen, {100 * margin:g} points needs at least "
                                    f"{prompts_for_margin(margin)} prompts" if few else "")
    test = "Fisher p" if prompts < 2 else "p (the larger of Fisher's over runs and a bootstrap's over prompts)"
    floor = f"the reference setting's own repeats depart {fd}/{fc}"
    if upper <= margin:
        return "within_noise", (f"{d}/{n} runs over {prompts} prompt(s) depart; {floor}; its rate exceeds theirs by at "
                                f"most {100 * upper:.1f} points (95%, {unit}), within the margin of {100 * margin:g}"), upper
    if p >= ALPHA:
        more = "more prompts would tell" if few else "more runs of more prompts would tell"
        return "undecided", (f"{d}/{n} runs over {prompts} prompt(s) depart; {floor}; the data cannot decide: the "
                             f"excess may be up to {100 * upper:.1f} points (95%, {unit}; over the margin of "
                             f"{100 * margin:g}), yet is not shown (one-sided {test} = {p:.2f}); {more}"), upper
    return "diverges", (f"{d}/{n} runs over {prompts} prompt(s) depart; {floor}; more often than the floor "
                        f"(one-sided {test} = {p:.3g})"), p


@lru_cache(maxsize=64)
def prompts_for_margin(margin: float) -> int:
    """The fewest prompts whose bound can fall within `margin` (none departing more than in the floor):
    least_prompt_bound falls as prompts are added, so doubling then halving finds it in a few dozen bounds."""
    high = 1
    while least_prompt_bound(high) > margin and high < 1 << 20:
        high *= 2
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if least_prompt_bound(middle) > margin else (low, middle)
    return high


def noise_class(d, n, fd, fc, margin: float = NOISE_MARGIN) -> tuple[str, str, float]:
    """(class, evidence, bound) of a setting whose runs depart d of n, against a floor of fd of fc:
    within_noise, undecided or diverges (see the module's doc). Arrays give one entry per prompt
    (the same prompts on both sides); scalars are one prompt."""
    return _noise(d, n, fd, fc, margin)[0]


def _noise(d, n, fd, fc, margin: float) -> tuple[tuple[str, str, float], tuple[float, float, float]]:
    """noise_class, and the noise test's figures (NaN where there was no test)."""
    none = (float("nan"),) * 3
    d_all, n_all, fd_all, fc_all = (int(np.sum(a)) for a in (d, n, fd, fc))
    if fc_all == 0:
        return ("diverges", f"{d_all}/{n_all} runs depart (the reference has no repeats to compare)",
                float("nan")), none
    if fd_all == 0:
        return ("diverges", f"{d_all}/{n_all} runs depart; the reference setting's own repeats depart "
                f"{fd_all}/{fc_all}: no noise to be within", float("nan")), none
    figures = noise_test(d, n, fd, fc)
    prompts = int(np.sum(np.atleast_1d(n) > 0))
    return noise_verdict(d_all, n_all, fd_all, fc_all, prompts, *figures, margin), figures


def fisher_greater(d1: int, n1: int, d0: int, n0: int) -> float:
    """One-sided Fisher exact p: the chance, with the margins fixed, that the first group has d1 or
    more of the d1 + d0 departures when both groups depart at one rate."""
    total, departed = n1 + n0, d1 + d0
    if n1 == 0 or departed == 0:
        return 1.0
    denominator = comb(total, departed)
    top = min(departed, n1)
    return float(sum(comb(n1, k) * comb(n0, departed - k) for k in range(d1, top + 1)) / denominator)


def floor_counts(compared: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per setting, cell, reference cell and prompt: its compared and departed runs (`compared`,
    `diverged`). Counts of disjoint runs, so a campaign's parts give the folder's by adding them up
    (joined_floor_counts), a prompt cut by its runs included; floors() is computed from them."""
    columns = list(dict.fromkeys(keys + ["cell_id", "reference_cell", "prompt_id", "matched", "first_divergence"]))
    judged = compared.loc[compared["matched"].notna().to_numpy(), columns]  # a million rows: only these columns
    by = list(dict.fromkeys(keys + ["cell_id", "reference_cell", "prompt_id"]))
    return judged.groupby(by, dropna=False, sort=True, observed=True).agg(
        compared=("matched", "size"), diverged=("first_divergence", "count")).reset_index()


def joined_floor_counts(counts: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """floor_counts of a folder from its parts' (the records of a setting, cell and prompt whose runs lie in
    several parts added up), in the order one read gives."""
    by = list(dict.fromkeys(keys + ["cell_id", "reference_cell", "prompt_id"]))
    if not counts.duplicated(by).any():
        return counts.sort_values(by, kind="stable", na_position="last").reset_index(drop=True)
    return counts.groupby(by, dropna=False, sort=True, observed=True)[["compared", "diverged"]].sum().reset_index()


def floors(counts: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per setting and prompt, in that order, from floor_counts: the setting's compared and departed runs
    (`compared`, `diverged`), the reference setting's own repeats of that prompt against their reference
    run (`floor_compared`, `floor_diverged`), and whether the setting is itself a reference (`is_floor`)."""
    by = keys + ["prompt_id"]
    runs = counts.groupby(by, dropna=False, sort=False, observed=True)[["compared", "diverged"]].sum()
    own = counts[(counts["cell_id"] == counts["reference_cell"]).to_numpy()]
    per_ref = own.groupby(["reference_cell", "prompt_id"], observed=True).agg(n=("compared", "sum"),
                                                                               d=("diverged", "sum"))
    pairs = counts[list(dict.fromkeys(by + ["cell_id", "reference_cell"]))].drop_duplicates(
        ["cell_id", "reference_cell", "prompt_id"])
    pairs = pairs.join(per_ref, on=["reference_cell", "prompt_id"]).fillna({"n": 0, "d": 0})
    pairs["self"] = pairs["cell_id"] == pairs["reference_cell"]
    again = pairs.duplicated(by + ["reference_cell"])  # a reference cell's repeats count once per setting
    pairs["n"], pairs["d"] = pairs["n"].where(~again, 0), pairs["d"].where(~again, 0)
    out = pairs.groupby(by, dropna=False, sort=True, observed=True).agg(
        floor_compared=("n", "sum"), floor_diverged=("d", "sum"), is_floor=("self", "all"))
    # sorted by setting and prompt: a setting's prompts are in one order (the bootstrap's) whatever the
    # order the rows were read in, a campaign's parts included (harness.analysis.partitioned)
    return out.join(runs).reset_index()


def _answers_of(answers: pd.DataFrame | None, setting: dict, keys: list[str]) -> dict | None:
    if answers is None or answers.empty:
        return None
    found = select_setting(answers, {k: setting.get(k) for k in keys if k in answers})
    return None if found.empty else found.iloc[0].to_dict()


def classify(settings: pd.DataFrame, floor: pd.DataFrame, answers: pd.DataFrame | None = None,
             margin: float = NOISE_MARGIN, reference: dict | None = None) -> pd.DataFrame:
    """`settings` (harness.analysis.by_setting.agreement) with COLUMNS added; `floor`: floors();
    `reference`: the reference rule's axes (a reference across batch_invariant judges no mode)."""
    rule = dict(reference or {})
    counts = ["compared", "diverged", "floor_compared", "floor_diverged"]
    keys = [k for k in settings.columns if k in floor.columns and k not in counts + ["is_floor", "prompt_id"]]
    out = settings.copy()
    lookup: dict[tuple, tuple[np.ndarray, bool]] = {}  # per setting: its per-prompt counts, whether a floor
    for key, part in floor.groupby(keys, dropna=False, sort=False, observed=True):
        at = tuple(None if pd.isna(v) else v for v in (key if isinstance(key, tuple) else (key,)))
        lookup[at] = (part[counts].to_numpy(dtype=np.int64), bool(part["is_floor"].all()))
    empty = np.zeros((0, len(counts)), dtype=np.int64)
    classes, evidence, bounds, floor_n, floor_d, noise = [], [], [], [], [], []
    for rec in out.to_dict("records"):
        n, d = int(rec["compared"]), int(rec["diverged"])
        prompts, bound = int(rec["prompts"]), rec["upper95_prompts"]
        bound = rec["upper95_pooled"] if pd.isna(bound) else bound  # one prompt: the pooled bound, labelled
        unit = "prompts as the unit" if not pd.isna(rec["upper95_prompts"]) else "pooled over runs"
        lp_n, lp_same = int(rec.get("logprobs_compared") or 0), int(rec.get("logprobs_identical_runs") or 0)
        per_prompt, is_floor = lookup.get(tuple(None if pd.isna(rec[k]) else rec[k] for k in keys), (empty, False))
        if is_floor:
            per_prompt = per_prompt * np.array([1, 1, 0, 0])
        fc, fd = int(per_prompt[:, 2].sum()), int(per_prompt[:, 3].sum())
        floor_n.append(fc), floor_d.append(fd)
        figures = (np.nan,) * len(NOISE_COLUMNS)
        answer = _answers_of(answers, rec, keys)
        if n == 0:
            classes.append(None), evidence.append("no compared runs"), bounds.append(np.nan)
        elif _mode_judged(rec, rule) and not is_floor and _on(rec.get("batch_invariant")) and (d > 0 or lp_same < lp_n):
            classes.append("mode_ineffective")
            evidence.append(f"batch-invariant mode on, yet {d}/{n} runs over {prompts} prompt(s) depart in tokens and "
                            f"{lp_n - lp_same}/{lp_n} in log-probabilities from the reference run of the same mode: "
                            "the mode keeps a batch bitwise, so it did not take effect here")
            bounds.append(np.nan)
        elif d == 0 and lp_n == n and lp_same == n:
            classes.append("bitwise")
            evidence.append(f"{n}/{n} runs over {prompts} prompt(s) with tokens and log-probabilities bitwise equal "
                            f"to the reference's; share that would differ < {100 * bound:.1f}% ({unit})")
            bounds.append(bound)
        elif d == 0:
            why = ("log-probabilities not recorded" if lp_n == 0 else
                   f"log-probabilities not recorded for {n - lp_n}" if lp_n < n
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
            (found, said, bound), figures = _noise(per_prompt[:, 1], per_prompt[:, 0], per_prompt[:, 3],
                                                   per_prompt[:, 2], margin)
            classes.append(found), evidence.append(said), bounds.append(bound)
        noise.append(figures)
        if _on(rec.get("batch_invariant")) and not is_floor and n and not _mode_judged(rec, rule) \
                and (d > 0 or lp_same < lp_n):
            evidence[-1] += (f"; batch-invariant mode not judged: the reference differs in "
                             f"{', '.join(_differing(rec, rule)) or 'nothing'}, not only in the batch's composition")
    out["guarantee"], out["guarantee_evidence"], out["guarantee_bound"] = classes, evidence, bounds
    out["floor_compared"], out["floor_diverged"] = floor_n, floor_d
    for i, column in enumerate(NOISE_COLUMNS):
        out[column] = [figures[i] for figures in noise]
    return out


def _differing(rec: dict, rule: dict) -> list[str]:
    """The reference rule's axes in which this setting is not the reference."""
    return [k for k, v in rule.items() if k in rec and rec[k] != v and str(rec[k]) != str(v)]


def _mode_judged(rec: dict, rule: dict) -> bool:
    """Whether this setting's comparison can judge a batch-invariant mode: its reference differs from
    it in the batch's composition alone (a reference across the mode itself judges no mode)."""
    differing = _differing(rec, rule)
    return "batch_invariant" not in rule and bool(differing) and set(differing) <= set(COMPOSITION_AXES)


def _on(value: object) -> bool:
    return value is not None and not pd.isna(value) and bool(value)


def holds(found: str | None, wanted: str) -> bool:
    """Whether a setting of class `found` keeps the guarantee `wanted` (a stronger class keeps a weaker one)."""
    return found is not None and STRENGTH[found] >= STRENGTH[wanted]


def holds_with_margin(record: dict, wanted: str, margin: float) -> tuple[bool, str]:
    """`holds` for a settings record, with within_noise judged again at `margin` (a rule's own) from the
    record's counts: whether it holds, and the class and evidence found."""
    found, evidence = record["guarantee"], record["guarantee_evidence"]
    figures = [record.get(c) for c in NOISE_COLUMNS]
    if found in ("within_noise", "undecided", "diverges") and not any(f is None or pd.isna(f) for f in figures):
        found, evidence, _ = noise_verdict(int(record["diverged"]), int(record["compared"]), int(record["floor_diverged"]),
                                           int(record["floor_compared"]), int(record["prompts"]), *figures, margin)
    return holds(found, wanted), f"{found}: {evidence}"
