"""Why a generation or a load failed: the exception, and the root causes the engine logged.

Engines that start helper processes (vLLM) raise a generic error in the caller and log the real
reason; the worker's log is read from the byte where the failing step began.
"""

from __future__ import annotations

import re
from pathlib import Path

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


def log_size(path: Path | None) -> int:
    return path.stat().st_size if path and path.exists() else 0


def explain(exc: BaseException, log: Path | None, since: int) -> str:
    """The exception, plus the root causes the engine logged since byte `since` of the log."""
    from harness.results.rows import describe_exception

    causes = [c for c in root_causes(log, since) if c not in str(exc)]
    return "; ".join([describe_exception(exc)] + causes)
