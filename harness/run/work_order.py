"""The work order a worker receives, and how it reports back: everything the parent hands over
(no file is re-read in the child) and the JSON lines the worker sends up its pipe."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from harness.experiment.matrix import Cell, Group
from harness.experiment.schema import LoadedExperiment


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
