"""What `harness status` shows: counts per state, the unfinished cells with the settings that tell
them apart, how to rerun them, and the stale files."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from harness.experiment.axes import shown_name
from harness.experiment.varying import varying
from harness.report.plain import PlainTable
from harness.results.status import FolderStatus

#: the error column's width; longer causes are also printed whole below the table
SHORT = 60


def _short(error: str) -> str:
    first = error.strip().splitlines()[0] if error.strip() else ""
    return first if len(first) <= SHORT else first[: SHORT - 3] + "..."


def status_view(status: FolderStatus, folder: str) -> list[Any]:
    """The status's renderables, in print order."""
    counts = ", ".join(f"{v} {k}" for k, v in status.counts.items())
    stale = status.stale
    out: list[Any] = [Text(f"{folder}: {len(status.states)} cells: {counts}"
                           + (f"; {len(stale)} stale cell file(s)" if stale else ""))]
    out += status.notes
    pending, resumable, partial = status.pending, status.resumable, status.partial
    if resumable:
        out.append(f"{len(resumable)} unfinished cell(s) hold checkpoints "
                   f"({sum(partial[s.cell.id] for s in resumable)} run(s) kept); a rerun resumes inside them")
    if pending:
        # the settings that tell the experiment's cells apart (every axis and swept option that varies)
        settings = list(status.cells[0].as_dict)
        shown = varying([c.as_dict for c in status.cells], settings) or ["engine"]
        table = PlainTable(title="cells not done")
        for col in ("cell", "state", *map(shown_name, shown), "checkpointed", "error"):
            table.add_column(col)
        for s in pending:
            c = s.cell
            table.add_row(c.id, s.state, *[str(c[a]) for a in shown], str(partial.get(c.id, "")), _short(s.error))
        out.append(table)
        # a table cuts its cells at the screen's width: each cause in full, on lines of its own
        causes = [(s.cell.id, s.error.strip().splitlines()[0]) for s in pending if s.error.strip()]
        if any(len(cause) > SHORT for _, cause in causes):
            out += ["why:"] + [Text(f"  {cell}: {cause}") for cell, cause in causes]
        if any(not s.done for s in pending):
            out.append(Text(f"rerun: harness run {folder}   (or resubmit: harness submit FILE --scheduler ... "
                            f"--cells $(harness status {folder} --ids missing,failed,skipped))"))
    if stale:
        out.append(f"stale (not in the current experiment; left out unless --all-cells): {', '.join(stale[:20])}"
                   + (f" and {len(stale) - 20} more" if len(stale) > 20 else ""))
    return out
