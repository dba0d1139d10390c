"""What `harness compare` shows: the context that differs between two folders, per setting how many
prompts changed, where the first runs split (both texts around the split), and the settings found
in one folder only; and, with --score, one noise-floor verdict line per setting."""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich.markup import escape
from rich.text import Text

from harness.analysis import noise_floor
from harness.analysis.compare import Comparison, around_split
from harness.experiment.varying import varying
from harness.report.plain import PlainTable
from harness.results.columns import keys_of

#: runs whose texts are shown around their split
SHOWN_SPLITS = 20


def compare_view(result: Comparison, a: str, b: str, ignore: tuple[str, ...]) -> list[Any]:
    """The comparison's renderables, in print order (a Text is printed as it is, never as markup)."""
    out: list[Any] = [f"[yellow]differs[/yellow] {what}: A {escape(in_a)} | B {escape(in_b)}"
                      for what, in_a, in_b in result.context]
    shown = varying(result.per_setting, keys_of(result.per_setting, drop=ignore)) or ["engine"]
    table = PlainTable(title=f"prompts changed: {b} vs {a} (first repeat)")
    for col in shown + ["prompts", "changed", "first divergence"]:
        table.add_column(col)
    for rec in result.per_setting.to_dict("records"):
        first = rec["first_divergence_min"]
        table.add_row(*[str(rec[k]) for k in shown], str(rec["prompts"]), str(rec["changed"]),
                      "-" if pd.isna(first) else str(int(first)))
    out.append(table)
    differ = result.runs[~result.runs["same"] & (result.runs["repeat"] == 0)]
    for rec in differ.head(SHOWN_SPLITS).to_dict("records"):
        at = int(rec["first_divergence"])
        out.append(f"[bold]{escape(str(rec['prompt_id']))}[/bold] "
                   f"({escape(', '.join(f'{k}={rec[k]}' for k in shown))}) splits at token {at}")
        out.append(Text(f"  A: {around_split(rec['token_texts_a'], rec['text_a'], at)!r}"))
        out.append(Text(f"  B: {around_split(rec['token_texts_b'], rec['text_b'], at)!r}"))
    for label, frame in (("only in A", result.only_a), ("only in B", result.only_b)):
        for rec in frame.to_dict("records"):
            out.append(f"[yellow]{label}[/yellow]: " + escape(", ".join(f"{k}={v}" for k, v in rec.items())))
    return out


def noise_floor_lines(frame: pd.DataFrame) -> list[str]:
    """One line per setting of B: its verdict against A's noise (markup-escaped)."""
    settings = list(frame.columns[: len(frame.columns) - len(noise_floor.COLUMNS)])
    shown = varying(frame, settings)
    lines = []
    for rec in frame.to_dict("records"):
        label = ", ".join(f"{k}={rec[k]}" for k in shown) or "every setting"
        lines.append(f"{escape(label)}: {escape(noise_floor.describe(rec))}")
    return lines
