"""A campaign's statistics part by part (harness.analysis.partitions), in worker processes, joined
into the tables a whole-folder Analysis gives, value for value.

Each part is analysed by the same code as a small folder (an Analysis of its cells), so there is
one definition of every statistic; what this module adds is the cutting and the joining. A table
whose records are per setting (or finer) is the parts' records in setting order: every table but
`flips` is sorted by its setting columns first, and a setting lies in one part, so a stable sort of
the joined records on those columns restores the whole-folder order. `flips` lists departed runs
in the folder's row order: cell files in sorted order, rows as stored.

Memory: a worker holds one part at a time (partitions.PART_ROWS rows); the parent holds only the
tables and the per-run chart records a report needs (_start_method says how workers start).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from harness.analysis import partitions
from harness.analysis.folder_analysis import Analysis, notes_of
from harness.core.errors import HarnessError
from harness.results.columns import keys_of

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

#: the tables one pass over the parts computes (everything `summarize`, `check` and `--save` show);
#: latency reads every run's inter-token gaps and has a pass of its own, when asked
STATISTICS = ("summary", "by_setting", "slowdown", "probes", "answers", "survival", "near_ties", "flips_by_margin",
              "flips", "seen")
#: worker processes at most: each holds a part, so memory grows with them
MOST_WORKERS = 4
#: how often a read part by part looks at its workers between parts' ends (seconds)
WATCH_S = 0.5
#: the memory a read part by part may take, the command and its workers together: a campaign's goal
#: on a login node, whatever its CPU count (docs/measured.md, "Ten million rows on a login node")
MEMORY_BUDGET = 4 << 30
#: a worker's memory: its part's rows at the report's pass (the heavier one: 500,000-row parts took about
#: 1.1 GB a worker, i.e. about 2.2 KB a row), plus the interpreter and imports
WORKER_BYTES_PER_ROW = 2_200
WORKER_BASE_BYTES = 150 << 20
#: the command itself while its workers read: the cell heads, the joined tables, the report's payload
PARENT_BYTES = 800 << 20


def _part_tables(analysis: Analysis, names: tuple[str, ...]) -> dict[str, Any]:
    """The named attributes of one part's Analysis (run in a worker)."""
    return {name: getattr(analysis, name) for name in names}


def _with_statistics(analysis: Analysis, fn: Callable[[Analysis], T]) -> tuple[T, dict[str, Any]]:
    """`fn` of one part's Analysis, then its STATISTICS from the same rows (run in a worker)."""
    return fn(analysis), _part_tables(analysis, STATISTICS)


def _statistics_of(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The folder's tables from its parts' STATISTICS; the notes from their distinct values."""
    tables = {name: _joined([f[name] for f in found], name) for name in STATISTICS if name != "seen"}
    seen = tuple(list(dict.fromkeys(v for f in found for v in f["seen"][i])) for i in (0, 1))
    return tables | {"notes": notes_of(*seen)}


def _joined(frames: list[pd.DataFrame], name: str) -> pd.DataFrame:
    """One table from the parts' pieces, in the whole-folder order (see the module's docstring)."""
    import pandas as pd

    present = [f for f in frames if not f.empty]
    if not present:
        return frames[0]
    if len(present) == 1:
        return present[0]
    table = pd.concat(present, ignore_index=True)
    order = ["cell_id"] if name == "flips" else [k for k in keys_of(table) if k in table]
    return table.sort_values(order, kind="stable", na_position="last").reset_index(drop=True) if order else table


class PartitionedAnalysis(Analysis):
    """An Analysis whose tables are computed part by part in `workers` processes; the per-run frames
    (`rows`, `compared`, `report_rows`, `paired`) are still the whole folder's, read when asked."""

    def __init__(self, analysis: Analysis, parts: list[list[str]], workers: int) -> None:
        super().__init__(analysis.results, analysis.reference, analysis.allow_mixed, analysis.reference_run,
                         analysis.near_tie, analysis.confident)
        self.parts = parts
        self.workers = workers

    def per_part(self, fn: Callable[[Analysis], T], with_statistics: bool = True) -> list[T]:
        """`fn` (a module-level function: it travels to the workers by name) of each part's Analysis, in
        part order. The first pass `with_statistics` computes them too, from the rows `fn` read: a
        report reads the folder once."""
        if "_statistics" in self.__dict__ or not with_statistics:
            return self._map(fn)
        found = self._map(partial(_with_statistics, fn=fn))
        self.__dict__["_statistics"] = _statistics_of([tables for _, tables in found])
        return [value for value, _ in found]

    def _map(self, fn: Callable[[Analysis], T]) -> list[T]:
        """`fn` of each part's Analysis, in part order; one part's rows in memory per worker at a time."""
        def piece(cells: list[str]) -> Analysis:
            return Analysis(replace(self.results, cell_ids=cells), self.reference, self.allow_mixed,
                            self.reference_run, self.near_tie, self.confident)

        if self.workers < 2:  # one CPU: no process to start; each part's rows are dropped before the next
            return [fn(piece(cells)) for cells in self.parts]
        pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=_start_method())
        futures = {pool.submit(fn, piece(cells)): i for i, cells in enumerate(self.parts)}
        found: dict[int, T] = {}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=WATCH_S, return_when=FIRST_COMPLETED)
                for future in done:
                    found[futures[future]] = future.result()
                _raise_on_a_dead_worker(pool, pending)
        except BrokenProcessPool as broken:
            _stop(pool)
            raise HarnessError(self._died(broken)) from None
        except BaseException:
            _stop(pool)  # a part's error ends the command now, not after every other part
            raise
        pool.shutdown()
        return [found[i] for i in range(len(self.parts))]

    def _died(self, broken: BaseException) -> str:
        """What to say when a worker process died under a part (the kernel's out-of-memory killer, most often)."""
        largest = max(len(cells) for cells in self.parts)
        return (f"{self.results.root}: a worker process reading this folder part by part died ({broken}); "
                f"{self.workers} workers read {len(self.parts)} parts of up to {largest} cells each. A worker "
                "ended by the system is most often out of memory: free memory, or read on a machine with more "
                "(each worker holds one part of about partitions.PART_ROWS rows)")

    @cached_property
    def _statistics(self) -> dict[str, Any]:
        return _statistics_of(self._map(partial(_part_tables, names=STATISTICS)))

    summary = cached_property(lambda self: self._statistics["summary"])
    by_setting = cached_property(lambda self: self._statistics["by_setting"])
    slowdown = cached_property(lambda self: self._statistics["slowdown"])
    probes = cached_property(lambda self: self._statistics["probes"])
    answers = cached_property(lambda self: self._statistics["answers"])
    survival = cached_property(lambda self: self._statistics["survival"])
    flips = cached_property(lambda self: self._statistics["flips"])
    notes = cached_property(lambda self: self._statistics["notes"])

    @property
    def near_ties(self) -> pd.DataFrame:
        return self._statistics["near_ties"]

    @property
    def flips_by_margin(self) -> pd.DataFrame:
        return self._statistics["flips_by_margin"]

    @cached_property
    def latency(self) -> pd.DataFrame:
        return _joined([tables["latency"] for tables in self._map(partial(_part_tables, names=("latency",)))],
                       "latency")


def _raise_on_a_dead_worker(pool: ProcessPoolExecutor, pending: set[Any]) -> None:
    """BrokenProcessPool where a worker has ended while parts are still to come. The executor notices a
    death itself only among the workers it was watching when it last waited; a worker it started later
    (spawned workers start one per submit) can die unseen until another part ends, i.e. the read would
    wait out every other part first."""
    if not pending:
        return
    for worker in list((getattr(pool, "_processes", None) or {}).values()):
        code = worker.exitcode
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise BrokenProcessPool(f"worker process {worker.pid} ended ({how})")


def _stop(pool: ProcessPoolExecutor) -> None:
    """End a pool now: parts not started are cancelled and running workers terminated (the executor
    itself would wait for them)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # the executor's own map of its workers
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()


def _start_method() -> Any:
    """How workers start: forked (in milliseconds, with the imports done) on Linux where this process
    runs no other thread, so no lock can be held at the fork (the parent has read no rows yet; Arrow
    resets its own thread pools in a forked child); started fresh (spawn: a second or two of imports)
    otherwise, e.g. after `run`, whose progress display has threads."""
    method = "fork" if sys.platform == "linux" and threading.active_count() == 1 else "spawn"
    return multiprocessing.get_context(method)


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def workers_here(part_rows: int = partitions.PART_ROWS, cpus: int | None = None,
                 available: int | None = None) -> int:
    """The worker processes this machine gives a campaign: its CPUs (as this process may use them), at
    most MOST_WORKERS, and no more than fit MEMORY_BUDGET (or the memory available now, if less) with
    parts of `part_rows` rows: on a 16-core login node the report's parts take 2 workers, not 4."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if available is None:
        available = _available_bytes()
    memory = min(MEMORY_BUDGET, available) if available else MEMORY_BUDGET
    fit = (memory - PARENT_BYTES) // (part_rows * WORKER_BYTES_PER_ROW + WORKER_BASE_BYTES)
    return max(1, min(MOST_WORKERS, cpus, fit))


def streamed(analysis: Analysis, budget: int | None = None, workers: int | None = None) -> Analysis:
    """`analysis` as it is where its folder fits one part of `budget` rows (partitions.PART_ROWS);
    else its tables part by part."""
    rows = budget or partitions.PART_ROWS
    parts = partitions.plan(analysis.results, analysis.reference, rows)
    if len(parts) < 2:
        return analysis
    return PartitionedAnalysis(analysis, parts, min(len(parts), workers or workers_here(rows)))
