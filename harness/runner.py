"""Run an experiment: each engine group in its own worker process, one row per target generation.

`Runner` (the parent) decides what to run, refuses or skips what cannot run here, starts a
worker per group and accounts for cells a dead worker did not write. `GroupRunner` (inside
the worker) loads the engine once and runs its cells, writing each cell when it is done.
"""

from __future__ import annotations

import hashlib
import json
import re
import traceback
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from harness import provenance, worker
from harness.config import LoadedExperiment
from harness.engines import engine_class
from harness.engines.base import BatchOutput, Engine, Unsupported
from harness.matrix import Cell, Group, expand, group
from harness.probes import LogitProbes
from harness.prompts import compose_batch
from harness.selection import Selection, apply
from harness.server_process import LOG_DIR_ENV
from harness.store import SCHEMA_VERSION, Store


class Reporter(Protocol):
    """Where progress goes; the CLI gives a rich progress bar, tests a silent one."""

    def start(self, total: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def log(self, message: str) -> None: ...


class SilentReporter:
    def start(self, total: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def log(self, message: str) -> None: ...


@dataclass
class RunResult:
    ran: list[str] = field(default_factory=list)
    skipped_done: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)


def output_hash(token_ids: list[int]) -> str:
    """Hash of the token-id sequence; equal hashes mean identical outputs."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int32).tobytes(), digest_size=12).hexdigest()


_REFUSAL = re.compile(r"not supported|unsupported|NotImplementedError|is not available|Cannot use", re.IGNORECASE)


def _is_refusal(message: str) -> bool:
    """An engine that says it does not support a setting refused it; anything else failed."""
    return bool(_REFUSAL.search(message))


def describe_exception(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:2000]


class RowMaker:
    """Builds rows in the store's schema for one experiment run."""

    def __init__(self, loaded: LoadedExperiment, run_id: str, prov: dict[str, Any]) -> None:
        self.loaded = loaded
        self.exp = loaded.experiment
        self.run_id = run_id
        self.prov = prov

    @staticmethod
    def engine_columns(info: dict[str, Any]) -> dict[str, Any]:
        """The row columns taken from an engine's describe(); computed once per engine load."""
        return {
            "model_file": info.get("model_file", ""),
            "model_sha256": info.get("model_sha256", ""),
            "engine_version": info.get("engine_version", ""),
            "engine_info": json.dumps(
                {k: v for k, v in info.items() if k not in ("engine_version", "model_file", "model_sha256")},
                sort_keys=True,
            ),
        }

    def base(self, cell: Cell, prompt_id: str, repeat: int, engine_cols: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "experiment": self.exp.name,
            "run_id": self.run_id,
            "cell_id": cell.id,
            "group_id": cell.group_id,
            "prompt_id": prompt_id,
            "repeat": repeat,
            **cell.as_dict,
            "max_tokens": self.exp.max_tokens,
            "engine_options": json.dumps(dict(cell.engine_options), sort_keys=True),
            **engine_cols,
            "started_at": datetime.now(timezone.utc),
            **self.prov,
        }

    def status_rows(self, cell: Cell, status: str, error: str) -> list[dict]:
        """Rows for a cell that did not run: one per prompt and repeat, so counts stay honest."""
        engine_cols = self.engine_columns({})
        return [
            self.base(cell, p.id, r, engine_cols) | {"status": status, "error": error}
            for p in self.loaded.prompt_set.prompts
            for r in range(self.exp.repeats)
        ]

    @staticmethod
    def ok(base: dict[str, Any], out: BatchOutput) -> dict[str, Any]:
        t = out.target
        n = len(t.token_ids)
        return base | {
            "status": "ok",
            "error": "",
            "prompt_tokens": out.prompt_tokens,
            "token_ids": t.token_ids,
            "n_tokens": n,
            "text": t.text,
            "token_texts": t.token_texts or None,
            "finish_reason": t.finish_reason,
            "output_hash": output_hash(t.token_ids),
            "logprobs": t.logprobs,
            "margins": t.margins,
            "prefill_s": out.prefill_s,
            "ttft_s": out.ttft_s,
            "decode_s": None if out.prefill_s is None else out.target_s - out.prefill_s,
            "wall_s": out.wall_s,
            "target_tokens_per_s": n / out.target_s if out.target_s > 0 else None,
            "batch_tokens_per_s": out.batch_generated_tokens / out.wall_s if out.wall_s > 0 else None,
            "engine_detail": json.dumps(out.detail, sort_keys=True, default=str),
        }


class GroupRunner:
    """Inside a worker: one engine load, then every cell of the group, each written when done."""

    def __init__(
        self, loaded: LoadedExperiment, store: Store, reporter: Reporter, run_id: str, log_path: Path | None = None
    ) -> None:
        self.log_path = log_path
        self.loaded = loaded
        self.exp = loaded.experiment
        self.store = store
        self.reporter = reporter
        self.rows = RowMaker(loaded, run_id, provenance.collect())

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def _explain(self, exc: BaseException, since: int) -> str:
        """The exception, plus the root causes the engine logged since byte `since` of the log."""
        causes = [c for c in worker.root_causes(self.log_path, since) if c not in str(exc)]
        return "; ".join([describe_exception(exc)] + causes)

    def _cell(
        self, engine: Engine, cell: Cell, engine_cols: dict[str, Any], probes: LogitProbes | None
    ) -> list[dict[str, Any]]:
        sampling = cell.sampling(self.exp.max_tokens)
        prompt_set = self.loaded.prompt_set
        size = cell["batch_size"]
        warm = compose_batch(prompt_set, prompt_set.prompts[0], size, 0, self.exp.filler_seed)
        since = self._log_size()  # causes logged from here on explain this cell's failures
        try:  # warm-up: first use of a batch shape is not timed
            engine.generate([p.text for p in warm.prompts], warm.target_position, replace(sampling, max_tokens=2))
        except Exception:  # noqa: BLE001 - the real calls below record what goes wrong
            pass
        rows = []
        for prompt in prompt_set.prompts:
            for repeat in range(self.exp.repeats):
                batch = compose_batch(prompt_set, prompt, size, repeat, self.exp.filler_seed)
                base = self.rows.base(cell, prompt.id, repeat, engine_cols) | {
                    "batch_position": batch.target_position,
                    "filler_ids": list(batch.filler_ids),
                }
                texts = [p.text for p in batch.prompts]
                try:
                    if probes is None:
                        rows.append(self.rows.ok(base, engine.generate(texts, batch.target_position, sampling)))
                    else:
                        out, probe_cols = probes.generate(texts, batch.target_position, sampling)
                        rows.append(self.rows.ok(base, out) | probe_cols)
                except Unsupported as exc:
                    rows.append(base | {"status": "unsupported", "error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - recorded, and the matrix goes on
                    rows.append(base | {"status": "failed", "error": self._explain(exc, since)})
                self.reporter.advance(1)
        return rows

    def run(self, grp: Group, cells: list[Cell]) -> None:
        per_cell = len(self.loaded.prompt_set.prompts) * self.exp.repeats
        spec = grp.spec
        self.reporter.log(f"loading {spec.engine} / {spec.model} / {spec.dtype}")
        since = self._log_size()
        try:
            engine = engine_class(spec.engine)(spec, self.reporter.log, self.loaded.base_dir)
        except Exception as exc:  # noqa: BLE001 - a failed load fails its cells, not the run
            message = self._explain(exc, since)
            status = "unsupported" if isinstance(exc, Unsupported) or _is_refusal(message) else "failed"
            for cell in cells:
                self.store.write_cell(cell.id, self.rows.status_rows(cell, status, message))
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{spec.engine}] load {status}: {message}")
            return
        with engine:
            engine_cols = self.rows.engine_columns(engine.describe())
            probes = LogitProbes(engine) if self.exp.probe_logits else None
            for cell in cells:
                self.store.write_cell(cell.id, self._cell(engine, cell, engine_cols, probes))


class Runner:
    """Runs the cells of one experiment into one results folder, a worker process per group."""

    def __init__(
        self,
        loaded: LoadedExperiment,
        store: Store,
        reporter: Reporter | None = None,
        group_timeout_s: float | None = None,
    ) -> None:
        self.loaded = loaded
        self.store = store
        self.reporter = reporter or SilentReporter()
        self.group_timeout_s = group_timeout_s
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]

    def _account(self, cells: list[Cell], result: RunResult) -> None:
        for cell in cells:
            if self.store.cell_path(cell.id).is_file():
                result.ran.append(cell.id)
                for status in self.store.statuses(cell.id):
                    result.statuses[status] = result.statuses.get(status, 0) + 1

    def _run_group(self, grp: Group, cells: list[Cell], rows: RowMaker, gpus: list[dict[str, str]]) -> None:
        per_cell = len(self.loaded.prompt_set.prompts) * self.loaded.experiment.repeats
        cls = engine_class(grp.spec.engine)
        reason, status = cls.refusal(grp.spec), "unsupported"
        if reason is None:
            reason, status = provenance.gpu_matches(grp.spec.gpu, gpus), "skipped"
        if reason is not None:
            for cell in cells:
                self.store.write_cell(cell.id, rows.status_rows(cell, status, reason))
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{grp.spec.engine}] {status}: {reason}")
            return
        log_path = self.store.root / "logs" / f"{grp.id}.log"
        job = worker.Job(
            str(self.loaded.path), str(self.store.root), grp.id, [c.id for c in cells], self.run_id, str(log_path)
        )
        env = cls.environment(grp.spec) | {LOG_DIR_ENV: str(log_path.parent.resolve())}
        outcome = worker.launch(job, env, log_path, self.reporter, self.group_timeout_s)
        missing = [c for c in cells if not self.store.cell_path(c.id).is_file()]
        if missing and outcome.cause == "":
            outcome.cause = "engine worker ended without writing these cells"
        for cell in missing:
            self.store.write_cell(cell.id, rows.status_rows(cell, "failed", outcome.cause))
            self.reporter.advance(per_cell)
        if missing:
            self.reporter.log(f"[{grp.spec.engine}] {len(missing)} cell(s) failed: {outcome.cause.splitlines()[0]}")

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
        self.reporter.start(sum(len(p) for _, p in todo) * per_cell)
        if result.skipped_done:
            self.reporter.log(f"{len(result.skipped_done)} cell(s) already done; skipped (use --force to redo)")
        gpus = provenance.detect_gpus()  # once per run: routing and provenance share the answer
        rows = RowMaker(self.loaded, self.run_id, provenance.collect(gpus))
        for grp, pending in todo:
            if force:
                for cell in pending:
                    self.store.cell_path(cell.id).unlink(missing_ok=True)
            self._run_group(grp, pending, rows, gpus)
            self._account(pending, result)
        return result
