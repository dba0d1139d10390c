"""A campaign's statistics part by part (harness.analysis.partitions), in worker processes, joined
into the tables a whole-folder Analysis gives, value for value.

Each part is analysed by the same code as a small folder (an Analysis of its cells and prompts), up
to the pieces every table is computed from (PIECES: per-prompt and per-run frames, and counts that
add up). The parent joins the parts' pieces and computes every table from them by the Analysis's
own code, as a whole read does from its own pieces: one definition of every statistic, and a
setting whose prompts lie in several parts gets the figures of one read. Pieces of runs are joined
in run order (frames.in_run_order), per-prompt ones in setting and prompt order, as the whole read
orders its own; counts are whole numbers, whose sums do not depend on the order of adding.

Memory: a worker holds one part at a time (partitions.PART_ROWS rows); the parent holds the pieces
(per cell and prompt, per departed run, and the runs of the few tables that keep them: probes, answer
prompts, batch-invariant pairs) and the per-run chart records a report needs (_start_method says how
workers start).
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
from harness.analysis.folder_analysis import Analysis
from harness.core.errors import HarnessError
from harness.results.store_reading import RunSlice

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")

#: the pieces one pass over the parts computes (everything `summarize`, `check` and `--save` show is
#: computed from them); latency reads every run's inter-token gaps and has a pass of its own, when asked
PIECES = ("setting_keys", "_summary_cells", "_summary_runs", "_summary_ok", "flips", "_survival_counts", "_tie_sums",
          "_floor_counts", "_probe_rows", "_answer_rows", "_slowdown_rows", "seen")
#: how the parts' pieces join: by run (frames.in_run_order), sorted by setting then these columns, or
#: concatenated as they come (counts, added up where the tables are computed)
BY_RUN = ("flips", "_probe_rows", "_answer_rows", "_slowdown_rows", "_latency_rows")
BY_SETTING_THEN = {"_summary_cells": ["cell_id", "prompt_id"]}
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


def _with_pieces(analysis: Analysis, fn: Callable[[Analysis], T]) -> tuple[T, dict[str, Any]]:
    """`fn` of one part's Analysis, then its PIECES from the same rows (run in a worker)."""
    return fn(analysis), _part_tables(analysis, PIECES)


def _pieces_of(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The folder's pieces from its parts' (see the module's docstring)."""
    keys = found[0]["setting_keys"]
    out: dict[str, Any] = {"setting_keys": keys}
    for name in found[0]:
        if name == "seen":
            out[name] = tuple(list(dict.fromkeys(v for f in found for v in f[name][i])) for i in (0, 1))
        elif name != "setting_keys":
            out[name] = _joined([f[name] for f in found], name, keys)
    return out


def _joined(frames: list[pd.DataFrame], name: str, keys: list[str]) -> pd.DataFrame:
    """One piece from the parts' pieces, in the order a whole read gives it (see the module's docstring)."""
    import pandas as pd

    from harness.analysis.frames import in_run_order

    present = [f for f in frames if not f.empty]
    if len(present) < 2:
        return (present or frames)[0]
    table = pd.concat(present, ignore_index=True)
    if name in BY_RUN:
        return in_run_order(table)
    if name == "_floor_counts":  # a prompt cut by its runs has records in each of its parts: added up
        from harness.analysis.guarantees import joined_floor_counts

        return joined_floor_counts(table, [k for k in keys if k in table])
    if name in BY_SETTING_THEN:
        order = [k for k in keys if k in table] + BY_SETTING_THEN[name]
        return table.sort_values(order, kind="stable", na_position="last").reset_index(drop=True)
    return table


class PartitionedAnalysis(Analysis):
    """An Analysis whose tables are computed from pieces computed part by part in `workers` processes;
    the per-run frames (`rows`, `compared`, `report_rows`, `paired`) are still the whole folder's,
    read when asked."""

    def __init__(self, analysis: Analysis, parts: list[partitions.Part], workers: int) -> None:
        super().__init__(analysis.results, analysis.reference, analysis.allow_mixed, analysis.reference_run,
                         analysis.near_tie, analysis.confident)
        self.parts = parts
        self.workers = workers

    def per_part(self, fn: Callable[[Analysis], T], with_statistics: bool = True) -> list[T]:
        """`fn` (a module-level function: it travels to the workers by name) of each part's Analysis, in
        part order; fn's records must join by prompt, since a cut unit's cells lie in several parts. The
        first pass `with_statistics` computes the pieces too, from the rows `fn` read: a report reads the
        folder once."""
        if "_pieces" in self.__dict__ or not with_statistics:
            return self._map(fn)
        found = self._map(partial(_with_pieces, fn=fn))
        self.__dict__["_pieces"] = _pieces_of([tables for _, tables in found])
        return [value for value, _ in found]

    def _map(self, fn: Callable[[Analysis], T]) -> list[T]:
        """`fn` of each part's Analysis, in part order; one part's rows in memory per worker at a time."""

        def piece(part: partitions.Part) -> Analysis:
            runs = None if part.runs is None else RunSlice(*part.runs)
            return Analysis(replace(self.results, cell_ids=list(part.cells), prompt_ids=part.prompts, runs=runs),
                            self.reference, self.allow_mixed, self.reference_run, self.near_tie, self.confident,
                            self._stand_ins(part))

        if self.workers < 2:  # one CPU: no process to start; each part's rows are dropped before the next
            return [fn(piece(part)) for part in self.parts]
        pool = ProcessPoolExecutor(max_workers=min(self.workers, len(self.parts)), mp_context=_start_method())
        futures = {pool.submit(fn, piece(part)): i for i, part in enumerate(self.parts)}
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

    def _stand_ins(self, part: partitions.Part) -> pd.DataFrame | None:
        """The runs that stand for their cells in a part that holds some runs of a prompt, chosen over all
        of the prompt's runs by the reference-run rule (first or modal), as a whole read chooses them."""
        if part.runs is None:
            return None
        key = (part.cells, part.prompts)
        known = self.__dict__.setdefault("_stand_ins_by_prompt", {})
        if key not in known:
            from harness.analysis.divergence import reference_repeats

            whole = replace(self.results, cell_ids=list(part.cells), prompt_ids=part.prompts)
            rows = whole.read_rows(["cell_id", "prompt_id", "repeat", "output_hash", "status"])
            known[key] = reference_repeats(rows[(rows["status"] == "ok").to_numpy()], self.reference_run)
        return known[key]

    def _died(self, broken: BaseException) -> str:
        """What to say when a worker process died under a part (the kernel's out-of-memory killer, most often)."""
        largest = max(len(part.cells) for part in self.parts)
        return (f"{self.results.root}: a worker process reading this folder part by part died ({broken}); "
                f"{self.workers} workers read {len(self.parts)} parts of up to {largest} cells each. A worker "
                "ended by the system is most often out of memory: free memory, or read on a machine with more "
                "(each worker holds one part of about partitions.PART_ROWS rows)")

    @cached_property
    def _pieces(self) -> dict[str, Any]:
        return _pieces_of(self._map(partial(_part_tables, names=PIECES)))

    @cached_property
    def _latency_rows(self) -> pd.DataFrame:
        found = self._map(partial(_part_tables, names=("_latency_rows",)))
        return _joined([tables["_latency_rows"] for tables in found], "_latency_rows", [])


def _piece(name: str) -> cached_property:
    """An attribute of the folder's joined pieces: the Analysis's tables are computed from it."""
    return cached_property(lambda self: self._pieces[name])


for _name in PIECES:  # each piece from the joined pieces, never from the folder's rows
    setattr(PartitionedAnalysis, _name, _piece(_name))
    getattr(PartitionedAnalysis, _name).__set_name__(PartitionedAnalysis, _name)


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
