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
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from harness.core.native_preload import FLAG
from harness.run.engine_load import EngineLoad, load_engine
from harness.run.group_runner import GroupRunner
from harness.run.work_order import PipeReporter, WorkOrder, secrets_of

PARENT_POLL_S = 0.5


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
