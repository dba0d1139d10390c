"""A worker process started before there is work for it, imported before anything heavy.

`harness run` starts it first thing, so its interpreter start and imports run on the other core
while the parent imports pydantic and pyarrow and reads the experiment. This module imports only
the standard library, so that the spare starts a tenth of a second sooner than it would if it came
with the launcher (harness.run.launch).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading

from harness.core.native_preload import LLAMA_CPP, flag, plan

#: the native package a spare is started for (its GPU backend preloaded, where the build has one): the
#: built-in llama.cpp engine's, which most runs load first
SPARE_PRELOAD = LLAMA_CPP


def serves(package: str | None) -> bool:
    """Whether a spare may serve a load of an engine whose native package is `package` (None: it loads
    none in process): one of that package, or any where the spare had nothing to preload (a CPU-only
    build, or the switch off). A GPU backend preloaded into a vLLM worker is not risked."""
    return package == SPARE_PRELOAD or not plan(SPARE_PRELOAD).libraries


class SpareWorker:
    """A worker process started before there is work for it, so that its interpreter start and the
    harness's imports (pydantic, pyarrow, numpy, the engine modules, pandas: about half a second; see
    harness.run.worker) overlap the parent's reading of the experiment. It imports no engine library
    and sets the group's environment itself when its work order comes, before the engine loads;
    unused, it ends when released. It preloads the llama.cpp build's GPU backend at its start (where
    there is one), so on such a build it serves only launches of engines that load that package (`serves`).
    The parent may send it the first load ahead of the work order
    (`ahead`, harness.run.ahead); then only a launch of that load may take it. Take it once (`take`)."""

    def __init__(self) -> None:
        #: set when a load takes the spare: from then on the parent only waits, and may import meanwhile
        self.taken = threading.Event()
        #: what identifies the load sent ahead (None: none was)
        self.ahead_key: object = None
        self.read_fd, self.write_fd = os.pipe()
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "harness.run.worker", *flag(SPARE_PRELOAD), "--spare", str(os.getpid()),
             str(self.write_fd)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(self.write_fd,), start_new_session=True,
        )
        os.close(self.write_fd)  # the worker holds the only write end: its exit is the pipe's end

    def ahead(self, message: object, key: object) -> None:
        """Have the spare load an engine now, before its work order: `message` is what it loads
        (harness.run.ahead.Ahead), `key` what a launch must match to take the spare."""
        if self.proc is None or self.ahead_key is not None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(pickle.dumps(message))
            self.proc.stdin.flush()
        except OSError:  # it died; a fresh worker will show why
            return
        self.ahead_key = key

    def take(self, key: object = None) -> tuple[subprocess.Popen, int, int] | None:
        """(the process, the pipe's read end here, its write end's number there), once, for a launch
        identified by `key`; None after, or where the spare loads another launch's engine (it is ended)."""
        proc, self.proc = self.proc, None
        self.taken.set()
        if proc is None:
            return None
        if self.ahead_key is not None and self.ahead_key != key:  # its environment is set: useless to others
            kill_group(proc)
        if proc.poll() is not None:  # ended just now, or died before any work (the fresh worker shows why)
            os.close(self.read_fd)
            return None
        return proc, self.read_fd, self.write_fd

    def release(self) -> None:
        """End the spare if it was not taken: its stdin closes, and it exits (killed at once where
        it loads an engine, which may take minutes)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if self.ahead_key is not None or not _ends_at_eof(proc):
            kill_group(proc)
        os.close(self.read_fd)

    def __enter__(self) -> SpareWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _ends_at_eof(proc: subprocess.Popen) -> bool:
    """Close an idle spare's stdin: whether it then exited on its own within 10 s."""
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        return True
    except (OSError, subprocess.TimeoutExpired):
        return False


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a worker's whole process group (it and what it started) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
