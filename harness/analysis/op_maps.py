"""Op maps (harness.run.op_probe) read back: one node's map, and two nodes' side by side.

Two maps are paired cell by cell on (library, device, dtype, K, N, M): the probe's inputs are
seeded the same on every node, so a cell that is row-invariant on one node and not on the other is
a difference of the node (its CPU features, GPU type or library build), not of the data.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.core.errors import HarnessError

KEYS = ["library", "device", "dtype", "k", "n", "m"]
NEEDED = set(KEYS) | {"row_invariant", "repeat_identical", "max_abs_diff", "host"}


def is_op_map(path: Path) -> bool:
    """Whether `path` is an op map file (a Parquet file, not a results folder)."""
    return Path(path).is_file() and Path(path).suffix == ".parquet"


def read(path: Path) -> pd.DataFrame:
    """An op map, refused with the columns it lacks when it is not one."""
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{path}: not a readable Parquet file ({exc})") from None
    lacking = NEEDED - set(frame.columns)
    if lacking:
        raise HarnessError(f"{path}: not an op map from 'harness doctor --ops' (no column {', '.join(sorted(lacking))})")
    return frame


def node_of(frame: pd.DataFrame) -> str:
    """'host (CPU; GPU)' of a map."""
    first = frame.iloc[0] if len(frame) else {}
    gpu = str(first.get("gpu_name") or "")
    return f"{first.get('host', '?')} ({first.get('cpu', '?')}{'; ' + gpu if gpu else ''})"


def side_by_side(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Per cell both maps have: each node's row invariance, run-to-run identity and largest
    difference, and whether the two nodes agree on invariance. Cells one map lacks are left out
    (a dtype the other node has no kernel for)."""
    cols = ["row_invariant", "repeat_identical", "max_abs_diff"]
    merged = a[KEYS + cols].merge(b[KEYS + cols], on=KEYS, suffixes=("_a", "_b"))
    merged["same_verdict"] = merged["row_invariant_a"] == merged["row_invariant_b"]
    return merged.sort_values(KEYS, kind="stable").reset_index(drop=True)


def tallies(frame: pd.DataFrame) -> pd.DataFrame:
    """Per library, device and dtype: cells measured, row-invariant, repeat-identical, and the
    largest difference seen."""
    g = frame.groupby(["library", "device", "dtype"], sort=True)
    return pd.DataFrame({"cells": g.size(), "row_invariant": g["row_invariant"].sum(),
                         "repeat_identical": g["repeat_identical"].sum(),
                         "max_abs_diff": g["max_abs_diff"].max()}).reset_index()
