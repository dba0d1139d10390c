"""What `harness doctor --ops` and `harness compare MAP_A MAP_B` show: op maps as grids, K down, M across.

A cell reads '=' where row 0 was bitwise the same alone and inside M rows in every repeat, 'x'
where it was not, and carries 'r' where the repeats of the M-row product were not bitwise equal
to each other (run-to-run nondeterminism). Two maps show both marks per cell, A then B, and the
cells where the nodes disagree are listed.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from rich.markup import escape

from harness.analysis.op_maps import node_of, tallies
from harness.report.plain import PlainTable


def _mark(invariant: bool, repeatable: bool) -> str:
    return ("=" if invariant else "x") + ("" if repeatable else "r")


def _grid(title: str, part: pd.DataFrame, cell: Any) -> PlainTable:
    table = PlainTable(title=title)
    ms = sorted(part["m"].unique())
    table.add_column("K \\ M")
    for m in ms:
        table.add_column(str(m), justify="center")
    for k, rows in part.groupby("k", sort=True):
        by_m = {int(r["m"]): r for r in rows.to_dict("records")}
        table.add_row(str(k), *[cell(by_m[m]) if m in by_m else "" for m in ms])
    return table


def map_view(frame: pd.DataFrame, path: str) -> list[Any]:
    """One grid per library, device and dtype, under a line of counts each."""
    out: list[Any] = [f"op map of {escape(node_of(frame))}: row 0 of X[:M] @ W against X[:1] @ W, bitwise "
                      f"('=' same, 'x' differs, 'r' repeats differ); written to {escape(path)}"]
    for t in tallies(frame).to_dict("records"):
        part = frame[(frame["library"] == t["library"]) & (frame["device"] == t["device"])
                     & (frame["dtype"] == t["dtype"])]
        title = (f"{t['library']} {t['device']} {t['dtype']}: {t['row_invariant']}/{t['cells']} row-invariant, "
                 f"{t['repeat_identical']}/{t['cells']} repeatable, largest difference {t['max_abs_diff']:.3g}")
        out.append(_grid(title, part, lambda r: _mark(r["row_invariant"], r["repeat_identical"])))
    return out


def compare_view(pairs: pd.DataFrame, a: pd.DataFrame, b: pd.DataFrame, name_a: str, name_b: str) -> list[Any]:
    """Both nodes' marks per cell (A then B), and the cells where they disagree."""
    out: list[Any] = [f"A = {escape(name_a)}: {escape(node_of(a))}", f"B = {escape(name_b)}: {escape(node_of(b))}"]
    if pairs.empty:
        return out + ["no cell in both maps (other libraries, dtypes or sizes): nothing to compare"]
    for (library, device, dtype), part in pairs.groupby(["library", "device", "dtype"], sort=True):
        same = int(part["same_verdict"].sum())
        title = (f"{library} {device} {dtype}: A {int(part['row_invariant_a'].sum())}/{len(part)} and "
                 f"B {int(part['row_invariant_b'].sum())}/{len(part)} row-invariant; the nodes agree on {same}/{len(part)}")
        out.append(_grid(title, part, lambda r: _mark(r["row_invariant_a"], r["repeat_identical_a"]) + " "
                         + _mark(r["row_invariant_b"], r["repeat_identical_b"])))
        apart = part[~part["same_verdict"]]
        if not apart.empty:
            listed = ", ".join(f"K={r.k} M={r.m}" for r in apart.head(12).itertuples())
            out.append(f"  differ at {listed}" + (f" (+{len(apart) - 12} more)" if len(apart) > 12 else ""))
    return out
