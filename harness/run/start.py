"""A run's start-up, overlapped with the reading of its experiment: one object with a small surface.

`harness run` spends its first second importing and reading; the engine's worker needs as long to
start. RunStart starts a spare worker first thing (harness.run.spare), sends it the first engine load
as soon as the cells are known (harness.run.ahead), and imports what the summary after the run needs
once the worker runs (not before: an import holds the interpreter the parent reads with). The CLI
makes one at its entry (`for_argv`) and hands it to `run`; a run made any other way makes its own.
Like the spare, this module imports only the standard library.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Any, Iterable

from harness.run.spare import SpareWorker


class RunStart:
    """The spare worker of one `harness run`, the load sent to it ahead, the imports after launch."""

    def __init__(self) -> None:
        self.spare = SpareWorker()

    @classmethod
    def for_argv(cls, args: list[str]) -> RunStart | None:
        """A start for a command line that runs an experiment (`harness run ...`); None for any other."""
        return cls() if args[:1] == ["run"] else None

    def send_ahead(self, loaded: Any, chosen: list[Any], out: Path) -> None:
        """Have the spare load the run's first engine now, while this process reads on; nothing where
        that load cannot be known yet or the spare cannot serve it (harness.run.ahead.first_load)."""
        from harness.run.ahead import first_load

        ahead = first_load(loaded, chosen, out)
        if ahead is not None:
            self.spare.ahead(ahead, ahead.key)

    def import_once_launched(self, modules: Iterable[str]) -> None:
        """Import `modules` in a thread once a load has taken the spare (the parent then only waits)."""
        wanted = tuple(modules)

        def when_launched() -> None:
            self.spare.taken.wait()
            for module in wanted:
                importlib.import_module(module)

        threading.Thread(target=when_launched, daemon=True).start()

    def release(self) -> None:
        """End the spare if no load took it (`run --help`, a bad option, an error before any launch)."""
        self.spare.release()

    def __enter__(self) -> RunStart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
