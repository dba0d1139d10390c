"""Which settings vary: the one definition behind `plan`'s columns, `status`'s table, the summary's,
the report's filters, the charts' series and the gate's labels.

A setting varies when it takes more than one value among the records, values compared as text (so
1 and 1.0 in one float column are one value, and a missing value is a value of its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    import pandas as pd


def varying(records: pd.DataFrame | Iterable[Mapping[str, Any]], columns: Iterable[str]) -> list[str]:
    """The names among `columns`, in their order, whose values differ between `records` (a DataFrame,
    or cells / dicts); a column a frame lacks does not vary."""
    if hasattr(records, "columns"):  # a DataFrame
        frame = records
        return [c for c in columns if c in frame and frame[c].astype(str).nunique(dropna=False) > 1]
    items = list(records)
    return [c for c in columns if len({str(r[c]) for r in items}) > 1]
