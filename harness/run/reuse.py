"""Runs kept across edits of an experiment: a run is known by what made it, not by the cell it landed in.

A cell's id hashes the whole experiment, so adding a prompt, editing one prompt or filler, adding
repeats or changing an answer's parse rule gives every cell a new id, and the old cell goes stale.
One run (one target generation) depends on less: the cell's settings apart from its prompt set and
repeat count (`Cell.settings_id`), and the batch it ran in: the target's id and position, its
repeat, and the text of every member. That is its `run_key`, stored in its row.

When a cell runs, ok rows of the folder's stale cells that carry the run key it wants, made by the
same load (`SAME_LOAD`: the engine's build and model file, the schema, the harness and library
versions, the engine variables, on the same machine, driver and CUDA), are kept instead of generated
again: a cell never pairs runs of two machines or two builds. A kept row keeps what it was made
with, "what ran" (device, backend, offload) included. Their answers are read again from the
stored text under the current rules, and the cell lands as one new, complete file. Rows written
before run keys existed (schema 6 and older) are never reused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.experiment.matrix import digest
from harness.experiment.prompts import Batch, Prompt
from harness.results import provenance_fields

if TYPE_CHECKING:
    from harness.results.folder import ResultsFolder

#: what a kept row (a checkpoint's, or a stale cell's) must share with the load about to run
SAME_LOAD = provenance_fields.SAME_LOAD
#: the answer columns, read again from a kept row's text under the current prompt's rule
ANSWER_COLUMNS = ("answer_parsed", "answer_expected", "answer_correct")


def run_key(settings_id: str, batch: Batch, position: int, repeat: int) -> str:
    """What one run's output depends on beyond its engine load: the cell's settings, the batch's
    members in order, which of them is measured, and the repeat (seeded draws use it)."""
    return digest({"settings": settings_id, "repeat": repeat, "position": position,
                   "target": batch.prompts[position].id, "members": [p.text for p in batch.prompts]}, 20)


def load_identity(engine_cols: dict[str, Any], prov: dict[str, Any]) -> dict[str, Any]:
    """The SAME_LOAD values of the load about to run: its engine columns, the run's provenance
    (as this worker has it) and the schema its rows are written in."""
    from harness.results.schema import SCHEMA_VERSION

    here = engine_cols | prov | {"schema_version": SCHEMA_VERSION}
    return {k: here.get(k) for k in SAME_LOAD}


def same_load(row: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether a kept row was made by the load `here` (load_identity) describes."""
    return all(row.get(k) == here.get(k) for k in SAME_LOAD)


class ReusableRuns:
    """The ok runs of a folder's stale cells, found by run key. Reading only the key and status
    columns of the stale cells, once per engine load; a folder without stale cells costs nothing."""

    def __init__(self, folder: ResultsFolder) -> None:
        from harness.results.store_reading import readable

        self.folder = folder
        self._where: dict[str, list[str]] = {}
        for path in folder.store.cell_files(folder.stale_ids()):
            try:
                handle = readable(path)
            except Exception:  # noqa: BLE001 - a damaged stale file is simply not reused
                continue
            if "run_key" not in handle.schema_arrow.names:
                continue
            table = handle.read(columns=["run_key", "status"])
            for key, status in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
                if key and status == "ok":
                    self._where.setdefault(key, []).append(path.stem)

    def take(self, wanted: dict[tuple[str, int], str], here: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
        """Rows for the wanted runs ((prompt id, repeat) -> run key) that stale cells hold, made as `here` says."""
        by_key = {key: run for run, key in wanted.items()}
        cells = dict.fromkeys(c for key in by_key for c in self._where.get(key, ()))
        found: dict[tuple[str, int], dict[str, Any]] = {}
        for cell_id in cells:
            for row in self.folder.store.read_cell_rows(cell_id):
                run = by_key.get(row.get("run_key") or "")
                if run is not None and run not in found and row["status"] == "ok" and same_load(row, here):
                    found[run] = row
        return found


def restamped(row: dict[str, Any], cell_id: str, experiment: str, prompt: Prompt) -> dict[str, Any]:
    """A kept run as a row of the cell now running: its cell and experiment, and its answer read again
    from its text under the prompt's current rule. Its run id, timing and provenance stay its own."""
    from harness.experiment import answers

    out = dict(row) | {"cell_id": cell_id, "experiment": experiment} | dict.fromkeys(ANSWER_COLUMNS)
    return out | answers.columns(row.get("text"), prompt.answer, prompt.parse)
