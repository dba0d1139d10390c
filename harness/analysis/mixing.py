"""What must agree between rows that are compared or pooled (model file, engine version, chat template,
machine, ...), and the refusal, naming the cell and the --allow-mixed that lifts it, when it does not."""

from __future__ import annotations

import json
from typing import Any, Iterable

import numpy as np
import pandas as pd

from harness.analysis.frames import per_value
from harness.core.errors import HarnessError, UsageError
from harness.results import provenance_fields

#: What must agree between a run and the run it is compared or pooled with: another model file,
#: engine version, row schema or chat template makes a difference that is not the axis's, and so
#: does another machine ('host': the node, its GPU's uuid, driver and CUDA version).
MIXABLE: tuple[str, ...] = provenance_fields.MIXABLE
#: the row columns that say which machine made a row; together they are the 'host' above
MACHINE_COLUMNS = provenance_fields.MACHINE
#: what a compared axis changes by its nature (a dtype export is another model file, another GPU
#: type is another machine, ...)
IMPLIED_BY_AXIS: dict[str, frozenset[str]] = {
    "model": frozenset({"model_sha256", "chat_template", "cpu_kernels"}),
    "dtype": frozenset({"model_sha256", "cpu_kernels"}),  # llama.cpp repacks some weight types, not others
    "engine": frozenset({"engine_version", "model_sha256", "chat_template", "cpu_kernels"}),
    "gpu": frozenset({"host", "cpu_kernels"}),
    # another interpreter: another build of the engine, its chat template and kernels
    "environment": frozenset({"engine_version", "chat_template", "cpu_kernels"}),
    "llamacpp.extra_bufts": frozenset({"cpu_kernels"}),
    "llama-server.extra_bufts": frozenset({"cpu_kernels"}),
}
#: the row columns the pairing rule reads
#: the row columns the pairing rule reads
PROVENANCE_COLUMNS = list(provenance_fields.PAIRED)


def chat_template_of(engine_info: pd.Series) -> pd.Series:
    """The chat template a row was made with (its hash where the engine gives one), from engine_info."""

    def one(text: Any) -> str:
        try:
            info = json.loads(text) if isinstance(text, str) and text else {}
        except ValueError:
            return ""
        return str(info.get("chat_template_sha256") or info.get("chat_template") or "")

    return per_value(engine_info, one, missing="")


def _machine_label(host: str, uuid: str, driver: str, cuda: str) -> str:
    extra = ", ".join(x for x in (uuid, driver and f"driver {driver}", cuda and f"CUDA {cuda}") if x)
    return f"{host} ({extra})" if uuid and extra else host


def machine_of(frame: pd.DataFrame) -> pd.Series:
    """Which machine made each row: 'host (GPU uuid, driver D, CUDA C)', from the columns present."""
    parts = pd.DataFrame({c: frame[c].astype(object).where(frame[c].notna(), "").astype(str) if c in frame else ""
                          for c in MACHINE_COLUMNS}, index=frame.index)
    machines = parts.drop_duplicates()
    labels = {tuple(m): _machine_label(*m) for m in machines.itertuples(index=False)}
    return pd.Series([labels[tuple(m)] for m in parts.itertuples(index=False)] if len(machines) > 1 else
                     [next(iter(labels.values()), "")] * len(parts), index=frame.index, dtype=object)


def _provenance(frame: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame(index=frame.index)
    for col in MIXABLE:
        if col == "chat_template":
            out[col] = chat_template_of(frame["engine_info"]) if "engine_info" in frame else ""
        elif col == "host":
            out[col] = machine_of(frame)
        elif col == "schema_version" and col in frame:
            out[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64").astype(str)
        else:
            out[col] = frame[col].astype(object).where(frame[col].notna(), "").astype(str) if col in frame else ""
    return out


def _cell_at(frame: pd.DataFrame, i: int) -> str:
    return str(frame["cell_id"].iloc[i]) if "cell_id" in frame else "?"


def refuse_mixed(
    left: pd.DataFrame, right: pd.DataFrame, allowed: Iterable[str], what: str,
    left_name: str = "run", right_name: str = "reference",
) -> None:
    """Raise when rows paired position by position differ in provenance that is not allowed to.

    `left` and `right` hold `cell_id` and the provenance columns (or engine_info), aligned.
    """
    allowed = set(allowed)
    a, b = _provenance(left), _provenance(right)
    for col in MIXABLE:
        if col in allowed:
            continue
        differ = (a[col].to_numpy() != b[col].to_numpy())
        if differ.any():
            i = int(np.flatnonzero(differ)[0])
            raise HarnessError(
                f"{what}: {col} differs between paired rows ({int(differ.sum())} pair(s)), e.g. "
                f"{left_name} cell {_cell_at(left, i)}: {a[col].iloc[i] or '(none)'} vs "
                f"{right_name} cell {_cell_at(right, i)}: {b[col].iloc[i] or '(none)'}; "
                f"a difference in {col} is not the compared axis's. Compare them only on purpose: --allow-mixed {col}"
            )


def parse_allow_mixed(items: Iterable[str]) -> frozenset[str]:
    """--allow-mixed values (repeatable, or comma-separated), each one of MIXABLE."""
    out = set()
    for item in items:
        for name in item.split(","):
            name = name.strip()
            if name not in MIXABLE:
                raise UsageError(f"--allow-mixed '{name}': allowed: {', '.join(MIXABLE)}")
            out.add(name)
    return frozenset(out)
