"""The summary as a rich table: only the axes that vary are shown, so it fits a terminal."""

from __future__ import annotations

import math

import pandas as pd
from rich.table import Table

from harness.metrics import KEY_COLUMNS

SHORT = {"batch_size": "batch", "batch_invariant": "b-inv", "temperature": "temp"}


def _fmt(value: object, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * float(value):.0f}%"
    if kind == "int":
        return str(int(value))
    if kind == "f1":
        return f"{float(value):.1f}"
    if kind == "f3":
        return f"{float(value):.3f}"
    return str(value)


def summary_table(summary: pd.DataFrame, title: str) -> Table:
    varying = [c for c in KEY_COLUMNS if c in summary and summary[c].astype(str).nunique() > 1]
    if "engine" not in varying:
        varying.insert(0, "engine")
    table = Table(title=title, title_justify="left")
    for col in varying + ["prompt_id"]:
        table.add_column(SHORT.get(col, col).replace("prompt_id", "prompt"))
    for name in ("status", "runs", "unique", "match", "first div min/med", "upper95", "tok/s"):
        table.add_column(name, justify="right" if name != "status" else "left")
    for rec in summary.to_dict("records"):
        status = rec["status"]
        style = {"ok": "", "unsupported": "yellow", "skipped": "dim", "failed": "red"}.get(status, "magenta")
        div = "-" if _fmt(rec["first_divergence_min"]) == "-" else (
            f"{_fmt(rec['first_divergence_min'], 'int')}/{_fmt(rec['first_divergence_median'], 'f1')}"
        )
        table.add_row(
            *[_fmt(rec[c]) for c in varying + ["prompt_id"]],
            status,
            _fmt(rec["runs"], "int"),
            _fmt(rec["unique_outputs"], "int"),
            _fmt(rec["match_rate"], "pct"),
            div,
            _fmt(rec["divergence_rate_upper95"], "f3"),
            _fmt(rec["tokens_per_s_median"], "f1"),
            style=style,
        )
    return table
