"""Row frames read by setting: one setting's rows, setting numbers, per-value maps and pair lookups,
written once for the million-row folders every statistic reads."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd

#: the columns that name a run: runs sorted by them are in one order however they were read (a whole
#: folder, or a campaign's parts joined: harness.analysis.partitioned)
RUN_ORDER = ("cell_id", "prompt_id", "repeat")


def in_run_order(frame: pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """`frame` (one record per run, or finer) sorted by RUN_ORDER, stably, with a fresh index; only
    those of `columns` it has, once each, where given (the piece a table reads)."""
    if columns is not None:
        frame = frame[[c for c in dict.fromkeys(columns) if c in frame]]
    by = [c for c in RUN_ORDER if c in frame]
    if by and len(frame) > 1:
        frame = frame.sort_values(by, kind="stable")
    return frame.reset_index(drop=True)


def select_setting(frame: pd.DataFrame, setting: dict[str, Any]) -> pd.DataFrame:
    """The rows of one setting; a setting an engine does not have (a swept option of another engine,
    missing in its rows) matches missing values."""
    mask = np.ones(len(frame), dtype=bool)
    for column, value in setting.items():
        mask &= (frame[column].isna() if pd.isna(value) else frame[column] == value).to_numpy()
    return frame[mask]


def setting_ids(frame: pd.DataFrame, keys: list[str]) -> tuple[np.ndarray, pd.DataFrame]:
    """(per row, the number of its setting; per number, the setting's `keys`), settings numbered in
    sorted order. Worked out per cell, since a cell holds one setting: grouping a million rows by
    a dozen setting columns costs seconds, grouping a few hundred cells nothing."""
    cells = frame.drop_duplicates("cell_id")
    number = cells.groupby(keys, dropna=False, sort=True, observed=True).ngroup().to_numpy()
    per_row = number[pd.Index(cells["cell_id"]).get_indexer(frame["cell_id"])]
    settings = cells[keys].assign(_n=number).drop_duplicates("_n").sort_values("_n").drop(columns="_n")
    return per_row, settings.reset_index(drop=True)


def per_value(column: pd.Series, fn: Callable[[Any], Any], missing: Any = None) -> pd.Series:
    """`fn` of each row's value, computed once per distinct value (an object column; `missing` where
    the value is missing). A million runs of a few outputs cost a few calls, and equal results
    share one Python object instead of a million copies of a text."""
    codes, uniques = pd.factorize(column)
    values = np.empty(len(uniques) + 1, dtype=object)
    values[:-1] = [fn(u) for u in uniques]
    values[-1] = missing
    return pd.Series(values[codes], index=column.index, dtype=object, copy=False)


def pair_lookup(left: pd.Series, right: pd.Series, found: dict[tuple[Any, Any], Any]) -> np.ndarray:
    """found[(left, right)] per row as floats (NaN where absent or None): one lookup per distinct pair."""
    out = np.full(len(left), np.nan)
    if not found or not len(left):
        return out
    table = pd.Series([np.nan if v is None else float(v) for v in found.values()],
                      index=pd.MultiIndex.from_tuples(list(found)))
    wanted = pd.MultiIndex.from_arrays([left.astype(object).to_numpy(), right.astype(object).to_numpy()])
    return table.reindex(wanted).to_numpy(dtype=float)
