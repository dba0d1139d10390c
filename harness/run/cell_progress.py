"""A running cell's runs: those kept from checkpoints and stale cells, and new ones, checkpointed
as their batches finish so that a killed run resumes without losing or doubling a batch."""

from __future__ import annotations

import time
from typing import Any, Callable


class CellProgress:
    """The runs of one cell so far: those kept by earlier checkpoints, and new ones, checkpointed
    at most every `every_s` seconds as their batches finish (0: after every batch).

    Kept rows count only when they were made by this load (harness.run.reuse.SAME_LOAD: the same
    engine build and model file, harness, libraries and machine) and ended ok or refused; failed
    ones run again. Runs of stale cells (harness.run.reuse) may be kept too. Kept rows keep the
    "what ran" they were made with; only this load's rows are stamped with this load's (`what_ran`,
    asked when a checkpoint is written, and `stamp` when the cell ends).
    """

    def __init__(self, folder: Any, cell_id: str, parts: str, every_s: float, engine_cols: dict[str, Any],
                 machine: dict[str, Any] | None = None,
                 what_ran: Callable[[], dict[str, Any]] | None = None) -> None:
        """`parts`: what this load's checkpoint files are named after (unique to the run and boot)."""
        from harness.results.schema import DONE_STATUSES
        from harness.run.reuse import load_identity, same_load

        self.folder, self.cell_id, self.parts, self.every_s = folder, cell_id, parts, every_s
        self.here = load_identity(engine_cols, machine or {})
        self.kept = {(r["prompt_id"], r["repeat"]): r for r in folder.checkpointed(cell_id)
                     if r["status"] in DONE_STATUSES and same_load(r, self.here)}
        self.new: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []
        self._parts = 0
        self._last = time.monotonic()
        self._what_ran = what_ran or dict
        #: the order rows land in (prompt, repeat); None: as they came
        self.order: Callable[[dict[str, Any]], Any] | None = None

    def has(self, prompt_id: str, repeat: int) -> bool:
        return (prompt_id, repeat) in self.kept

    def keep(self, rows: dict[tuple[str, int], dict[str, Any]]) -> int:
        """Keep runs found elsewhere (stale cells) for those not kept yet; how many were taken."""
        new = {run: row for run, row in rows.items() if run not in self.kept}
        self.kept |= new
        return len(new)

    def replace(self, rows: list[dict[str, Any]]) -> None:
        """The whole cell is these rows (it could not start: refused, or its context failed)."""
        self.kept, self.new, self._pending = {}, list(rows), []

    def add(self, rows: list[dict[str, Any]], more: bool) -> None:
        """Rows of a finished batch; checkpointed when the interval has passed and batches remain
        (after the last one, the whole cell lands instead)."""
        self.new += rows
        self._pending += rows
        if more and time.monotonic() - self._last >= self.every_s:
            self.flush()

    def stamp(self, columns: dict[str, Any]) -> None:
        """Set columns on this load's rows only (what ran, a failure found after the cell)."""
        self.new = [r | columns for r in self.new]
        self._pending = [r | columns for r in self._pending]

    def flush(self) -> None:
        from harness.results.schema import DONE_STATUSES

        keep = [r for r in self._pending if r["status"] in DONE_STATUSES]
        if keep:
            ran = self._what_ran()  # a checkpointed run, kept by a later load, says what it ran on
            self.folder.checkpoint(self.cell_id, f"{self.parts}-{self._parts:05d}.parquet", [r | ran for r in keep])
            self._parts += 1
        self._pending = []
        self._last = time.monotonic()

    def rows(self) -> list[dict[str, Any]]:
        """Every run of the cell, in run order. A cell with failed runs first checkpoints its good
        new ones, so that the rerun redoes only what failed."""
        if any(r["status"] == "failed" for r in self.new):
            self.flush()
        every = [*self.kept.values(), *self.new]
        return every if self.order is None else sorted(every, key=self.order)
