"""The worker process that runs one engine group: its environment is set before any engine import.

It reads its work order (experiment snapshot, group, cells) from stdin, loads the engine once,
runs every cell and lands each in the results folder as soon as it is done, sending progress
to the parent as JSON lines. It ends itself, with everything it started, when the parent dies.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before anything native loads: the engine's GPU backend, where its build has one
    from harness.core.native_preload import ensure_from_argv

    ensure_from_argv()

import importlib
import json
import os
import pickle
import platform
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from harness.core.native_preload import FLAG
from harness.engines.base import LoadSpec
from harness.experiment.config import LoadedExperiment
from harness.experiment.matrix import Cell, Group

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkOrder:
    """Everything a worker needs, handed over by the parent: no file is re-read in the child. It comes on
    stdin as (the group's environment, the order)."""

    loaded: LoadedExperiment
    group: Group
    cells: tuple[Cell, ...]
    out: str
    run_id: str
    log: str
    fd: int = -1
    parent_pid: int = 0
    #: seconds between checkpoints of a running cell's finished batches (0: after every batch)
    checkpoint_s: float = 10.0
    #: run-level provenance the parent collected (None: the worker collects it)
    prov: dict[str, Any] | None = None
    #: redo cells already done (--force); their new rows replace the old only if they land done
    force: bool = False
    #: the node's GPUs as the parent detected them (name, uuid, ...), to name the one a load used
    gpus: tuple[dict[str, str], ...] = ()
    #: how the log names this load: what tells it apart from the run's other loads
    label: str = ""
    #: with the experiment's boots > 1: which boot this load is (0 ...). A boot runs the repeats
    #: experiment.boot_of gives it and checkpoints them; the last one also runs whatever earlier
    #: boots left undone and lands the cells. None: one load runs every repeat
    boot: int | None = None
    #: the interpreter the worker runs under (the environment axis); "" = the parent's own
    python: str = ""


def secrets_of(options: dict[str, Any], environ: dict[str, str] | None = None) -> frozenset[str]:
    """The credential values a load's options hold: those written inline, and those their `${NAME}`
    references take from the environment (harness.core.redaction). None of them is ever written."""
    from harness.core.redaction import expanded_secrets, secret_values

    environ = dict(os.environ) if environ is None else environ
    return frozenset(secret_values(options) | expanded_secrets(options, environ))


class PipeReporter:
    """Runner reporter inside the worker: every event is one JSON line to the parent; log lines
    without the load's credentials."""

    def __init__(self, fd: int, secrets: frozenset[str] = frozenset()) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)
        self._secrets = secrets

    def _send(self, **event: Any) -> None:
        self._out.write(json.dumps(event) + "\n")

    def start(self, total: int, cells: int = 0) -> None: ...

    def advance(self, n: int) -> None:
        self._send(advance=n)

    def cell_done(self, cell_id: str, status: str) -> None:
        self._send(cell=cell_id, status=status)

    def log(self, message: str) -> None:
        from harness.core.redaction import redact_text

        self._send(log=redact_text(message, self._secrets))

    def close(self) -> None:
        self._out.close()


_CAUSE = re.compile(r"\b([A-Z][A-Za-z]*(Error|Exception)|NotImplementedError|AssertionError): .+")


def root_causes(path: Path | None, since: int = 0, most: int = 3) -> list[str]:
    """The last distinct 'SomeError: message' lines a worker logged after byte `since`.

    Engines that start helper processes (vLLM) raise a generic error in the caller and log
    the real reason; this finds it.
    """
    if path is None:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(since)
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    found: list[str] = []
    for line in text.splitlines():
        match = _CAUSE.search(line)
        if match and match.group(0) not in found:
            found.append(match.group(0))
    return found[-most:]


def log_size(path: Path | None) -> int:
    return path.stat().st_size if path and path.exists() else 0


def explain(exc: BaseException, log: Path | None, since: int) -> str:
    """The exception, plus the root causes the engine logged since byte `since` of the log."""
    from harness.results.rows import describe_exception

    causes = [c for c in root_causes(log, since) if c not in str(exc)]
    return "; ".join([describe_exception(exc)] + causes)


@dataclass
class EngineLoad:
    """One engine load's outcome: the engine, or the error it raised and what the log says of it."""

    spec: LoadSpec
    engine: Any = None
    error: Exception | None = None
    message: str = ""


def load_engine(spec: LoadSpec, label: str, reporter: Any, base: Path, log: Path | None) -> EngineLoad:
    """Load the group's engine, as the worker does once; an error is kept, for the cells to say."""
    from harness.core.redaction import expand
    from harness.engines.registry import engine_class

    reporter.log(f"loading {label or f'{spec.engine} / {spec.model}'}")
    package = engine_class(spec.engine).native_package
    if package:  # what a crash in the load is explained with (harness.run.launch)
        from harness.core.native_preload import before_engine_line

        print(before_engine_line(package), file=sys.stderr, flush=True)
    since = log_size(log)
    try:  # `${NAME}` in the options: filled in from this environment, here and nowhere else
        filled = replace(spec, options=expand(spec.options, dict(os.environ), f"engine_options.{spec.engine}"))
        return EngineLoad(spec, engine=engine_class(spec.engine)(filled, reporter.log, base))
    except Exception as exc:  # noqa: BLE001 - a failed load fails its cells, not the run
        return EngineLoad(spec, error=exc, message=explain(exc, log, since))


class GroupRunner:
    """Inside a worker: one engine load, then every cell of the group, each landed when done."""

    def __init__(self, order: WorkOrder, reporter: Any, ahead: EngineLoad | None = None) -> None:
        from harness.results import provenance
        from harness.results.folder import ResultsFolder
        from harness.results.rows import RowMaker

        self.order = order
        self.loaded = order.loaded
        self.exp = order.loaded.experiment
        self.folder = ResultsFolder(Path(order.out), secrets_of(order.group.spec.options))
        self.reporter = reporter
        self.log_path = Path(order.log) if order.log else None
        #: the engine, loaded before the order came (harness.run.ahead); used where its spec is the group's
        self.ahead = ahead
        # the parent's provenance, but the environment as this worker has it (the engine's variables set)
        prov = provenance.collect() if order.prov is None else order.prov | {"env": provenance.env_json()}
        if order.python:  # another environment: its own interpreter and libraries
            prov |= {"library_versions": json.dumps(provenance.library_versions(), sort_keys=True),
                     "python_version": platform.python_version(), "python_executable": sys.executable}
        self.rows = RowMaker(self.loaded, order.run_id, prov)
        #: shared contexts fitted to this engine's tokenizer, by (tokens, text, seed)
        self._contexts: dict[tuple[int, str | None, int], tuple[str, int]] = {}
        #: seed-control verdicts of this load, by the sampling, batch-mates and cache mode they tested
        self._seed_checks: dict[tuple[Any, ...], Any] = {}
        #: batch-mates padded to filler_tokens with this engine's tokenizer, by (text, tokens)
        self._mates: dict[tuple[str, int], str] = {}
        #: the ok runs of the folder's stale cells, by run key (read at the first cell that looks)
        self._reusable: Any = None
        #: this engine load, as its rows name it (one worker process is one load)
        self.load_id = uuid.uuid4().hex[:12]
        boots = self.exp.boots if order.boot is not None else 1
        #: the boot this load is, and whether it holds its cells back for a later boot to land
        self.boot = order.boot or 0
        self.holds_back = self.boot < boots - 1

    def _wanted(self, repeat: int) -> bool:
        """Whether this load runs `repeat`: its own boot's repeats; the last boot, every one left."""
        if self.order.boot is None:
            return True
        planned = self.exp.boot_of(repeat)
        return planned == self.boot or (not self.holds_back and planned < self.boot)

    def _land(self, cell: Cell, rows: list[dict[str, Any]]) -> None:
        landing = self.folder.write_cell(cell.id, rows, self.order.run_id, self.order.force)
        if not landing.written:
            self.reporter.log(f"cell {cell.id}: {landing.reason}")
        statuses = {r["status"] for r in rows}
        self.reporter.cell_done(cell.id, "ok" if statuses == {"ok"} else "/".join(sorted(statuses)))

    def _taken(self, cell: Cell) -> bool:
        """True when another task landed this cell done since this run chose it (it is not redone)."""
        if self.order.force or not self.folder.store.is_done(cell.id):
            return False
        self.reporter.log(f"cell {cell.id}: landed done by another task meanwhile; not run again")
        self.reporter.advance(len(self.loaded.prompt_set.prompts) * self.exp.repeats)
        return True

    def _context(self, engine: Any, cell: Cell) -> tuple[str, int]:
        """The cell's shared context (text, tokens); Unsupported where the engine cannot count tokens
        and the cell needs them counted (a context, or batch-mates of filler_tokens)."""
        from harness.engines.base import Engine, Unsupported
        from harness.experiment.context import shared_context

        if cell["filler_tokens"] > 0 and type(engine).count_tokens is Engine.count_tokens:
            raise Unsupported(f"filler_tokens {cell['filler_tokens']}: this engine has no tokenizer here to "
                              "measure batch-mates with")
        wanted = cell["context_tokens"]
        if wanted <= 0:
            return "", 0
        if type(engine).count_tokens is Engine.count_tokens:  # the base answers None: no tokenizer
            raise Unsupported(f"context_tokens {wanted}: this engine has no tokenizer here to measure a context with")
        key = (wanted, self.exp.context.text, self.exp.context.seed)
        if key not in self._contexts:
            self._contexts[key] = shared_context(self.exp.context.text, self.exp.context.seed, wanted,
                                                 engine.count_tokens)
        return self._contexts[key]

    def _texts(self, engine: Any, cell: Cell, batch: Any, context: str) -> list[str]:
        """The user messages of a batch: the shared context before each, and every batch-mate padded
        to the cell's filler_tokens (the target and copies of it as written)."""
        from harness.experiment.context import padded, with_context

        wanted = cell["filler_tokens"]
        texts = []
        for i, member in enumerate(batch.prompts):
            text = member.text
            if wanted > 0 and i != batch.target_position:
                if (text, wanted) not in self._mates:
                    seed = f"{self.exp.filler_seed}|{member.id}"
                    self._mates[(text, wanted)] = padded(text, wanted, seed, engine.count_tokens)
                text = self._mates[(text, wanted)]
            texts.append(with_context(context, text))
        return texts

    def _what_ran(self, engine: Any, cell: Cell) -> tuple[dict[str, Any], str | None]:
        """The row columns of what the engine says is in force, and why that contradicts the cell (or None)."""
        from harness.run import enforced

        state = engine.in_force()
        cols = enforced.columns(state, list(self.order.gpus))
        return cols, enforced.contradiction(engine.name, cell["gpu"], cell["batch_invariant"], state, cols)

    def _seed_check(self, engine: Any, cell: Cell) -> Any:
        """The seed control's verdict for this cell (harness.run.seed_control), or None where it does not
        apply (not asked for, greedy) or could not run (the cell's own runs then record why)."""
        from harness.engines.base import Unsupported
        from harness.experiment.context import with_context
        from harness.run import seed_control

        if not self.exp.seed_control or cell["temperature"] <= 0:
            return None
        sampling = cell.sampling(self.exp.max_tokens)
        key = (sampling, min(cell["batch_size"], seed_control.MATES), cell["prefix_cache"], cell["context_tokens"])
        if key not in self._seed_checks:
            def generate(texts: list[str], target: int, s: Any, members: bool) -> Any:
                return engine.generate(texts, target, s, cache=cell["prefix_cache"], members=members)

            try:
                context = self._context(engine, cell)[0]
                texts = [with_context(context, p.text) for p in self.loaded.prompt_set.prompts]
                self._seed_checks[key] = seed_control.check(generate, texts, sampling, cell["batch_size"])
            except Unsupported:
                self._seed_checks[key] = None
            except Exception as exc:  # noqa: BLE001 - the cell's own runs record what goes wrong
                self.reporter.log(f"cell {cell.id}: the seed control could not run ({exc})")
                return None
        return self._seed_checks[key]

    def _cell(self, engine: Any, cell: Cell, engine_cols: dict[str, Any], probes: Any) -> None:
        """Run one cell and land it, with what ran beside what was asked; a contradiction fails it,
        a seed that does not take effect (seed control on) refuses it."""
        check = self._seed_check(engine, cell)
        seeded = {"seed_check": None if check is None else check.column}
        if check is not None and check.fails:
            reason = (f"asked seed {cell['seed']} at temperature {cell['temperature']}; {engine.name}: {check.text} "
                      "(seed control)")
            ran, _ = self._what_ran(engine, cell)
            self.reporter.log(f"cell {cell.id} unsupported: {reason}")
            self._land(cell, [r | engine_cols | ran | seeded
                              for r in self.rows.status_rows(cell, "unsupported", reason)])
            self.reporter.advance(len(self.loaded.prompt_set.prompts) * self.exp.repeats)
            return
        # each boot's checkpoints under names of their own: a later boot keeps an earlier one's, never overwrites them
        parts = self.order.run_id + ("" if self.order.boot is None else f"-boot{self.boot}")
        progress = CellProgress(self.folder, cell.id, parts, self.order.checkpoint_s, engine_cols,
                                self.rows.prov, lambda: self._what_ran(engine, cell)[0] | seeded)
        self._cell_rows(engine, cell, engine_cols, probes, progress)
        ran, reason = self._what_ran(engine, cell)  # after the cell: a server engine starts its server late
        progress.stamp(ran | seeded)  # this load's runs; kept ones keep what they ran on
        if reason is not None:
            progress.stamp({"status": "failed", "error": reason})
            self.reporter.log(f"cell {cell.id} failed: {reason}")
        if self.holds_back:  # a later boot lands the cell; this one's good runs wait as checkpoints
            progress.flush()
            return
        self._land(cell, progress.rows())

    def _reused(self, cell: Cell, keys: dict[tuple[str, int], str], here: dict[str, Any]) -> dict[tuple[str, int], Any]:
        """Runs of the folder's stale cells this cell wants ((prompt id, repeat) -> run key), made as
        `here` says, as rows of this cell (harness.run.reuse); none under --force, which redoes every run."""
        from harness.run.reuse import ReusableRuns, restamped

        if self.order.force:
            return {}
        if self._reusable is None:
            self._reusable = ReusableRuns(self.folder)
        found = self._reusable.take(keys, here)
        prompts = self.loaded.prompt_set
        return {run: restamped(row, cell.id, self.exp.name, prompts.get(run[0])) for run, row in found.items()}

    def _cell_rows(self, engine: Any, cell: Cell, engine_cols: dict[str, Any], probes: Any,
                   progress: CellProgress) -> None:
        """Generate the cell's runs that no checkpoint or stale cell holds, into `progress`."""
        from harness.engines.base import Unsupported
        from harness.experiment import answers
        from harness.experiment.prompts import plan_batches
        from harness.run.reuse import run_key

        copies = self.exp.batch_fill == "copies"
        sampling = cell.sampling(self.exp.max_tokens, self.exp.unseeded_fillers, copies)
        cache = cell["prefix_cache"]
        prompt_set = self.loaded.prompt_set
        size = cell["batch_size"]
        try:
            context, context_used = self._context(engine, cell)
        except Unsupported as exc:
            return progress.replace(self.rows.status_rows(cell, "unsupported", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the tokenizer broke (a server died): this cell fails
            return progress.replace(self.rows.status_rows(cell, "failed", explain(exc, self.log_path, log_size(self.log_path))))
        plans = {p.id: plan_batches(prompt_set, p, size, self.exp.repeats, self.exp.filler_seed, self.exp.batch_fill)
                 for p in prompt_set.prompts}
        keys = {(p.id, r): run_key(cell.settings_id, plan.batch, pos, r)
                for p in prompt_set.prompts for plan in plans[p.id] for pos, r in plan.runs}
        if progress.kept and self.boot == 0:  # a later boot keeps its earlier boots' runs: no news
            self.reporter.log(f"cell {cell.id}: {len(progress.kept)} run(s) kept from checkpoints; resuming")
            self.reporter.advance(len(progress.kept))
        reused = progress.keep(self._reused(cell, keys, progress.here))
        if reused:
            self.reporter.log(f"cell {cell.id}: {reused} run(s) kept from earlier results of the same settings, "
                              "prompt and batch (stale cells)")
            self.reporter.advance(reused)
        todo = [(prompt, plan) for prompt in prompt_set.prompts for plan in plans[prompt.id]
                if any(self._wanted(r) and not progress.has(prompt.id, r) for _, r in plan.runs)]
        warm = plans[prompt_set.prompts[0].id][0].batch
        since = log_size(self.log_path)  # causes logged from here on explain this cell's failures
        try:  # warm-up: first use of a batch shape is not timed (with nothing left to run, none)
            if todo:
                engine.warm_up(self._texts(engine, cell, warm, context), warm.target_position, sampling)
        except Exception:  # noqa: BLE001 - the real calls below record what goes wrong
            pass
        for index, (prompt, plan) in enumerate(todo):
            batch = plan.batch
            runs = [(pos, r) for pos, r in plan.runs if self._wanted(r) and not progress.has(prompt.id, r)]
            bases = [self.rows.base(cell, prompt.id, r, engine_cols) | {
                "run_key": keys[(prompt.id, r)],
                "boot": self.boot,
                "load_id": self.load_id,
                "batch_position": pos,
                "filler_ids": list(batch.filler_ids),
                "context_tokens_used": context_used,
            } for pos, r in runs]
            texts = self._texts(engine, cell, batch, context)
            try:
                if probes is None:
                    out, probe_cols = engine.generate(texts, batch.target_position, sampling, cache=cache,
                                                      members=copies), {}
                else:
                    out, probe_cols = probes.generate(texts, batch.target_position, sampling, cache)
                outputs = [replace(out, target=out.members[pos]) for pos, _ in runs] if copies else [out]
                rows = [self.rows.ok(base, o) | probe_cols | answers.columns(o.target.text, prompt.answer, prompt.parse)
                        for base, o in zip(bases, outputs)]
            except Unsupported as exc:  # the engine's declared rules refuse this, before running it
                rows = [base | {"status": "unsupported", "error": str(exc)} for base in bases]
            except Exception as exc:  # noqa: BLE001 - recorded, and the matrix goes on
                rows = [base | {"status": "failed", "error": explain(exc, self.log_path, since)} for base in bases]
            progress.add(rows, more=index < len(todo) - 1)
            self.reporter.advance(len(rows))
        order = {p.id: i for i, p in enumerate(prompt_set.prompts)}
        progress.order = lambda r: (order[r["prompt_id"]], r["repeat"])

    def run(self) -> None:
        from harness.core.redaction import redact_rows
        from harness.engines.base import Unsupported
        from harness.run.probes import LogitProbes

        cells = self.order.cells
        per_cell = len(self.loaded.prompt_set.prompts) * self.exp.repeats
        spec = self.order.group.spec
        load = self.ahead
        if load is None or load.spec != spec:  # (the parent hands over a spare only for its own load)
            if load is not None and load.engine is not None:
                load.engine.close()
            load = load_engine(spec, self.order.label, self.reporter, self.loaded.base, self.log_path)
        engine, exc, message = load.engine, load.error, load.message
        if exc is not None:  # a failed load fails its cells, not the run
            # Only the engine's own refusal is 'unsupported'; a load that broke (missing or bad
            # file, out of memory, no CUDA) is 'failed', and a rerun tries it again.
            status = "unsupported" if isinstance(exc, Unsupported) else "failed"
            if status == "failed" and self.holds_back:  # the last boot tries again, and lands what it finds
                self.reporter.log(f"[{spec.engine}] load failed in boot {self.boot + 1}: {message}")
                return
            for cell in cells:
                self._land(cell, self.rows.status_rows(cell, status, message))
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{spec.engine}] load {status}: {message}")
            return
        with engine:
            # as rows store it (redacted), so that kept rows compare with this load like for like
            engine_cols = redact_rows([self.rows.engine_columns(engine.describe())], self.folder.secrets)[0]
            ran, reason = self._what_ran(engine, cells[0])  # the group's cells share gpu and batch_invariant
            if reason is not None and self.holds_back:  # the last boot lands the verdict
                self.reporter.log(f"[{spec.engine}] {reason}")
                return
            if reason is not None:  # known at load: no cell runs on what it did not ask for
                for cell in cells:
                    self._land(cell, [r | engine_cols | ran for r in self.rows.status_rows(cell, "failed", reason)])
                    self.reporter.advance(per_cell)
                self.reporter.log(f"[{spec.engine}] {reason}")
                return
            wanted = self.exp.probe_logits or self.exp.probe_prefill
            probes = LogitProbes(engine, logits=self.exp.probe_logits, prefill=self.exp.probe_prefill) if wanted else None
            for cell in cells:
                if not self._taken(cell):
                    self._cell(engine, cell, engine_cols, probes)


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
        from harness.results.store import DONE_STATUSES
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
        from harness.results.store import DONE_STATUSES

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


def watch_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """End this process group (the worker and what it started) within a poll when the parent is gone.

    A parent killed with SIGKILL cannot clean up; a worker left behind could hold a GPU for
    minutes. Engine calls release the GIL, so this thread runs while they compute.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _spare_imports() -> list[str]:
    """What a spare imports before its work order, most needed first: the built-in engine modules (a
    load sent ahead looks its engine up among them; not their libraries, which must see the group's
    environment, nor plugins, which may import theirs), pyarrow (the folder and its rows), and pandas,
    which pyarrow imports to turn the cell's rows into a table after the last batch."""
    from harness.engines.registry import builtin_modules

    return [*builtin_modules(), "harness.results.folder", "harness.results.rows", "pandas"]


def prepare_imports() -> None:
    """Import what a worker needs before its work order, in the order a spare does (doctor's rehearsal
    imports the same, so that it meets what a run meets)."""
    for module in _spare_imports():
        importlib.import_module(module)


def _enter(env: dict[str, str], log: str) -> None:
    """Take on a group's environment and send this process's output to its log."""
    os.environ.update(env)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _read_to_end(stream: Any) -> Callable[[], bytes]:
    """Read `stream` to its end in a thread; the call returned waits for it and gives what came."""
    chunks: list[bytes] = []
    thread = threading.Thread(target=lambda: chunks.append(stream.read()), daemon=True)
    thread.start()

    def what_came() -> bytes:
        thread.join()
        return chunks[0] if chunks else b""

    return what_came


def _as_spare(parent_pid: int, fd: int) -> tuple[WorkOrder, PipeReporter, EngineLoad | None] | None:
    """A spare worker (harness.run.spare.SpareWorker): import what every worker needs while the parent
    reads the experiment, load the first engine if the parent sends it ahead (harness.run.ahead), and
    wait for the work order (None: released unused). Each message's environment is set here before
    any engine library is imported."""
    from harness.run.ahead import Ahead

    watch_parent(parent_pid)
    # in a thread, so that an order that comes before the last import waits for none of them (the
    # engine's load runs meanwhile; an import this thread has begun is finished, not repeated)
    threading.Thread(target=prepare_imports, daemon=True).start()
    reporter, loaded = None, None
    try:
        message = pickle.load(sys.stdin.buffer)
        if isinstance(message, Ahead):
            # the order is read while the engine loads (minutes, for some): the parent's write of it
            # must not wait on a full pipe, out of reach of its --timeout
            order_bytes = _read_to_end(sys.stdin.buffer)
            _enter(message.env, message.log)
            reporter = PipeReporter(fd, secrets_of(message.spec.options))
            loaded = load_engine(message.spec, message.label, reporter, message.base, Path(message.log))
            message = pickle.loads(order_bytes())
    except EOFError:  # released: the run did not need this worker
        if loaded is not None and loaded.engine is not None:
            loaded.engine.close()
        return None
    env, order = message
    _enter(env, order.log)
    return order, reporter or PipeReporter(order.fd, secrets_of(order.group.spec.options)), loaded


def main() -> int:
    """Worker entry (`python -m harness.run.worker [--preload PACKAGE] [--spare PARENT FD]`): read the
    environment and work order from stdin, run its cells."""
    ahead = None
    args = sys.argv[3:] if sys.argv[1:2] == [FLAG] else sys.argv[1:]
    if args[:1] == ["--spare"]:
        spare = _as_spare(int(args[1]), int(args[2]))
        if spare is None:
            return 0
        order, reporter, ahead = spare
    else:
        order = pickle.load(sys.stdin.buffer)[1]  # the environment was set at the process's start
        if order.parent_pid:
            watch_parent(order.parent_pid)
        reporter = PipeReporter(order.fd, secrets_of(order.group.spec.options))
    GroupRunner(order, reporter, ahead).run()
    from harness.engines.registry import engine_class

    if engine_class(order.group.spec.engine).exits_fast:  # every cell landed, the engine closed
        reporter.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
