"""What is on disk for each cell of a results folder's experiment: done, failed, unsupported, skipped or missing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.core.errors import HarnessError
from harness.experiment.matrix import Cell
from harness.results.folder import ResultsFolder
from harness.results.rows import auto_fallbacks
from harness.results.schema import DONE_STATUSES
from harness.results.store import Store


@dataclass(frozen=True)
class CellState:
    cell: Cell
    state: str  # done, unsupported, failed, skipped, mixed, missing
    error: str

    @property
    def done(self) -> bool:
        """A rerun leaves it alone (ok or refused by the engine's rules)."""
        return self.state in ("done", "unsupported", "mixed")


def cell_states(cells: list[Cell], store: Store) -> list[CellState]:
    out = []
    for cell in cells:
        statuses = store.statuses(cell.id)
        if not statuses:
            out.append(CellState(cell, "missing", ""))
            continue
        kinds = set(statuses)
        if kinds == {"ok"}:
            state = "done"
        elif len(kinds) == 1:
            state = statuses[0]
        elif "failed" in kinds:
            state = "failed"
        else:
            state = "mixed" if kinds <= DONE_STATUSES else "skipped"
        error = ""
        if state != "done":
            rows = store.read_cell(cell.id, ["status", "error"])
            bad = rows[rows["status"] != "ok"]
            error = str(bad["error"].iloc[0]) if len(bad) else ""
        out.append(CellState(cell, state, error))
    return out


@dataclass(frozen=True)
class FolderStatus:
    """A folder judged against an experiment's cells: each cell's state, the stale files beside them
    and the checkpointed runs of unfinished cells (what `harness status` shows)."""

    cells: list[Cell]
    states: list[CellState]
    stale: list[str]
    partial: dict[str, int]
    #: what the loads chose by themselves, as the rows say (harness.results.rows.auto_fallbacks)
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.states:
            counts[s.state] = counts.get(s.state, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def pending(self) -> list[CellState]:
        return [s for s in self.states if s.state != "done"]

    @property
    def resumable(self) -> list[CellState]:
        """Unfinished cells that a rerun resumes from their checkpoints."""
        return [s for s in self.pending if s.cell.id in self.partial]

    def ids(self, wanted: set[str]) -> list[str]:
        """The ids of the cells in these states ('stale' names the stale files)."""
        return [s.cell.id for s in self.states if s.state in wanted] + (self.stale if "stale" in wanted else [])

    def record(self, folder: str) -> dict[str, Any]:
        """Every cell with its state, settings, error and checkpointed runs, for scripts."""
        return {"folder": folder, "cells": len(self.states), "counts": self.counts, "stale": self.stale,
                "states": [{"cell_id": s.cell.id, "state": s.state, "settings": s.cell.as_dict, "error": s.error,
                            "checkpointed_runs": self.partial.get(s.cell.id, 0)} for s in self.states]}


def folder_status(folder: ResultsFolder, cells: list[Cell] | None = None) -> FolderStatus:
    """The folder against `cells` (default: its own current experiment's); a folder without a
    manifest needs `cells`."""
    if cells is None:
        if not folder.has_manifest():
            raise HarnessError(f"{folder.root}: no results manifest here; give the experiment with --experiment FILE")
        cells = folder.current_cells()
    current = {c.id for c in cells}
    stale = folder.stale_ids(current)
    partial = folder.partial() if folder.has_manifest() else {}
    states = cell_states(cells, folder.store)
    info: list[str] = []
    for s in states:
        if s.state != "missing":
            try:
                info += list(folder.store.read_cell(s.cell.id, ["engine_info"])["engine_info"].astype(str).unique())
            except HarnessError:  # a damaged file: its state says so already
                pass
    return FolderStatus(cells, states, stale, partial, auto_fallbacks(info))
