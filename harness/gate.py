"""`harness check`: the experiment's `expect:` rules against its results, as a CI verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

import pandas as pd

from harness.config import CONDITIONS, Expectation


@dataclass(frozen=True)
class Verdict:
    rule: str
    passed: bool
    detail: str


def _where(frame: pd.DataFrame, where: dict[str, Any]) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for key, value in where.items():
        if key in frame:
            mask &= frame[key] == value
    return frame[mask]


def _label(index: int, rule: Expectation) -> str:
    conds = [f"{k}={getattr(rule, k)}" for k in CONDITIONS if getattr(rule, k) is not None]
    where = ",".join(f"{k}={v}" for k, v in rule.where.items()) or "all cells"
    return rule.name or f"#{index + 1} {' '.join(conds)} where {where}"


def _listed(problems: list[str]) -> str:
    return "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")


def _judge_answers(rule: Expectation, answers: pd.DataFrame) -> tuple[list[str], int]:
    """Answer rules, on the per-setting answer statistics the rule's `where` selects."""
    problems: list[str] = []
    judged = 0
    if answers.empty:
        return problems, judged
    chosen = _where(answers, rule.where)
    if rule.accuracy_drop_max is not None:
        paired = chosen[chosen["accuracy_diff"].notna()]
        judged += len(paired)
        for r in paired[-paired["accuracy_diff"] > rule.accuracy_drop_max].itertuples():
            problems.append(f"batch {r.batch_size} {r.dtype}: accuracy {100 * r.accuracy_diff:+.1f} points against "
                            f"{r.reference} (95% CI {100 * r.diff_low:+.1f} to {100 * r.diff_high:+.1f})")
    if rule.answer_agreement_min is not None:
        agreed = chosen[chosen["answer_agreement"].notna()]
        judged += len(agreed)
        for r in agreed[agreed["answer_agreement"] < rule.answer_agreement_min].itertuples():
            problems.append(f"batch {r.batch_size} {r.dtype}: {100 * r.answer_agreement:.1f}% of answers equal "
                            f"the reference's")
    return problems, judged


def _judge(rule: Expectation, cells: pd.DataFrame, cost: pd.DataFrame) -> tuple[list[str], int]:
    """(problems, how many things the rule judged) for the records a rule selects."""
    problems: list[str] = []
    judged = 0
    ran = cells[cells["runs"] > 0]
    compared = cells[cells["compared"].fillna(0) > 0]
    if rule.status is not None:
        judged += len(cells)
        bad = cells[cells["status"] != rule.status]
        problems += [f"{r.prompt_id}@{r.cell_id}: status {r.status}" for r in bad.itertuples()]
    if rule.unique_outputs is not None:
        judged += len(ran)
        bad = ran[ran["unique_outputs"] > rule.unique_outputs]
        problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.unique_outputs)} unique outputs" for r in bad.itertuples()]
    if rule.match_rate_min is not None:
        judged += len(compared)
        bad = compared[~(compared["match_rate"] >= rule.match_rate_min)]
        problems += [f"{r.prompt_id}@{r.cell_id}: match rate {r.match_rate:.3f}" for r in bad.itertuples()]
    if rule.divergence_rate_max is not None:
        judged += len(compared)
        rate = compared["diverged"] / compared["compared"]
        bad = compared[~(rate <= rule.divergence_rate_max)]
        problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.diverged)}/{int(r.compared)} diverged" for r in bad.itertuples()]
    if rule.divergence_rate_min is not None:
        # The negative control: with the mode off a difference must be found, or the test tests
        # nothing. Pooled over the selection (a control need not split every prompt), and never
        # passed by zero divergences.
        judged += len(compared)
        diverged, total = int(compared["diverged"].sum()), int(compared["compared"].sum())
        if total and (diverged == 0 or diverged / total < rule.divergence_rate_min):
            problems.append(f"negative control: {diverged}/{total} compared runs diverged "
                            f"(wants at least {rule.divergence_rate_min:g} and at least one)")
    if rule.logprobs_identical_min is not None:
        lp = cells[cells["logprobs_compared"].fillna(0) > 0] if "logprobs_compared" in cells else cells.iloc[0:0]
        judged += len(lp)
        bad = lp[~(lp["logprobs_identical"] >= rule.logprobs_identical_min)]
        problems += [f"{r.prompt_id}@{r.cell_id}: {r.logprobs_identical:.3f} of runs with bitwise-equal "
                     f"log-probabilities" for r in bad.itertuples()]
    if rule.slowdown_max is not None:
        where = {k: v for k, v in rule.where.items() if k != "batch_invariant"}
        pairs = _where(cost, where)
        judged += len(pairs)
        for r in pairs[pairs["throughput_ratio"] > rule.slowdown_max].itertuples():
            problems.append(f"batch {r.batch_size}: slowdown {r.throughput_ratio:.2f}x")
    return problems, judged


def evaluate(
    rules: list[Expectation], summary: pd.DataFrame, cost: pd.DataFrame, answers: pd.DataFrame | None = None
) -> list[Verdict]:
    """One verdict per rule. A rule fails when it matches nothing, judges nothing (no compared
    runs, no paired timings), or when a selected run failed (unless it says allow_failed)."""
    verdicts = []
    for index, rule in enumerate(rules):
        label = _label(index, rule)
        cells = _where(summary, rule.where)
        if cells.empty:
            verdicts.append(Verdict(label, False, "matches no cell: no results match 'where'"))
            continue
        problems, judged = _judge(rule, cells, cost)
        more, counted = _judge_answers(rule, answers if answers is not None else pd.DataFrame())
        problems, judged = problems + more, judged + counted
        failed = int(cells["n_failed"].sum())
        if failed and not rule.allow_failed and rule.status != "failed":
            first = cells[cells["n_failed"] > 0].iloc[0]
            problems.insert(0, f"{failed} selected run(s) failed (e.g. {first.prompt_id}@{first.cell_id}: "
                               f"{str(first.error)[:120]}); rerun them, or set allow_failed: true")
        if judged == 0:
            problems.insert(0, "judged nothing: no compared runs (or paired timings) in its selection")
        verdicts.append(Verdict(label, not problems, _listed(problems) or f"{judged} record(s) judged"))
    return verdicts


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
