"""One engine load inside a worker: the engine, or the error it raised and what the log says of it."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.engines.base import LoadSpec
from harness.run.failure_causes import explain, log_size


@dataclass
class EngineLoad:
    """One engine load's outcome: the engine, or the error it raised and what the log says of it."""

    spec: LoadSpec
    engine: Any = None
    error: Exception | None = None
    message: str = ""
    #: seconds from the engine's construction to its being ready (imports, weights, compile, graph capture)
    seconds: float | None = None


def load_engine(spec: LoadSpec, label: str, reporter: Any, base: Path, log: Path | None) -> EngineLoad:
    """Load the group's engine, as the worker does once; an error is kept, for the cells to say."""
    from harness.core.redaction import expand
    from harness.engines.registry import engine_class

    reporter.log(f"loading {label or spec.label()}")
    package = engine_class(spec.engine).native_package
    if package:  # what a crash in the load is explained with (harness.run.launch)
        from harness.core.native_preload import before_engine_line

        print(before_engine_line(package), file=sys.stderr, flush=True)
    since = log_size(log)
    try:  # `${NAME}` in the options: filled in from this environment, here and nowhere else
        filled = replace(spec, options=expand(spec.options, dict(os.environ), f"engine_options.{spec.engine}"))
        start = time.perf_counter()
        engine = engine_class(spec.engine)(filled, reporter.log, base)
        return EngineLoad(spec, engine=engine, seconds=time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a failed load fails its cells, not the run
        return EngineLoad(spec, error=exc, message=explain(exc, log, since))
