"""`harness check`: the experiment's `expect:` rules against its results, as a CI verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

import pandas as pd

from harness.config import Expectation


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
    conds = [f"{k}={getattr(rule, k)}" for k in ("unique_outputs", "match_rate_min", "divergence_rate_max",
                                                 "slowdown_max", "status") if getattr(rule, k) is not None]
    where = ",".join(f"{k}={v}" for k, v in rule.where.items()) or "all cells"
    return rule.name or f"#{index + 1} {' '.join(conds)} where {where}"


def evaluate(rules: list[Expectation], summary: pd.DataFrame, cost: pd.DataFrame) -> list[Verdict]:
    """One verdict per rule; a rule that matches no cells fails (nothing was shown)."""
    verdicts = []
    for index, rule in enumerate(rules):
        label = _label(index, rule)
        cells = _where(summary, rule.where)
        problems: list[str] = []
        if cells.empty:
            verdicts.append(Verdict(label, False, "no results match 'where'"))
            continue
        if rule.status is not None:
            bad = cells[cells["status"] != rule.status]
            problems += [f"{r.prompt_id}@{r.cell_id}: status {r.status}" for r in bad.itertuples()]
        ok = cells[cells["runs"] > 0]
        if rule.unique_outputs is not None:
            bad = ok[ok["unique_outputs"] > rule.unique_outputs]
            problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.unique_outputs)} unique outputs" for r in bad.itertuples()]
        if rule.match_rate_min is not None:
            bad = ok[~(ok["match_rate"] >= rule.match_rate_min)]
            problems += [f"{r.prompt_id}@{r.cell_id}: match rate {r.match_rate}" for r in bad.itertuples()]
        if rule.divergence_rate_max is not None:
            rate = ok["diverged"] / ok["compared"]
            bad = ok[~(rate <= rule.divergence_rate_max)]
            problems += [f"{r.prompt_id}@{r.cell_id}: {int(r.diverged)}/{int(r.compared)} diverged" for r in bad.itertuples()]
        if rule.slowdown_max is not None:
            where = {k: v for k, v in rule.where.items() if k != "batch_invariant"}
            pairs = _where(cost, where)
            if pairs.empty:
                problems.append("no paired batch-invariant on/off runs to measure a slowdown")
            for r in pairs[pairs["throughput_ratio"] > rule.slowdown_max].itertuples():
                problems.append(f"batch {r.batch_size}: slowdown {r.throughput_ratio:.2f}x")
        if (rule.unique_outputs is not None or rule.match_rate_min is not None) and ok.empty:
            problems.append("no successful runs to judge")
        detail = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        verdicts.append(Verdict(label, not problems, detail or f"{len(cells)} cell/prompt records checked"))
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
