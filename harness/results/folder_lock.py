"""A lock that many nodes can share through one results folder on NFS or Lustre.

`fcntl.flock` is node-local on Lustre mounted with `localflock`, an error with `noflock`, and
unreliable on some NFS mounts; exclusive creation of a file is atomic on all of them (NFSv3
and later, Lustre, local disks). The lock file names its holder (host, pid, time); a holder
that died leaves it behind, so a lock whose holder is a dead process of this host, or that
is older than any update can take, is broken; one waiter at a time breaks it, and only after
reading it again (`_break`), so that no waiter removes a lock that another has just taken.
"""

from __future__ import annotations

import os
import random
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from harness.core.errors import HarnessError

#: an update holds the lock for milliseconds to seconds; a lock this old lost its holder
STALE_AFTER_S = 120.0
#: how long a writer waits for the lock before it gives up with an error that says who holds it
WAIT_AT_MOST_S = 600.0


def _token() -> str:
    return f"{socket.gethostname()} {os.getpid()} {time.time():.3f} {random.getrandbits(32):08x}"


def _holder_dead(token: str) -> bool:
    """True when the token names a process of this host that no longer exists."""
    parts = token.split()
    if len(parts) < 2 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read(path: Path) -> tuple[str, float] | None:
    try:
        return path.read_text(errors="replace").strip(), path.stat().st_mtime
    except OSError:
        return None


#: a breaker holds its own lock for the milliseconds of one check; one this old lost its holder
BREAKER_STALE_S = 30.0


def _break(path: Path, stale: str) -> None:
    """Remove a stale lock, unless it has meanwhile become someone else's.

    Breaking is itself exclusive: only the holder of `path.break` (created with O_EXCL) may remove
    the lock, and only after reading it again and finding the stale token still there. Without
    that, three waiters at one stale lock could end with two of them holding it: one removes the
    stale lock and takes a new one, and a second, acting on what it read before, removes the new one.
    """
    breaker = path.with_name(path.name + ".break")
    try:
        fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        found = _read(breaker)
        if found is not None and time.time() - found[1] > BREAKER_STALE_S:
            breaker.unlink(missing_ok=True)  # a breaker that died in its check
        return  # another waiter is breaking it; try the lock again
    except OSError:
        return
    try:
        os.close(fd)
        found = _read(path)
        if found is not None and found[0] == stale:
            path.unlink(missing_ok=True)
    finally:
        breaker.unlink(missing_ok=True)


@contextmanager
def exclusive(path: Path, wait_s: float = WAIT_AT_MOST_S, stale_s: float = STALE_AFTER_S) -> Iterator[None]:
    """Hold `path` as an exclusive lock across processes and nodes for the `with` block."""
    token = _token()
    deadline = time.monotonic() + wait_s
    pause = 0.002
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            found = _read(path)
            if found is not None:
                held, mtime = found
                if (held and _holder_dead(held)) or time.time() - mtime > stale_s:
                    _break(path, held)
                    continue
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{path}: waited {wait_s:.0f} s for this lock, held by {found[0] if found else '?'}; "
                    "if no harness process uses this folder, remove the file"
                ) from None
            time.sleep(pause * (0.5 + random.random()))
            pause = min(pause * 2, 0.1)
            continue
        except OSError as exc:
            raise HarnessError(f"{path}: cannot create the folder's lock file ({exc.strerror}); "
                               "the results folder must be writable") from None
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(token)
        except OSError:  # a full disk: an empty lock left here would hold every writer up until it is stale
            path.unlink(missing_ok=True)
            raise
        break
    try:
        yield
    finally:
        found = _read(path)
        if found is not None and found[0] == token:
            path.unlink(missing_ok=True)
