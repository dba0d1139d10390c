"""The worker process that runs one engine group: its environment is set before any engine import.

It reads its work order (experiment snapshot, group, cells) from stdin, loads the engine once,
runs every cell and lands each in the results folder as soon as it is done, sending progress
to the parent as JSON lines. It ends itself, with everything it started, when the parent dies.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.config import LoadedExperiment
from harness.matrix import Cell, Group

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkOrder:
    """Everything a worker needs, handed over by the parent: no file is re-read in the child."""

    loaded: LoadedExperiment
    group: Group
    cells: tuple[Cell, ...]
    out: str
    run_id: str
    log: str
    fd: int = -1
    parent_pid: int = 0


class PipeReporter:
    """Runner reporter inside the worker: every event is one JSON line to the parent."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)

    def _send(self, **event: Any) -> None:
        self._out.write(json.dumps(event) + "\n")

    def start(self, total: int) -> None: ...

    def advance(self, n: int) -> None:
        self._send(advance=n)

    def log(self, message: str) -> None:
        self._send(log=message)


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


class GroupRunner:
    """Inside a worker: one engine load, then every cell of the group, each landed when done."""

    def __init__(self, order: WorkOrder, reporter: Any) -> None:
        from harness import provenance
        from harness.results import ResultsFolder
        from harness.rows import RowMaker

        self.order = order
        self.loaded = order.loaded
        self.exp = order.loaded.experiment
        self.folder = ResultsFolder(Path(order.out))
        self.reporter = reporter
        self.log_path = Path(order.log) if order.log else None
        self.rows = RowMaker(self.loaded, order.run_id, provenance.collect())
        #: shared contexts fitted to this engine's tokenizer, by (tokens, text, seed)
        self._contexts: dict[tuple[int, str | None, int], tuple[str, int]] = {}

    def _land(self, cell: Cell, rows: list[dict[str, Any]]) -> None:
        self.folder.write_cell(cell.id, rows, self.order.run_id)

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def _explain(self, exc: BaseException, since: int) -> str:
        """The exception, plus the root causes the engine logged since byte `since` of the log."""
        from harness.rows import describe_exception

        causes = [c for c in root_causes(self.log_path, since) if c not in str(exc)]
        return "; ".join([describe_exception(exc)] + causes)

    def _context(self, engine: Any, cell: Cell) -> tuple[str, int]:
        """The cell's shared context (text, tokens); Unsupported where the engine cannot count tokens."""
        from harness.context import shared_context
        from harness.engines.base import Engine, Unsupported

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

    def _cell(self, engine: Any, cell: Cell, engine_cols: dict[str, Any], probes: Any) -> list[dict[str, Any]]:
        from harness import answers
        from harness.context import with_context
        from harness.engines.base import Unsupported
        from harness.prompts import compose_batch

        sampling = cell.sampling(self.exp.max_tokens, self.exp.unseeded_fillers)
        cache = cell["prefix_cache"]
        prompt_set = self.loaded.prompt_set
        size = cell["batch_size"]
        try:
            context, context_used = self._context(engine, cell)
        except Unsupported as exc:
            return self.rows.status_rows(cell, "unsupported", str(exc))
        except Exception as exc:  # noqa: BLE001 - the tokenizer broke (a server died): this cell fails
            return self.rows.status_rows(cell, "failed", self._explain(exc, self._log_size()))
        warm = compose_batch(prompt_set, prompt_set.prompts[0], size, 0, self.exp.filler_seed)
        since = self._log_size()  # causes logged from here on explain this cell's failures
        try:  # warm-up: first use of a batch shape is not timed
            engine.generate([with_context(context, p.text) for p in warm.prompts], warm.target_position,
                            replace(sampling, max_tokens=2))
        except Exception:  # noqa: BLE001 - the real calls below record what goes wrong
            pass
        rows = []
        for prompt in prompt_set.prompts:
            for repeat in range(self.exp.repeats):
                batch = compose_batch(prompt_set, prompt, size, repeat, self.exp.filler_seed)
                base = self.rows.base(cell, prompt.id, repeat, engine_cols) | {
                    "batch_position": batch.target_position,
                    "filler_ids": list(batch.filler_ids),
                    "context_tokens_used": context_used,
                }
                texts = [with_context(context, p.text) for p in batch.prompts]
                try:
                    if probes is None:
                        out, probe_cols = engine.generate(texts, batch.target_position, sampling, cache=cache), {}
                    else:
                        out, probe_cols = probes.generate(texts, batch.target_position, sampling, cache)
                    found = answers.columns(out.target.text, prompt.answer, prompt.parse)
                    rows.append(self.rows.ok(base, out) | probe_cols | found)
                except Unsupported as exc:  # the engine's declared rules refuse this, before running it
                    rows.append(base | {"status": "unsupported", "error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - recorded, and the matrix goes on
                    rows.append(base | {"status": "failed", "error": self._explain(exc, since)})
                self.reporter.advance(1)
        return rows

    def run(self) -> None:
        from harness.engines import engine_class
        from harness.engines.base import Unsupported
        from harness.probes import LogitProbes

        cells = self.order.cells
        per_cell = len(self.loaded.prompt_set.prompts) * self.exp.repeats
        spec = self.order.group.spec
        self.reporter.log(f"loading {spec.engine} / {spec.model} / {spec.dtype}")
        since = self._log_size()
        try:
            engine = engine_class(spec.engine)(spec, self.reporter.log, self.loaded.base_dir)
        except Exception as exc:  # noqa: BLE001 - a failed load fails its cells, not the run
            message = self._explain(exc, since)
            # Only the engine's own refusal is 'unsupported'; a load that broke (missing or bad
            # file, out of memory, no CUDA) is 'failed', and a rerun tries it again.
            status = "unsupported" if isinstance(exc, Unsupported) else "failed"
            for cell in cells:
                self._land(cell, self.rows.status_rows(cell, status, message))
                self.reporter.advance(per_cell)
            self.reporter.log(f"[{spec.engine}] load {status}: {message}")
            return
        with engine:
            engine_cols = self.rows.engine_columns(engine.describe())
            wanted = self.exp.probe_logits or self.exp.probe_prefill
            probes = LogitProbes(engine, logits=self.exp.probe_logits, prefill=self.exp.probe_prefill) if wanted else None
            for cell in cells:
                self._land(cell, self._cell(engine, cell, engine_cols, probes))


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


def main() -> int:
    """Worker entry: read the work order from stdin, run its cells."""
    order: WorkOrder = pickle.load(sys.stdin.buffer)
    if order.parent_pid:
        watch_parent(order.parent_pid)
    GroupRunner(order, PipeReporter(order.fd)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
