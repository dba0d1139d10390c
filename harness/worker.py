"""The subprocess that runs one engine group: its environment is set before any engine import.

The parent starts `python -m harness.worker JOB` with the engine's environment, reads progress
as JSON lines from a pipe, and afterwards marks every cell the worker did not write as failed,
with the cause (exit code or signal, timeout, the last lines of the worker's log).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class Job:
    experiment: str
    out: str
    group_id: str
    cell_ids: list[str]
    run_id: str
    log: str = ""
    fd: int = -1

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


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


@dataclass
class Outcome:
    """How a worker ended; `cause` is empty when it exited cleanly."""

    returncode: int | None
    cause: str


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


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


def launch(job: Job, env: dict[str, str], log_path: Path, reporter: Any, timeout_s: float | None) -> Outcome:
    """Run a worker to completion, relaying its progress; kill its process group on timeout or Ctrl-C."""
    read_fd, write_fd = os.pipe()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    job = Job(**{**job.__dict__, "fd": write_fd})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.worker", job.to_json()],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,  # one process group: everything it spawns is killed with it
        )
    os.close(write_fd)
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
        _kill(proc)
        raise
    if timed_out:
        _kill(proc)
        return Outcome(proc.returncode, f"timed out after {timeout_s:.0f} s\n{_tail(log_path)}")
    code = proc.wait()
    if code == 0:
        return Outcome(code, "")
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return Outcome(code, f"engine worker {how}\n{_tail(log_path)}".strip())


def _relay(line: bytes, reporter: Any) -> None:
    try:
        event = json.loads(line)
    except ValueError:
        return
    if "advance" in event:
        reporter.advance(int(event["advance"]))
    if "log" in event:
        reporter.log(str(event["log"]))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def main(argv: list[str]) -> int:
    """Worker entry: run the job's cells, each written to the store as soon as it is done."""
    from harness.config import load_experiment
    from harness.matrix import expand, group
    from harness.runner import GroupRunner
    from harness.store import Store

    job = Job(**json.loads(argv[0]))
    reporter = PipeReporter(job.fd)
    loaded = load_experiment(job.experiment)
    wanted = set(job.cell_ids)
    for grp in group(expand(loaded)):
        if grp.id == job.group_id:
            cells = [c for c in grp.cells if c.id in wanted]
            runner = GroupRunner(loaded, Store(Path(job.out)), reporter, job.run_id, Path(job.log) if job.log else None)
            runner.run(grp, cells)
            return 0
    reporter.log(f"group {job.group_id} is not in {job.experiment}; was the file changed during the run?")
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
