"""The row's column groups that later stages read by name, declared once beside the schema: the
setting columns that make runs comparable, and the logit-probe columns."""

from __future__ import annotations

from typing import Iterable

import pandas as pd

from harness.experiment.axes import AXES
from harness.experiment.schema import option_axis
from harness.results.schema import ROW_SCHEMA

#: Columns that identify comparable settings (a cell, minus the ids).
KEY_COLUMNS: tuple[str, ...] = AXES + ("max_tokens",)

#: The logit probes' columns (probe_logits: true), in the schema's order.
PROBE_COLUMNS: tuple[str, ...] = tuple(name for name in ROW_SCHEMA.names if name.startswith("probe_"))


def option_columns(frame: pd.DataFrame) -> list[str]:
    """The swept engine-option columns of a frame ('llamacpp.flash_attn', ...), in order."""
    return [c for c in frame.columns if option_axis(c) is not None]


def keys_of(frame: pd.DataFrame, drop: Iterable[str] = ()) -> list[str]:
    """The setting columns that make runs comparable: the fixed axes, max_tokens and swept options."""
    drop = set(drop)
    return [c for c in list(KEY_COLUMNS) + option_columns(frame) if c not in drop]
