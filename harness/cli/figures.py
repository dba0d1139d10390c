"""`report` and `plot`: a folder's results as one HTML file, or as figures for papers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from harness.cli.common import (
    ALL_CELLS_HELP,
    ALLOW_MIXED_HELP,
    CONFIDENT_HELP,
    NEAR_TIE_HELP,
    REFERENCE_HELP,
    REFERENCE_RUN_HELP,
    allowed,
    command,
    console,
    open_analysis,
)


@command()
def report(
    results: Path = typer.Argument(..., help="Results folder (from 'harness run')."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write. Default: RESULTS/report.html."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    near_tie: Optional[float] = typer.Option(None, "--near-tie", min=0, help=NEAR_TIE_HELP),
    confident: Optional[float] = typer.Option(None, "--confident-margin", min=0, help=CONFIDENT_HELP),
    allow_mixed: list[str] = typer.Option([], "--allow-mixed", help=ALLOW_MIXED_HELP),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
) -> None:
    """One self-contained HTML file: overview, charts, and every run aligned with its reference.

    The first token where a run departs from its reference is highlighted and the shared prefix
    dimmed; filter by engine, batch size, dtype, GPU, batch-invariant mode and prompt. Data and
    script are inside the file: it opens offline, can be mailed or attached to a CI job.
    """
    from harness.report import html

    target = out or results / "report.html"
    payload = html.write(open_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie, confident),
                         target)
    console().print(html.summary_line(payload, target))


@command()
def plot(
    results: Path = typer.Argument(..., help="Results folder (from 'harness run')."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the figures. Default: RESULTS/plots."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    near_tie: Optional[float] = typer.Option(None, "--near-tie", min=0, help=NEAR_TIE_HELP),
    fmt: list[str] = typer.Option(["png", "svg"], "--format", "-f",
                                  help="png and/or svg (repeatable); csv alone writes only the numbers, drawing nothing."),
    allow_mixed: list[str] = typer.Option([], "--allow-mixed", help=ALLOW_MIXED_HELP),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
) -> None:
    """The report's charts as PNG/SVG files for papers, each with a CSV of the numbers drawn.

    identical (share of runs identical to the reference per setting and batch size), divergence
    (where runs first depart), margins (top-2 margin at the split, reference vs run), slowdown
    (batch-invariant throughput ratio with its range), answers (accuracy per setting with its
    bootstrap interval, where prompts carry answers), splits (where the outputs of a setting and
    prompt part: the runs taking each branch, labelled with its token), survival (the share of runs
    still identical to the reference after t tokens, Kaplan-Meier with a 95% band), flips_by_margin
    (the chance per step that a run departs, by the reference's top-2 margin there).
    """
    from harness.report import charts
    from harness.report import plot as plotting

    for f in fmt:
        allowed("--format", f, tuple(plotting.FORMATS))
    data = charts.of_analysis(open_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie))
    written, left_out = plotting.write(data, out or results / "plots", tuple(fmt))
    screen = console()
    for path in written:
        screen.print(f"wrote {path}")
    for why in left_out:
        screen.print(f"[yellow]left out[/yellow] {why}")
