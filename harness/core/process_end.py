"""How a child process ended, in words: engines, servers and probes all die the same few ways.

A process killed by signal N reads as return code -N from Python, and as 128 + N from a shell that
ran it without `exec` (a site's wrapper script around llama-server, say); both are the same crash.
"""

from __future__ import annotations

import signal


def died_of(returncode: int) -> int | None:
    """The signal a process died of, or None when it exited on its own."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + signal.NSIG:
        return returncode - 128
    return None


def signal_word(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def how_it_ended(returncode: int) -> str:
    """'SIGILL', 'SIGSEGV (exit code 139, through a shell)', 'exit code 1'."""
    number = died_of(returncode)
    if number is None:
        return f"exit code {returncode}"
    name = signal_word(number)
    return name if returncode < 0 else f"{name} (exit code {returncode}, through a shell)"
