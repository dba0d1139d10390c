"""The parent's side of a worker process: start it, hand it its work, relay progress, account for how it ended.

The worker gets its work order (the experiment snapshot and its cells) on stdin, so it never
re-reads a YAML file that may have changed. It runs in its own process group, killed whole on
timeout or Ctrl-C; if this process dies, the worker notices and ends itself (harness.run.worker).
"""

from __future__ import annotations

import json
import os
import pickle
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.core.native_preload import flag, last_before_engine
from harness.core.process_end import signal_word
from harness.engines.registry import engine_class
from harness.run.ahead import launch_key
from harness.run.environments import is_foreign, worker_env
from harness.run.spare import SpareWorker, kill_group, serves
from harness.run.work_order import WorkOrder

LOG_TAIL_LINES = 15


@dataclass
class Outcome:
    """How a worker ended; `cause` is empty when it exited cleanly."""

    returncode: int | None
    cause: str


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path) -> str:
    return "\n".join(_read(path).splitlines()[-LOG_TAIL_LINES:])


def launch(order: WorkOrder, env: dict[str, str], reporter: Any, timeout_s: float | None,
           spare: SpareWorker | None = None) -> Outcome:
    """Run a worker to completion (the spare one where given), relaying its progress; kill its process
    group on timeout or Ctrl-C."""
    log_path = Path(order.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    python = order.python or sys.executable
    cls = engine_class(order.group.spec.engine)
    # the spare runs this interpreter, and preloaded at its start what its package needs
    if spare is not None and (is_foreign(order.python) or not serves(cls.native_package)):
        spare.release()
    taken = spare.take(launch_key(env, order.group.spec, order.log, order.loaded.base)) if spare is not None else None
    if taken is not None:
        proc, read_fd, child_fd = taken
    else:
        read_fd, child_fd = os.pipe()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [python, "-m", "harness.run.worker", *flag(cls.native_package)],
                env={**os.environ, **env, **worker_env(order.python)},
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(child_fd,),
                start_new_session=True,  # one process group: everything it spawns is killed with it
            )
        os.close(child_fd)
    order = replace(order, fd=child_fd, parent_pid=os.getpid())
    try:
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((env, order)))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the worker died at start; its exit code and log say why
    deadline = time.monotonic() + timeout_s if timeout_s else None
    timed_out = False
    buffer = b""
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe, selectors.DefaultSelector() as sel:
            sel.register(pipe, selectors.EVENT_READ)
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if wait == 0.0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(wait, 1.0) if wait is not None else 1.0):
                    continue
                chunk = pipe.read(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    _relay(line, reporter)
    except BaseException:
        kill_group(proc)
        raise
    if timed_out:
        kill_group(proc)
        return Outcome(proc.returncode, f"timed out after {timeout_s:.0f} s\n{_tail(log_path)}")
    code = proc.wait()
    if code == 0:
        return Outcome(code, "")
    if code < 0:  # a crash in native code: name the signal and what the engine says to try
        name = signal_word(-code)
        hint = cls.crash_hint(order.group.spec, name, last_before_engine(_read(log_path)))
        return Outcome(code, f"engine worker ({order.group.spec.engine}) killed by signal {name}"
                             f"{'; ' + hint if hint else ''}\n{_tail(log_path)}".strip())
    return Outcome(code, f"engine worker exited with code {code}\n{_tail(log_path)}".strip())


def _relay(line: bytes, reporter: Any) -> None:
    try:
        event = json.loads(line)
    except ValueError:
        return
    if "advance" in event:
        reporter.advance(int(event["advance"]))
    if "cell" in event:
        reporter.cell_done(str(event["cell"]), str(event.get("status", "")))
    if "log" in event:
        reporter.log(str(event["log"]))
