"""Ask a child Python for facts about an engine library, so that a library that crashes on import
(or a llama.cpp build that dies on this CPU) cannot take the asking process down."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def probe_in_child(code: str, timeout_s: float) -> dict[str, Any]:
    """Run `code` in a child Python that prints one JSON object; that object, or {'error': why}."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": tail[:300]}
    for line in reversed(lines):  # a library may print lines of its own that look like JSON
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            return answer
    return {"error": f"the probe's answer is not JSON: {lines[-1][:200]!r}"}
