"""`doctor` and `models`: what will really run on this machine, and the model files it has."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from harness.cli.common import allowed, command, console, models_app
from harness.core.errors import UsageError


@command()
def doctor(
    experiment: Optional[Path] = typer.Argument(
        None, help="Experiment YAML file: check what it needs (engines, GPU types, dtypes, batch-invariant mode)."
    ),
    engine: list[str] = typer.Option([], "--engine", "-e", help="Without FILE: probe only these engines (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json."),
) -> None:
    """What will really run on this machine: GPUs, engines and their GPU support, batch-invariant mode.

    Python and harness versions; each engine, whether it imports and its version (llama.cpp's GPU
    offload and backends, llama-server's binary and GPU devices, vLLM's platform and whether
    batch-invariant mode can run); GPUs from the driver (name, memory, compute capability, driver,
    CUDA); SLURM / PBS commands; the cache folder. With FILE: exit 1 when something the experiment
    needs is missing, one line each with how to get it; exit 0 when all is there.
    """
    from harness.engines.registry import engine_names
    from harness.experiment.config import load_experiment
    from harness.report.machine_view import doctor_lines
    from harness.run import doctor as doc

    allowed("--format", fmt, ("table", "json"))
    for name in engine:
        allowed("--engine", name, engine_names())
    if experiment is not None:
        report = doc.check_experiment(load_experiment(experiment))
    else:
        report = doc.collect(tuple(engine) or None)
    if fmt == "json":
        sys.stdout.write(report.as_json() + "\n")
    else:
        screen = console()
        for line in doctor_lines(report, None if experiment is None else str(experiment)):
            screen.print(line)
    if report.missing:
        raise typer.Exit(1)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List named models and whether their files are installed."""
    if ctx.invoked_subcommand is not None:
        return
    from harness.report.machine_view import models_view

    screen = console()
    for item in models_view():
        screen.print(item)


@command(models_app, "export")
def models_export(
    model: str = typer.Argument(..., help="A model name or .gguf path."),
    dtype: str = typer.Option("f16", "--dtype", help="f32, f16 or bf16: every weight matrix stored in this type."),
) -> None:
    """Write the same weights as a GGUF in another dtype (used by the dtype axis of llamacpp)."""
    from harness.experiment.axes import DTYPE_ALIASES
    from harness.models import catalog

    screen = console()
    try:  # the experiment's spellings (float16, fp32, ...) work here too
        path = catalog.gguf_in_dtype(catalog.resolve_gguf(model), DTYPE_ALIASES.get(dtype.lower(), dtype), screen.print)
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None
    screen.print(str(path))
