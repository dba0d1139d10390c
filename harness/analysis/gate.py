"""`harness check`: the experiment's `expect:` rules against its results, as a CI verdict."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from xml.sax.saxutils import escape, quoteattr

import pandas as pd

from harness.analysis.frames import select_setting
from harness.core.errors import HarnessError
from harness.core.redaction import redact
from harness.experiment.schema import CONDITIONS, Expectation
from harness.experiment.varying import varying
from harness.results.columns import keys_of


@dataclass(frozen=True)
class Verdict:
    rule: str
    passed: bool
    detail: str


def _where(frame: pd.DataFrame, where: dict[str, Any]) -> pd.DataFrame:
    """The records a rule's `where` selects; a key the records lack selects none of them. A value is
    matched as written and as rows store it (a credential in it redacted: the rows hold no other form)."""
    mask = pd.Series(True, index=frame.index)
    for key, value in where.items():
        mask &= (frame[key] == value) | (frame[key] == redact(value, key)) if key in frame else False
    return frame[mask]


def _label(index: int, rule: Expectation) -> str:
    conds = [f"{k}={getattr(rule, k)}" for k in CONDITIONS if getattr(rule, k) is not None]
    where = ",".join(f"{k}={v}" for k, v in rule.where.items()) or "all cells"
    return rule.name or f"#{index + 1} {' '.join(conds)} where {where}"


def _listed(problems: list[str]) -> str:
    return "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")


def _judge_answers(rule: Expectation, answers: pd.DataFrame) -> tuple[list[str], dict[str, int]]:
    """Answer rules, on the per-setting answer statistics the rule's `where` selects."""
    problems: list[str] = []
    judged: dict[str, int] = {}
    if answers.empty:
        return problems, judged
    chosen = _where(answers, rule.where)
    if rule.accuracy_drop_max is not None:
        paired = chosen[chosen["accuracy_diff"].notna()]
        judged["accuracy_drop_max"] = len(paired)
        for r in paired[-paired["accuracy_diff"] > rule.accuracy_drop_max].itertuples():
            problems.append(f"batch {r.batch_size} {r.dtype}: accuracy {100 * r.accuracy_diff:+.1f} points against "
                            f"{r.reference} (95% CI {100 * r.diff_low:+.1f} to {100 * r.diff_high:+.1f})")
    if rule.answer_agreement_min is not None:
        agreed = chosen[chosen["answer_agreement"].notna()]
        judged["answer_agreement_min"] = len(agreed)
        for r in agreed[agreed["answer_agreement"] < rule.answer_agreement_min].itertuples():
            problems.append(f"batch {r.batch_size} {r.dtype}: {100 * r.answer_agreement:.1f}% of answers equal "
                            f"the reference's")
    return problems, judged


def _scoped(cells: pd.DataFrame, scope: str) -> pd.DataFrame:
    """The records with their compared/diverged/match-rate/unique-output figures taken from one scope's
    runs (same_boot, cross_boot: harness.analysis.metrics.BOOT_COLUMNS); 'all' leaves them as they are."""
    if scope == "all":
        return cells
    compared = cells[f"{scope}_compared"].fillna(0) if f"{scope}_compared" in cells else 0 * cells["runs"]
    diverged = cells[f"{scope}_diverged"].fillna(0) if f"{scope}_diverged" in cells else 0 * cells["runs"]
    out = cells.assign(compared=compared, diverged=diverged,
                       match_rate=((compared - diverged) / compared).where(compared > 0))
    if scope == "same_boot" and "unique_outputs_within_load" in cells:
        out["unique_outputs"] = cells["unique_outputs_within_load"]
    return out


def _judge(rule: Expectation, cells: pd.DataFrame, cost: pd.DataFrame) -> tuple[list[str], dict[str, int]]:
    """(problems, how many records each condition of the rule judged) for the records it selects."""
    cells = _scoped(cells, rule.scope)
    problems: list[str] = []
    judged: dict[str, int] = {}
    ran = cells[cells["runs"] > 0]
    compared = cells[cells["compared"].fillna(0) > 0]
    if rule.status is not None:
        judged["status"] = len(cells)
        bad = cells[cells["status"] != rule.status]
        problems += [f"{r.prompt_id}@{r.cell_id}: status {r.status}" for r in bad.itertuples()]
    if rule.unique_outputs is not None:
        judged["unique_outputs"] = len(ran)
        bad = ran[ran["unique_outputs"] > rule.unique_outputs]
        problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.unique_outputs)} unique outputs" for r in bad.itertuples()]
    if rule.match_rate_min is not None:
        judged["match_rate_min"] = len(compared)
        bad = compared[~(compared["match_rate"] >= rule.match_rate_min)]
        problems += [f"{r.prompt_id}@{r.cell_id}: match rate {r.match_rate:.3f}" for r in bad.itertuples()]
    if rule.divergence_rate_max is not None:
        judged["divergence_rate_max"] = len(compared)
        rate = compared["diverged"] / compared["compared"]
        bad = compared[~(rate <= rule.divergence_rate_max)]
        problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.diverged)}/{int(r.compared)} diverged" for r in bad.itertuples()]
    if rule.divergence_bound_max is not None:
        from harness.analysis.by_setting import agreement

        per_setting = agreement(compared)
        judged["divergence_bound_max"] = len(per_setting)
        column = f"upper95_{rule.bound}"
        for r in per_setting.to_dict("records"):
            if not r[column] <= rule.divergence_bound_max:  # NaN (one prompt, with divergences) fails too
                setting = _setting_of(r, per_setting)
                why = (f"95% upper bound {100 * r[column]:.1f}%" if r[column] == r[column]
                       else "no bound with prompts as the unit from one prompt")
                problems.append(f"{setting}: {r['diverged']}/{r['compared']} diverged over "
                                f"{r['prompts']} prompt(s); {why} ({rule.bound}) > {100 * rule.divergence_bound_max:g}%")
    if rule.divergence_rate_min is not None:
        # The negative control: with the mode off a difference must be found, or the test tests
        # nothing. Pooled over the selection (a control need not split every prompt), and never
        # passed by zero divergences.
        judged["divergence_rate_min"] = len(compared)
        diverged, total = int(compared["diverged"].sum()), int(compared["compared"].sum())
        if total and (diverged == 0 or diverged / total < rule.divergence_rate_min):
            problems.append(f"negative control: {diverged}/{total} compared runs diverged "
                            f"(wants at least {rule.divergence_rate_min:g} and at least one)")
    if rule.logprobs_identical_min is not None:
        lp = cells[cells["logprobs_compared"].fillna(0) > 0] if "logprobs_compared" in cells else cells.iloc[0:0]
        judged["logprobs_identical_min"] = len(lp)
        bad = lp[~(lp["logprobs_identical"] >= rule.logprobs_identical_min)]
        problems += [f"{r.prompt_id}@{r.cell_id}: {r.logprobs_identical:.3f} of runs with bitwise-equal "
                     f"log-probabilities" for r in bad.itertuples()]
    if rule.slowdown_max is not None:
        where = {k: v for k, v in rule.where.items() if k != "batch_invariant"}
        pairs = _where(cost, where)
        judged["slowdown_max"] = len(pairs)
        for r in pairs[pairs["throughput_ratio"] > rule.slowdown_max].itertuples():
            problems.append(f"batch {r.batch_size}: slowdown {r.throughput_ratio:.2f}x")
    if rule.latency_ratio_max is not None:
        from harness.analysis.latency import TITLES, columns

        where = {k: v for k, v in rule.where.items() if k != "batch_invariant"}
        pairs = _where(cost, where)
        judged["latency_ratio_max"] = len(pairs)
        name = columns(rule.latency_metric, rule.latency_percentile)
        said = f"{TITLES[rule.latency_metric]} p{rule.latency_percentile}"
        for r in pairs.to_dict("records"):
            ratio = r.get(f"{name}_ratio", float("nan"))
            if ratio != ratio:  # NaN: not recorded on one side, never a pass
                problems.append(f"batch {r['batch_size']}: no {said} recorded for both sides (this engine does not "
                                "report it, or no run had two tokens)")
            elif ratio > rule.latency_ratio_max:
                problems.append(f"batch {r['batch_size']}: {said} on / off {ratio:.2f}x "
                                f"({1000 * r[name + '_on']:.1f} ms vs {1000 * r[name + '_off']:.1f} ms)")
    return problems, judged


def _setting_of(record: dict[str, Any], frame: pd.DataFrame) -> str:
    return ", ".join(f"{k}={record[k]}" for k in _varying_keys(frame)) or "all cells"


def _judge_settings(rule: Expectation, settings: Callable[[], pd.DataFrame],
                    flips: Callable[[], pd.DataFrame]) -> tuple[list[str], dict[str, int]]:
    """The per-setting rules: guarantee classes (harness.analysis.guarantees) and confident flips
    (harness.analysis.flips), on the settings the rule's `where` selects; read only when asked."""
    from harness.analysis import flips as flips_module
    from harness.analysis.guarantees import NOISE_MARGIN, holds_with_margin

    problems: list[str] = []
    judged: dict[str, int] = {}
    if rule.guarantee is not None:
        chosen = _where(settings(), rule.where)
        chosen = chosen[chosen["compared"] > 0]
        judged["guarantee"] = len(chosen)
        margin = NOISE_MARGIN if rule.noise_margin is None else rule.noise_margin
        for r in chosen.to_dict("records"):
            kept, found = holds_with_margin(r, rule.guarantee, margin)
            if not kept:
                cls, _, evidence = found.partition(": ")
                problems.append(f"{_setting_of(r, chosen)}: {cls} (wants {rule.guarantee} or stronger): {evidence}")
    if rule.confident_flips_max is not None:
        table = settings()
        chosen = _where(table, rule.where)
        greedy = chosen[(chosen["compared"] > 0) & ~(chosen["temperature"].astype(float) > 0)]
        judged["confident_flips_max"] = len(greedy)
        departed = _where(flips(), rule.where)
        departed = departed[~(departed["temperature"].astype(float) > 0)] if "temperature" in departed else departed
        margin = flips_module.CONFIDENT if rule.confident_margin is None else rule.confident_margin
        keys = [k for k in keys_of(table) if k in departed]
        for r in greedy.to_dict("records"):
            mine = select_setting(departed, {k: r[k] for k in keys})
            known = mine["flip_margin"].notna()
            confident = mine[known & (mine["flip_margin"] >= margin)]
            label = _setting_of(r, chosen)
            if len(confident) > rule.confident_flips_max:
                worst = confident.sort_values("flip_margin", ascending=False).iloc[0]
                problems.append(f"{label}: {len(confident)} confident flip(s) (reference margin >= {margin:g}), "
                                f"largest {worst.flip_margin:.2f} at token {int(worst.first_divergence)} of "
                                f"{worst.prompt_id}@{worst.cell_id}; a likely bug, not rounding")
            if (~known).any():
                problems.append(f"{label}: {int((~known).sum())} departure(s) with no reference margin recorded, so "
                                "confident flips cannot be ruled out (an engine that returns no top-2, or a split past "
                                "the reference's end)")
    return problems, judged


def _varying_keys(frame: pd.DataFrame) -> list[str]:
    """The setting columns that tell a frame's records apart."""
    return varying(frame, keys_of(frame))


def _reasons(frame: pd.DataFrame) -> str:
    """The cells of `frame` by the reason they carry: 'reason (ids)' for each reason, the first few."""
    by_reason: dict[str, list[str]] = {}
    for cell_id, error in zip(frame["cell_id"], frame["error"]):
        by_reason.setdefault(str(error)[:160], []).append(cell_id)
    return _listed([f"{why}: {_listed(list(dict.fromkeys(ids)))}" for why, ids in by_reason.items()])


def _not_run(rule: Expectation, cells: pd.DataFrame, missing: pd.DataFrame) -> list[str]:
    """The selection's cells that never ran (no file: a task that never started), were skipped or
    were refused by their engine (unsupported): a rule judges every cell it selects, or says why not."""
    out = []
    absent = _where(missing, rule.where) if not missing.empty and not rule.allow_missing else missing.iloc[0:0]
    if not absent.empty:
        ids = list(absent["cell_id"])
        out.append(f"{len(ids)} selected cell(s) never ran (missing: {_listed(ids)}); run them, or set "
                   "allow_missing: true")
    for status, allowed, advice in (
            ("skipped", rule.allow_missing, "run them where they can run, or set allow_missing: true"),
            ("unsupported", rule.allow_unsupported, "change the setting, or set allow_unsupported: true to judge the rest")):
        column = f"n_{status}"
        if allowed or rule.status == status or column not in cells:
            continue
        hit = cells[cells[column].fillna(0) > 0]
        if not hit.empty:
            count = hit["cell_id"].nunique()
            out.append(f"{count} selected cell(s) {'were skipped' if status == 'skipped' else 'were refused (unsupported)'}"
                       f" ({_reasons(hit)}); {advice}")
    return out


def evaluate(
    rules: list[Expectation], summary: pd.DataFrame, cost: pd.DataFrame, answers: pd.DataFrame | None = None,
    missing: pd.DataFrame | None = None, settings: Callable[[], pd.DataFrame] | None = None,
    flips: Callable[[], pd.DataFrame] | None = None,
) -> list[Verdict]:
    """One verdict per rule. A rule fails when it matches nothing, when one of its conditions judges
    nothing (no compared runs, no paired timings), when a cell it selects never ran, was skipped
    (unless allow_missing), was refused by its engine (unless allow_unsupported) or has failed runs
    (unless allow_failed). `missing` lists the experiment's cells with no results (cell_id and
    setting columns); `settings` and `flips` give the per-setting table (with guarantee classes)
    and the departed runs, for the rules that read them."""
    missing = pd.DataFrame(columns=["cell_id"]) if missing is None else missing

    def empty() -> pd.DataFrame:
        return pd.DataFrame(columns=["compared", "temperature", "guarantee", "flip_margin"])

    settings, flips = settings or empty, flips or empty
    verdicts = []
    for index, rule in enumerate(rules):
        label = _label(index, rule)
        cells = _where(summary, rule.where)
        if cells.empty and _where(missing, rule.where).empty:
            verdicts.append(Verdict(label, False, "matches no cell: no results match 'where'"))
            continue
        problems, judged = _judge(rule, cells, cost) if not cells.empty else ([], {})
        more, counted = _judge_answers(rule, answers if answers is not None else pd.DataFrame())
        problems = problems + more
        judged |= counted
        if not cells.empty:
            more, counted = _judge_settings(rule, settings, flips)
            problems, judged = problems + more, judged | counted
        failed = int(cells["n_failed"].sum()) if not cells.empty else 0
        if failed and not rule.allow_failed and rule.status != "failed":
            first = cells[cells["n_failed"] > 0].iloc[0]
            problems.insert(0, f"{failed} selected run(s) failed (e.g. {first.prompt_id}@{first.cell_id}: "
                               f"{str(first.error)[:120]}); rerun them, or set allow_failed: true")
        problems[:0] = _not_run(rule, cells, missing)
        asked = [k for k in CONDITIONS if getattr(rule, k) is not None]
        idle = [k for k in asked if not judged.get(k)]
        if idle:
            problems.insert(0, f"judged nothing for {', '.join(idle)}: no compared runs (or paired timings, or "
                               "answers) in its selection")
        total = sum(judged.values())
        said = _listed(problems) or f"{total} record(s) judged{_control(rule, summary)}"
        verdicts.append(Verdict(label, not problems, said))
    return verdicts


#: rule conditions that expect the selected runs to agree (a check of determinism)
_AGREEING = ("unique_outputs", "match_rate_min", "logprobs_identical_min", "guarantee")


def _control(rule: Expectation, summary: pd.DataFrame) -> str:
    """For a passing rule that expects batch-invariant runs to agree: the negative control, the same
    selection with the mode off, which must be able to differ, or the check proves nothing about the
    mode (said, the rule still passes; `divergence_rate_min` makes it a rule of its own)."""
    if rule.where.get("batch_invariant") is not True or not any(getattr(rule, k) is not None for k in _AGREEING):
        return ""
    off = _where(summary, rule.where | {"batch_invariant": False})
    off = off[off["compared"].fillna(0) > 0] if "compared" in off else off.iloc[0:0]
    if off.empty:
        return ("; no negative control here: no run of these settings with the mode off, so nothing shows that "
                "this check could fail (add batch_invariant: false to the matrix)")
    diverged, total = int(off["diverged"].fillna(0).sum()), int(off["compared"].sum())
    if diverged == 0:
        return (f"; negative control: with the mode off the same settings kept too (0/{total} runs departed), so "
                "this check cannot tell the mode from its absence here")
    return f"; negative control: with the mode off {diverged}/{total} runs departed"


def junit(verdicts: list[Verdict], suite: str) -> str:
    failures = sum(not v.passed for v in verdicts)
    cases = []
    for v in verdicts:
        body = "" if v.passed else f"<failure message={quoteattr(v.detail)}>{escape(v.detail)}</failure>"
        cases.append(f'  <testcase classname={quoteattr(suite)} name={quoteattr(v.rule)}>{body}</testcase>')
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<testsuite name={quoteattr(suite)} tests="{len(verdicts)}" failures="{failures}">\n'
        + "\n".join(cases) + "\n</testsuite>\n"
    )


def write_junit(path: Path, verdicts: list[Verdict], suite: str) -> None:
    """The verdicts as a JUnit XML file (CI systems show each rule as a test case)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit(verdicts, suite))


def check_folder(analysis: Any, rules: list[Expectation] | None = None) -> list[Verdict]:
    """The verdicts of `rules` (default: the folder's experiments' own `expect:`) on one analysis of a
    folder; the experiment's cells with no results count as missing."""
    if rules is None:
        rules = [r for e in analysis.results.experiments for r in e.experiment.expect]
        if not rules:
            raise HarnessError(f"{analysis.results.root}: the experiment has no 'expect:' rules; give --expect FILE")
    return evaluate(rules, analysis.summary, analysis.slowdown, analysis.answers, analysis.missing(),
                    lambda: analysis.by_setting, lambda: analysis.flips)
