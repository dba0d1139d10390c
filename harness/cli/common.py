"""What every command group shares: the Typer apps, option help texts, the console, and opening a
results folder or its analysis the one way every reader does."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from harness.core.errors import UsageError
from harness.report.plain import wide_console

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
REFERENCE_RUN_HELP = (
    "Which run of the reference setting stands for it, per prompt: 'first' (its first ok run) or 'modal' "
    "(its most frequent output; ties go to the earlier run, and the summary says so in reference_tie). "
    "Token and answer statistics use the same run."
)
NEAR_TIE_HELP = (
    "The top-1 minus top-2 margin (logit or log-probability gap) below which a step is a near tie, for the "
    "near-tie density and flips per near tie. Default 0.1."
)
CONFIDENT_HELP = (
    "The reference's top-1 minus top-2 margin at or above which a departure is a confident flip, a likely bug "
    "rather than rounding (greedy runs only). Default 2.0 nats: top-1 at least 7.4 times as likely as top-2."
)
ALL_CELLS_HELP = (
    "Also read stale cells: cells on disk that the folder's current experiment does not have "
    "(left by an earlier version of it). Off by default, so old results never pool with new ones."
)
ALLOW_MIXED_HELP = (
    "Pair or pool rows even where this differs (repeatable): model_sha256, engine_version, "
    "schema_version, chat_template, host (node, GPU uuid, driver, CUDA). Without it such rows are refused, unless "
    "the compared axis implies it (--reference gpu=... implies host). A slowdown never pairs two machines."
)


# Options several commands share, each declared once (Typer's Annotated style); a command gives the default.
ResultsArg = Annotated[Path, typer.Argument(help="Results folder (from 'harness run').", show_default=False)]
ReferenceOpt = Annotated[list[str], typer.Option("--reference", "-r", help=REFERENCE_HELP)]
ReferenceRunOpt = Annotated[str, typer.Option("--reference-run", help=REFERENCE_RUN_HELP)]
NearTieOpt = Annotated[Optional[float], typer.Option("--near-tie", min=0, help=NEAR_TIE_HELP)]
ConfidentOpt = Annotated[Optional[float], typer.Option("--confident-margin", min=0, help=CONFIDENT_HELP)]
AllowMixedOpt = Annotated[list[str], typer.Option("--allow-mixed", help=ALLOW_MIXED_HELP)]
AllCellsOpt = Annotated[bool, typer.Option("--all-cells", help=ALL_CELLS_HELP)]

def paragraphs(doc: str | None) -> str:
    """A docstring as help text: each paragraph one line, so that the terminal (not the source's line
    breaks) decides where lines end; paragraphs stay apart."""
    text = inspect.cleandoc(doc or "")
    return "\n\n".join(re.sub(r"\s*\n\s*", " ", block).strip() for block in re.split(r"\n\s*\n", text))


def command(group: typer.Typer = app, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a command whose help is its docstring as paragraphs."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        group.command(name, help=paragraphs(fn.__doc__))(fn)
        return fn

    return register


def console() -> Console:
    return wide_console()


def data_console(fmt: str) -> Console:
    """Where messages go: stderr when stdout carries json/csv data, else the usual console."""
    return Console(stderr=True, highlight=False) if fmt != "table" else console()


def allowed(option: str, value: str, choices: tuple[str, ...]) -> None:
    """Refuse an option value outside `choices` as bad input (exit 2), naming what is allowed."""
    if value not in choices:
        raise UsageError(f"{option} '{value}': allowed: {', '.join(choices)}")


def write_frame(frame: Any, fmt: str) -> None:
    """A table of records on stdout as json (15 significant digits) or csv."""
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1, double_precision=15) + "\n")
    else:
        sys.stdout.write(frame.to_csv(index=False))


def print_located(screen: Console, results: Any, fmt: str) -> None:
    """What `harness locate` stored for the folder's cells: a line per traced step, or its records as json / csv."""
    from harness.run.locate import located_steps

    steps = located_steps(results)
    if fmt in ("json", "csv"):
        write_frame(steps, fmt)
    elif steps.empty:
        screen.print("no stored traces for these results (run 'harness locate' first)")
    else:
        for record in steps.to_dict("records"):
            screen.print(f"{escape(record['setting'])} / {escape(record['prompt_id'])} run {record['repeat']}, "
                         f"{record['step_kind']} (step {record['step']}): {escape(record['finding'])}")


def open_folder(folder: Path, all_cells: bool = False) -> Any:
    """The folder's rows as a reader may see them: the current experiment's cells, with a note on
    stderr when stale cells are left out (harness.results.folder)."""
    from harness.results.folder_rows import open_results

    results = open_results(folder, all_cells)
    if results.stale and not all_cells:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]note[/yellow]: {len(results.stale)} stale cell(s) in {escape(str(folder))} left out (not in its "
            "current experiment; see 'harness status'; --all-cells reads them)"
        )
    return results


def open_analysis(folder: Path, reference: list[str], allow_mixed: list[str] = (), all_cells: bool = False,
                  reference_run: str = "first", near_tie: float | None = None,
                  confident: float | None = None, part_rows: int | None = None) -> Any:
    """The folder read against `--reference` and `--reference-run` under `--allow-mixed`
    (harness.analysis.folder_analysis), part by part where it is larger than one part of `part_rows`
    rows (harness.analysis.partitioned; default partitions.PART_ROWS): reading only."""
    from harness.analysis.flips import CONFIDENT
    from harness.analysis.folder_analysis import Analysis
    from harness.analysis.near_ties import NEAR_TIE
    from harness.analysis.partitioned import streamed

    return streamed(Analysis.parsed(open_folder(folder, all_cells), reference, allow_mixed, reference_run,
                                    NEAR_TIE if near_tie is None else near_tie,
                                    CONFIDENT if confident is None else confident), budget=part_rows)


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """While an engine loads and runs, everything written to stdout (its libraries' logs, by Python or
    by child processes) goes to stderr, so that stdout holds only the JSON or CSV asked for."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
