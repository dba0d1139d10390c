"""A rich progress bar with ETA, counting generations."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from harness.report.plain import shown


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

    def start(self, total: int) -> None:
        self.task = self.progress.add_task("run", total=total)

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def log(self, message: str) -> None:
        self.progress.console.print(Text(shown(message), style="dim"))  # engine and error text, never markup
