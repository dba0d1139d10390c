"""Ask a child Python for facts about an engine library, so that a library that crashes on import
(or a llama.cpp build that dies on this CPU) cannot take the asking process down."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def probe_in_child(code: str, timeout_s: float, args: tuple[str, ...] = (),
                   preload: str | None = None) -> dict[str, Any]:
    """Run `code` in a child Python (with `args` as sys.argv[1:]) that prints one JSON object; that
    object, or {'error': why}. `preload`: the package whose GPU backend the child preloads before the
    code runs (harness.core.native_preload), as every process that loads it must."""
    if preload:
        code = f"from harness.core.native_preload import ensure\nensure({preload!r})\n{code}"
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s)
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
