"""What is on disk for each cell of an experiment: done, failed, unsupported, skipped or missing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.config import LoadedExperiment, load_experiment
from harness.errors import HarnessError
from harness.matrix import Cell, expand
from harness.store import Store

SOURCE_META = "source.json"


def remember_source(store: Store, experiment: Path) -> None:
    """Record which experiment file fills this folder, so status/check can find it later."""
    store.write_meta(SOURCE_META, json.dumps({"experiment": str(Path(experiment).resolve())}))


def experiment_for(results: Path, override: Path | None = None) -> LoadedExperiment:
    if override is not None:
        return load_experiment(override)
    meta = Store(results).read_meta(SOURCE_META)
    if meta is None:
        raise HarnessError(f"{results}: no {SOURCE_META}; give the experiment with --experiment FILE")
    return load_experiment(meta["experiment"])


@dataclass(frozen=True)
class CellState:
    cell: Cell
    state: str  # done, failed, unsupported, skipped, mixed, missing
    error: str


def cell_states(loaded: LoadedExperiment, store: Store) -> list[CellState]:
    out = []
    for cell in expand(loaded):
        statuses = store.statuses(cell.id)
        if not statuses:
            out.append(CellState(cell, "missing", ""))
            continue
        kinds = set(statuses)
        if kinds == {"ok"}:
            state = "done"
        elif len(kinds) == 1:
            state = statuses[0]
        else:
            state = "failed" if "failed" in kinds else "mixed"
        error = ""
        if state != "done":
            rows = store.read_cell(cell.id, ["status", "error"])
            bad = rows[rows["status"] != "ok"]
            error = str(bad["error"].iloc[0]) if len(bad) else ""
        out.append(CellState(cell, state, error))
    return out
