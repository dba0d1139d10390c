"""Run an experiment: each engine group in its own worker process, one row per target generation.

`Runner` (the parent) decides what to run, refuses or skips what cannot run here, hands each
group to a worker (harness.run.worker) and accounts for cells a dead worker did not write.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from harness.core.redaction import redact_text, scrub
from harness.engines.registry import engine_class
from harness.experiment.matrix import Cell, Group, expand, group, refused_setting
from harness.experiment.schema import LoadedExperiment
from harness.experiment.selection import Selection, apply
from harness.results import layout, provenance
from harness.results.folder import ResultsFolder
from harness.results.rows import RowMaker
from harness.run import environments
from harness.run.ahead import group_environment
from harness.run.launch import launch
from harness.run.spare import SpareWorker
from harness.run.work_order import WorkOrder, secrets_of


class Reporter(Protocol):
    """Where progress goes; the CLI gives a rich progress bar, tests a silent one."""

    def start(self, total: int, cells: int = 0) -> None: ...
    def advance(self, n: int) -> None: ...
    def cell_done(self, cell_id: str, status: str) -> None: ...
    def log(self, message: str) -> None: ...


class SilentReporter:
    def start(self, total: int, cells: int = 0) -> None: ...
    def advance(self, n: int) -> None: ...
    def cell_done(self, cell_id: str, status: str) -> None: ...
    def log(self, message: str) -> None: ...


@dataclass
class RunResult:
    ran: list[str] = field(default_factory=list)
    skipped_done: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    #: cells this run left failed (a rerun retries them)
    failed: list[str] = field(default_factory=list)


class Runner:
    """Runs the cells of one experiment into one results folder, a worker process per group."""

    def __init__(
        self,
        loaded: LoadedExperiment,
        folder: ResultsFolder,
        reporter: Reporter | None = None,
        group_timeout_s: float | None = None,
        checkpoint_s: float = 10.0,
        spare: SpareWorker | None = None,
    ) -> None:
        self.loaded = loaded
        self.folder = folder
        self.store = folder.store
        self.reporter = reporter or SilentReporter()
        self.group_timeout_s = group_timeout_s
        self.checkpoint_s = checkpoint_s
        #: a worker already started (its imports done) that the first group's load may take
        self.spare = spare
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]
        #: why each environment cannot run a worker (None: it can), found once per run
        self._environments: dict[str, str | None] = {}
        #: the folder now holds this experiment; what it held before (if other) went stale
        self.adoption = folder.adopt(loaded)

    def _account(self, cells: list[Cell], result: RunResult) -> None:
        """Count the cells this run tried, as they are on disk now; a cell another task landed done
        meanwhile (this run's rows, if any, were refused) counts as already done."""
        for cell in cells:
            if not self.store.cell_path(cell.id).is_file():
                continue
            if not self._landed_here(cell) and self.store.is_done(cell.id):
                result.skipped_done.append(cell.id)
                continue
            result.ran.append(cell.id)
            statuses = self.store.statuses(cell.id)
            for status in statuses:
                result.statuses[status] = result.statuses.get(status, 0) + 1
            if "failed" in statuses:
                result.failed.append(cell.id)

    def _landed_here(self, cell: Cell) -> bool:
        """Whether the cell on disk was landed by this run (its file's landing record says so)."""
        return self.folder.landed(cell.id).get("run_id") == self.run_id

    def _land_all(self, cells: list[Cell], rows: RowMaker, status: str, reason: str) -> None:
        per_cell = len(self.loaded.prompt_set.prompts) * self.loaded.experiment.repeats
        for cell in cells:
            landing = self.folder.write_cell(cell.id, rows.status_rows(cell, status, reason), self.run_id)
            if not landing.written and status != "skipped":
                self.reporter.log(f"cell {cell.id}: {landing.reason}")
            self.reporter.advance(per_cell)
            self.reporter.cell_done(cell.id, status)

    def _environment_refusal(self, name: str, python: str) -> str | None:
        """environments.refusal, asked once per environment and run."""
        if name not in self._environments:
            self._environments[name] = environments.refusal(name, python)
        return self._environments[name]

    def _run_group(self, grp: Group, cells: list[Cell], rows: RowMaker, gpus: list[dict[str, str]],
                   force: bool, label: str = "") -> None:
        cls = engine_class(grp.spec.engine)
        refused = {c.id: why for c in cells if (why := refused_setting(c))}
        for why in dict.fromkeys(refused.values()):
            self._land_all([c for c in cells if refused.get(c.id) == why], rows, "unsupported", why)
            self.reporter.log(f"[{grp.spec.engine}] unsupported: {why}")
        cells = [c for c in cells if c.id not in refused]
        if not cells:
            return
        reason, status = cls.refusal(grp.spec), "unsupported"
        boots = self.loaded.experiment.boots
        if reason is None and boots > 1:
            reason = cls.restart_refusal(grp.spec)
        if reason is None:
            reason, status = provenance.gpu_matches(grp.spec.gpu, gpus), "skipped"
        environment = cells[0]["environment"]  # a load axis: one per group
        python = environments.interpreter(self.loaded, environment)
        if reason is None:  # a rerun, once the environment is set up, tries its cells again
            reason, status = self._environment_refusal(environment, python), "failed"
        chosen: dict[str, str] = {}
        if reason is None:
            try:
                chosen = environments.variables(self.loaded, environment)
            except ValueError as exc:  # a ${NAME} not set here
                reason, status = str(exc), "failed"
        if reason is not None:
            self._land_all(cells, rows, status, reason)
            self.reporter.log(f"[{grp.spec.engine}] {status}: {reason}")
            return
        log_path = layout.group_log(self.store.root, grp.id)
        env = group_environment(grp.spec, gpus, log_path)
        if chosen and self.spare is not None:  # a spare started without them may have loaded its libraries
            self.spare.release()
        env |= chosen
        secrets = secrets_of(grp.spec.options)
        self.folder.secrets = self.folder.secrets | secrets  # the rows this run lands for the group
        causes = []
        for boot in range(boots):  # a fresh worker (and server) per boot; the last lands the cells
            order = WorkOrder(self.loaded, grp, tuple(cells), str(self.store.root), self.run_id, str(log_path),
                              checkpoint_s=self.checkpoint_s, prov=rows.prov, force=force, gpus=tuple(gpus),
                              label=label + (f" (boot {boot + 1} of {boots})" if boots > 1 else ""),
                              boot=boot if boots > 1 else None, python=python)
            outcome = launch(order, env, self.reporter, self.group_timeout_s, self.spare)
            causes.append(redact_text(outcome.cause, secrets))
            if causes[-1] and boot < boots - 1:  # its rows say which boot ran them; the log says why
                self.reporter.log(f"[{grp.spec.engine}] boot {boot + 1} of {boots} ended early: "
                                  f"{causes[-1].splitlines()[0]}; the last boot runs what it left")
        for path in log_path.parent.glob("*.log"):  # the worker's and its servers' logs
            scrub(path, secrets)
        missing = [c for c in cells if not self._landed_here(c) and (force or not self.store.is_done(c.id))]
        cause = causes[-1] or next((c for c in causes if c), "")
        if missing and cause == "":
            cause = "engine worker ended without writing these cells"
        self._land_all(missing, rows, "failed", cause)
        if missing:
            self.reporter.log(f"[{grp.spec.engine}] {len(missing)} cell(s) failed: {cause.splitlines()[0]}")

    def run(self, force: bool = False, selection: Selection | None = None) -> RunResult:
        """Run every selected cell not already done; each finished cell is on disk before the next."""
        chosen = apply(group(expand(self.loaded)), selection or Selection())
        self.store.clean_stale()
        result = RunResult()
        todo: list[tuple[Group, list[Cell]]] = []
        for grp, cells in chosen:
            pending = [c for c in cells if force or not self.store.is_done(c.id)]
            result.skipped_done += [c.id for c in cells if c not in pending]
            if pending:
                todo.append((grp, pending))
        per_cell = len(self.loaded.prompt_set.prompts) * self.loaded.experiment.repeats
        self.reporter.start(sum(len(p) for _, p in todo) * per_cell, sum(len(p) for _, p in todo))
        if result.skipped_done:
            self.reporter.log(f"{len(result.skipped_done)} cell(s) already done; skipped (use --force to redo)")
        gpus = provenance.detect_gpus()  # once per run: routing and provenance share the answer
        rows = RowMaker(self.loaded, self.run_id, provenance.collect(gpus))
        for grp, pending in todo:
            if force:  # the old cell stays until the redone one lands done
                for cell in pending:
                    self.folder.drop_checkpoints(cell.id)
            else:  # another task of the job may have landed some of them since this run started
                now = [c for c in pending if not self.store.is_done(c.id)]
                result.skipped_done += [c.id for c in pending if c not in now]
                self.reporter.advance((len(pending) - len(now)) * per_cell)
                pending = now
            if pending:
                self._run_group(grp, pending, rows, gpus, force, grp.spec.label([g.spec for g, _ in todo]))
                self._account(pending, result)
        return result
