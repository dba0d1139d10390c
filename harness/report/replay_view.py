"""What `harness replay` shows: per replayer and setting, how far the replayed log-probabilities
are from the recorded ones over whole outputs, and where the replayer would have split."""

from __future__ import annotations

import json

import pandas as pd
from rich.table import Table

from harness.experiment.varying import varying
from harness.report.plain import PlainTable
from harness.results.columns import keys_of


def _fmt(value: float, spec: str = ".3g") -> str:
    return "-" if pd.isna(value) else format(value, spec)


def replay_table(frame: pd.DataFrame) -> Table:
    """One line per replayer and setting, prompts pooled (every step weighs the same)."""
    shown = varying(frame, keys_of(frame)) or ["engine"]
    table = PlainTable(title="replayed: each recorded token forced through the replayer's decode loop; delta = "
                             "replay - recorded log-probability; 'would split' = steps where its argmax differs")
    for name in ("replayer", "batch", *shown, "runs", "steps", "mean|Δ|", "max|Δ|", "k3 KL", "runs split", "steps split",
                 "first split"):
        table.add_column(name)
    for key, part in frame.groupby(["replayer", *shown], sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        who = json.loads(key[0])
        w = part["steps"].astype(float)
        mean = (lambda c: float((part[c] * w).sum() / w.sum()) if w.sum() else float("nan"))  # noqa: E731
        table.add_row(f"{who.get('engine')} {who.get('dtype')}", str(who.get("batch", "")), *[str(v) for v in key[1:]],
                      str(int(part["runs"].sum())), str(int(w.sum())), _fmt(mean("mean_abs_delta")),
                      _fmt(part["max_abs_delta"].max()), _fmt(mean("k3_kl")), str(int(part["would_split_runs"].sum())),
                      str(int(part["would_split_steps"].sum())), _fmt(part["first_would_split"].min(), ".0f"))
    return table
