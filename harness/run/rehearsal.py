"""Doctor's rehearsal of a run: one engine load in a process shaped like a run's worker.

A probe process that holds the engine alone can pass where a run dies: on a GPU node, llama.cpp's
CUDA build crashed in every worker that had imported pyarrow and pandas first (or wrote Parquet
after the engine loaded), while doctor's bare probe ran. So the rehearsal is started as a worker is
(the same interpreter flags, the group's environment, the engine's native preload), imports what a
worker imports in the same order (harness.run.worker.prepare_imports), loads the engine through the
same function, decodes a batch of 2 (one prompt over 128 tokens, the prefill shape that reaches
llama.cpp's AMX and repacked kernels) and writes the outputs to a Parquet file. A crash fails doctor
with the engine's own explanation (Engine.crash_hint), as a run would have failed its cells.

`python -m harness.run.rehearsal [--preload PACKAGE]` reads (spec, base, folder) pickled on stdin
and prints one JSON line: what the load put in force, or {"error": why}.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before anything native loads: the engine's GPU backend, where its build has one
    from harness.core.native_preload import ensure_from_argv

    ensure_from_argv()

import json
import os
import pickle
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from harness.core.native_preload import flag, last_before_engine
from harness.core.process_end import died_of, how_it_ended, signal_word
from harness.core.redaction import redact_text
from harness.engines.base import Finding, LoadSpec
from harness.engines.registry import engine_class

TIMEOUT_S = 600
#: the engine-info fields the finding names (where the engine gives them), and how it names them
SHOWN = {"extra_bufts": "extra_bufts", "cpu_kernels": "CPU kernels:", "native_preload": "native preload"}


class _Quiet:
    """The reporter a worker would send progress to; the rehearsal keeps only the messages."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def _rehearse_here(spec: LoadSpec, base: Path, folder: Path) -> dict[str, Any]:
    from harness.engines.base import Sampling
    from harness.engines.parts.cpu_kernels import PREFILL_TEXT
    from harness.run.engine_load import load_engine
    from harness.run.work_order import secrets_of
    from harness.run.worker import prepare_imports

    prepare_imports()
    import pyarrow as pa
    import pyarrow.parquet as pq

    reporter = _Quiet()
    loaded = load_engine(spec, "", reporter, base, None)
    if loaded.engine is None:
        return {"error": redact_text(loaded.message, secrets_of(spec.options))}
    with loaded.engine as engine:
        out = engine.generate([PREFILL_TEXT, "Name a color."], 0, Sampling(0.0, 1.0, 0, 0, 4))
        info = engine.describe()
    table = pa.table({"token_ids": [out.target.token_ids], "text": [out.target.text]})
    pq.write_table(table, folder / "rehearsal.parquet")
    read = pq.read_table(folder / "rehearsal.parquet").column("token_ids").to_pylist()
    if read != [out.target.token_ids]:
        return {"error": "the Parquet file written did not read back the same tokens"}
    return {"tokens": len(out.target.token_ids)} | {k: str(info[k]) for k in SHOWN if k in info}


def rehearse(spec: LoadSpec, base: Path, env: dict[str, str], timeout_s: float = TIMEOUT_S) -> Finding:
    """Rehearse one load of `spec` under `env` (the group's environment) in a child process: a finding
    that says what ran, or why it failed and what to do."""
    from harness.run.work_order import secrets_of

    cls = engine_class(spec.engine)
    what = spec.label()
    argv = [sys.executable, "-m", "harness.run.rehearsal", *flag(cls.native_package)]
    with tempfile.TemporaryDirectory(prefix="harness-rehearsal-") as tmp:
        log = Path(tmp) / "rehearsal.log"
        try:
            with open(log, "wb") as err:
                done = subprocess.run(argv, input=pickle.dumps((spec, base, Path(tmp))), stdout=subprocess.PIPE,
                                      stderr=err, env={**os.environ, **env}, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Finding(what, f"a rehearsal of a run's worker gave no answer within {timeout_s:.0f} s", False)
        # a log, an error or a hint may quote a credential of the load's options: said only redacted
        text = redact_text(log.read_text(errors="replace"), secrets_of(spec.options))
    answers = [line for line in redact_text(done.stdout.decode(errors="replace"), secrets_of(spec.options)).splitlines()
               if line.startswith("{")]
    answer = json.loads(answers[-1]) if answers else {}
    number = died_of(done.returncode)
    if number is not None:
        hint = cls.crash_hint(spec, signal_word(number), last_before_engine(text))
        return Finding(what, f"a rehearsal of a run's worker (pandas and pyarrow imported, the engine loaded, a "
                             f"batch of 2 decoded, its rows written to Parquet) died of {how_it_ended(done.returncode)}"
                             f"{': ' + hint if hint else ''}", False,
                       "see the cause above; docs/gpu-nodes.md on GPU nodes, docs/troubleshooting.md on CPUs")
    if done.returncode != 0 or "error" in answer or "tokens" not in answer:
        why = answer.get("error") or (text.strip().splitlines() or [how_it_ended(done.returncode)])[-1]
        return Finding(what, f"a rehearsal of a run's worker failed: {why}", False)
    shown = "; ".join(f"{label} {answer[k]}" for k, label in SHOWN.items() if k in answer)
    return Finding(what, f"rehearsed a run's worker here: loaded, decoded a batch of 2, wrote Parquet; {shown}", True)


def main() -> int:
    spec, base, folder = pickle.load(sys.stdin.buffer)
    try:
        answer = _rehearse_here(spec, base, folder)
    except Exception as exc:  # noqa: BLE001 - said as the finding
        from harness.run.work_order import secrets_of

        answer = {"error": redact_text(f"{type(exc).__name__}: {exc}", secrets_of(spec.options))}
    print(json.dumps(answer), flush=True)
    return 0 if "error" not in answer else 1


if __name__ == "__main__":
    sys.exit(main())
