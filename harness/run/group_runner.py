"""Inside a worker: one engine load, then every cell of its group, each landed as soon as it is done.

The cell loop: the seed control, the shared context and batch-mates, runs kept from checkpoints and
stale cells, warm-up, the batches, and what the engine says ran beside what the cell asked for.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.experiment.matrix import Cell
from harness.run.cell_progress import CellProgress
from harness.run.engine_load import EngineLoad, load_engine
from harness.run.failure_causes import explain, log_size
from harness.run.work_order import WorkOrder, secrets_of


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
        #: seconds the group's engine took to load (EngineLoad.seconds), stamped on its rows
        self.load_s: float | None = None
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
        warmup_s = None
        try:  # warm-up: first use of a batch shape is not timed (with nothing left to run, none)
            if todo:
                start = time.perf_counter()
                engine.warm_up(self._texts(engine, cell, warm, context), warm.target_position, sampling)
                warmup_s = time.perf_counter() - start
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
                "load_s": self.load_s,
                "warmup_s": warmup_s,
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
        self.load_s = load.seconds
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
