"""Run groups of cells: one engine load per group, batches composed per repeat, rows per cell."""

from __future__ import annotations

import hashlib
import json
import traceback
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Protocol

import numpy as np

from harness import provenance
from harness.config import LoadedExperiment
from harness.engines import engine_class
from harness.engines.base import BatchOutput, Engine, Unsupported
from harness.matrix import Cell, Group, expand, group
from harness.prompts import compose_batch
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


class Runner:
    """Runs the cells of one experiment into one results folder."""

    def __init__(self, loaded: LoadedExperiment, store: Store, reporter: Reporter | None = None) -> None:
        self.loaded = loaded
        self.exp = loaded.experiment
        self.store = store
        self.reporter = reporter or SilentReporter()
        self.run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]
        self.prov: dict[str, Any] = {}

    # -- rows -------------------------------------------------------------------
    def _base_row(self, cell: Cell, prompt_id: str, repeat: int, info: dict[str, Any]) -> dict[str, Any]:
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
            "model_file": info.get("model_file", ""),
            "model_sha256": info.get("model_sha256", ""),
            "engine_version": info.get("engine_version", ""),
            "engine_info": json.dumps(
                {k: v for k, v in info.items() if k not in ("engine_version", "model_file", "model_sha256")},
                sort_keys=True,
            ),
            "started_at": datetime.now(timezone.utc),
            **self.prov,
        }

    def _status_rows(self, cell: Cell, status: str, error: str, info: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            self._base_row(cell, p.id, r, info) | {"status": status, "error": error}
            for p in self.loaded.prompt_set.prompts
            for r in range(self.exp.repeats)
        ]

    def _ok_row(self, base: dict[str, Any], out: BatchOutput) -> dict[str, Any]:
        t = out.target
        n = len(t.token_ids)
        return base | {
            "status": "ok",
            "error": "",
            "prompt_tokens": out.prompt_tokens,
            "token_ids": t.token_ids,
            "n_tokens": n,
            "text": t.text,
            "finish_reason": t.finish_reason,
            "output_hash": output_hash(t.token_ids),
            "logprobs": t.logprobs,
            "margins": t.margins,
            "prefill_s": out.prefill_s,
            "ttft_s": out.ttft_s,
            "decode_s": out.target_s - out.prefill_s,
            "wall_s": out.wall_s,
            "target_tokens_per_s": n / out.target_s if out.target_s > 0 else None,
            "batch_tokens_per_s": out.batch_generated_tokens / out.wall_s if out.wall_s > 0 else None,
        }

    # -- running ------------------------------------------------------------------
    def _run_cell(self, engine: Engine, cell: Cell, info: dict[str, Any]) -> list[dict[str, Any]]:
        sampling = cell.sampling(self.exp.max_tokens)
        prompt_set = self.loaded.prompt_set
        size = cell["batch_size"]
        first = compose_batch(prompt_set, prompt_set.prompts[0], size, 0, self.exp.filler_seed)
        engine.generate([p.text for p in first.prompts], first.target_position, replace(sampling, max_tokens=2))
        rows = []
        for prompt in prompt_set.prompts:
            for repeat in range(self.exp.repeats):
                batch = compose_batch(prompt_set, prompt, size, repeat, self.exp.filler_seed)
                base = self._base_row(cell, prompt.id, repeat, info) | {
                    "batch_position": batch.target_position,
                    "filler_ids": list(batch.filler_ids),
                }
                try:
                    out = engine.generate([p.text for p in batch.prompts], batch.target_position, sampling)
                    rows.append(self._ok_row(base, out))
                except Unsupported as exc:
                    rows.append(base | {"status": "unsupported", "error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - recorded, and the matrix goes on
                    rows.append(base | {"status": "failed", "error": _describe(exc)})
                self.reporter.advance(1)
        return rows

    def _finish_cell(self, cell: Cell, rows: list[dict[str, Any]], result: RunResult) -> None:
        self.store.write_cell(cell.id, rows)
        result.ran.append(cell.id)
        for row in rows:
            result.statuses[row["status"]] = result.statuses.get(row["status"], 0) + 1

    def _run_group(self, grp: Group, cells: list[Cell], result: RunResult) -> None:
        per_cell = len(self.loaded.prompt_set.prompts) * self.exp.repeats
        cls = engine_class(grp.spec.engine)
        reason = cls.refusal(grp.spec)
        status = "unsupported"
        if reason is None:
            reason, status = provenance.gpu_matches(grp.spec.gpu, provenance.detect_gpus()), "skipped"
        if reason is not None:
            for cell in cells:
                self._finish_cell(cell, self._status_rows(cell, status, reason, {}), result)
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{grp.spec.engine}] {status}: {reason}")
            return
        self.reporter.log(f"loading {grp.spec.engine} / {grp.spec.model} / {grp.spec.dtype}")
        try:
            engine = cls(grp.spec, self.reporter.log, self.loaded.base_dir)
        except Exception as exc:  # noqa: BLE001 - a failed load fails its cells, not the run
            status = "unsupported" if isinstance(exc, Unsupported) else "failed"
            for cell in cells:
                self._finish_cell(cell, self._status_rows(cell, status, _describe(exc), {}), result)
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{grp.spec.engine}] load {status}: {exc}")
            return
        with engine:
            info = engine.describe()
            for cell in cells:
                self._finish_cell(cell, self._run_cell(engine, cell, info), result)

    def run(self, force: bool = False) -> RunResult:
        """Run every cell not already done; each finished cell is on disk before the next starts."""
        cells = expand(self.loaded)
        self.store.clean_stale()
        result = RunResult()
        todo: list[tuple[Group, list[Cell]]] = []
        for grp in group(cells):
            pending = [c for c in grp.cells if force or not self.store.is_done(c.id)]
            result.skipped_done += [c.id for c in grp.cells if c not in pending]
            if pending:
                todo.append((grp, pending))
        per_cell = len(self.loaded.prompt_set.prompts) * self.exp.repeats
        self.reporter.start(sum(len(p) for _, p in todo) * per_cell)
        if result.skipped_done:
            self.reporter.log(f"{len(result.skipped_done)} cell(s) already done; skipped (use --force to redo)")
        self.prov = provenance.collect()
        for grp, pending in todo:
            self._run_group(grp, pending, result)
        return result


def _describe(exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last[:2000]
