"""The process that rebuilds forward passes for `harness locate` (harness.run.locate): one per engine
load and environment, started under that environment's interpreter and variables (a kernel path chosen
by `ATEN_CPU_CAPABILITY` is fixed when torch loads, so each side of a comparison is traced in a
process of its own). It reads its job from stdin (pickled: the load, the experiment's folder, the
passes, the folder to write into), traces each pass (Engine.trace) into PASS.bin with its index
PASS.bin.json and the target's log-probabilities PASS.lp.npy, and writes PASS.error where a pass
cannot be traced. Nothing else: the comparison is the parent's.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from pathlib import Path
from typing import Any


def _traced(placed: Any, job: dict[str, Any], out: Path) -> None:
    import numpy as np

    from harness.run.trace_diff import Recording

    for request in job["passes"]:
        key = out / request["key"]
        try:
            recording = Recording(Path(f"{key}.bin"))
            logprobs = placed.engine.trace(request["texts"], request["target"], request["sampling"], request["forced"],
                                           request["step"], recording, request.get("inside"))
            recording.save()
            recording.close()
            np.save(f"{key}.lp.npy", np.asarray(logprobs, dtype=np.float32))
        except Exception as exc:  # noqa: BLE001 - a pass that cannot be traced is said, the others go on
            Path(f"{key}.error").write_text("".join(traceback.format_exception_only(type(exc), exc)).strip())


def main() -> int:
    from harness.run.rescore import PlacedEngine

    job = pickle.loads(sys.stdin.buffer.read())
    out = Path(job["out"])

    class Tracer(PlacedEngine):
        unavailable = "trace_unavailable"

    from harness.engines.registry import engine_class

    # loaded as a replay is: the target is forced its recorded tokens (vLLM: the forcing logits processor)
    spec = engine_class(job["spec"].engine).replay_spec(job["spec"])
    placed = Tracer(spec, job["base"], lambda line: print(line, file=sys.stderr))
    if placed.refusal:
        for request in job["passes"]:
            (out / f"{request['key']}.error").write_text(placed.refusal)
        return 0
    with placed:
        _traced(placed, job, out)
    return 0


if __name__ == "__main__":
    from harness.core.native_preload import ensure_from_argv

    ensure_from_argv()  # before numpy and the rest: a GPU image's own libraries must not load first
    raise SystemExit(main())
