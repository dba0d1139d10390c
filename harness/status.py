"""What is on disk for each cell of a results folder's experiment: done, failed, unsupported, skipped or missing."""

from __future__ import annotations

from dataclasses import dataclass

from harness.matrix import Cell
from harness.store import DONE_STATUSES, Store


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
