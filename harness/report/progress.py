"""Progress of a run, counting generations: a rich bar on a terminal, plain lines in a log.

A CI log or `| tee` gets lines, not a redrawn bar: one per finished cell and one at least every
`every_s` seconds while a cell runs, each under 80 columns and free of control characters, so a
long group never reads as a hang (and a job killed for silence does not lose its work).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from harness.report.plain import shown

MODES = ("auto", "rich", "plain", "none")


class RichReporter:
    """Runner reporter that draws a progress bar; log lines print above it."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]generations"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = None

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, total: int, cells: int = 0) -> None:
        self.task = self.progress.add_task("run", total=total)

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def cell_done(self, cell_id: str, status: str) -> None: ...

    def log(self, message: str) -> None:
        self.progress.console.print(Text(shown(message), style="dim"))  # engine and error text, never markup

    def stop(self) -> None:
        self.progress.stop()


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


class PlainReporter:
    """Runner reporter for logs: plain progress lines, at least one every `every_s` seconds."""

    def __init__(self, console: Console, every_s: float = 30.0, show_progress: bool = True) -> None:
        self.console, self.every_s, self.show_progress = console, every_s, show_progress
        self.total = self.done = self.cells = self.cells_done = 0
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self) -> PlainReporter:
        if self.show_progress:
            self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopped.set()

    def _print(self, line: str) -> None:
        with self._lock:
            self.console.print(Text(shown(line)), soft_wrap=True, highlight=False)
            self.last = time.monotonic()

    def _clocks(self) -> tuple[str, str]:
        elapsed = time.monotonic() - self.started
        eta = _clock(elapsed * (self.total - self.done) / self.done) if self.done else "?"
        return _clock(elapsed), eta

    def line(self) -> str:
        """Where the run is: generations and cells done of all, elapsed, ETA (under 80 columns)."""
        elapsed, eta = self._clocks()
        cells = f", {self.cells_done}/{self.cells} cells" if self.cells else ""
        return f"progress: {self.done}/{self.total} generations{cells}, {elapsed} elapsed, eta {eta}"

    def cell_line(self, cell_id: str, status: str) -> str:
        """A finished cell and where the run is, in fewer words, so that it stays under 80 columns at
        the sizes runs have (a 12-character id, 'unsupported', 24 cells, 1,200 generations: 76)."""
        elapsed, eta = self._clocks()
        cells = f" {self.cells_done}/{self.cells} cells," if self.cells else ""
        return f"cell {cell_id} {status};{cells} {self.done}/{self.total} gen., {elapsed}, eta {eta}"

    def _heartbeat(self) -> None:
        while not self._stopped.wait(min(1.0, self.every_s / 4)):
            if time.monotonic() - self.last >= self.every_s:
                self._print(self.line())

    def start(self, total: int, cells: int = 0) -> None:
        self.total, self.cells = total, cells
        self.started = time.monotonic()
        if self.show_progress:
            self._print(self.line())

    def advance(self, n: int) -> None:
        self.done += n

    def cell_done(self, cell_id: str, status: str) -> None:
        self.cells_done += 1
        if self.show_progress:
            self._print(self.cell_line(cell_id, status))

    def log(self, message: str) -> None:
        self._print(message)


def reporter_for(mode: str, console: Console) -> RichReporter | PlainReporter:
    """`--progress`: auto (a bar on a terminal, lines elsewhere), rich, plain, or none (messages only)."""
    if mode == "rich" or (mode == "auto" and console.is_terminal):
        return RichReporter(console)
    return PlainReporter(console, show_progress=mode != "none")
