"""`report` and `plot`: a folder's results as one HTML file, or as figures for papers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from harness.cli.common import (
    AllCellsOpt,
    AllowMixedOpt,
    ConfidentOpt,
    NearTieOpt,
    ReferenceOpt,
    ReferenceRunOpt,
    ResultsArg,
    allowed,
    command,
    console,
    open_analysis,
)


@command()
def report(
    results: ResultsArg,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write. Default: RESULTS/report.html."),
    reference: ReferenceOpt = [],
    reference_run: ReferenceRunOpt = "first",
    near_tie: NearTieOpt = None,
    confident: ConfidentOpt = None,
    allow_mixed: AllowMixedOpt = [],
    all_cells: AllCellsOpt = False,
) -> None:
    """One self-contained HTML file: overview, charts, and every run aligned with its reference.

    The first token where a run departs from its reference is highlighted and the shared prefix
    dimmed; filter by engine, batch size, dtype, GPU, batch-invariant mode and prompt. Data and
    script are inside the file: it opens offline, can be mailed or attached to a CI job.
    """
    from harness.analysis.partitions import REPORT_PART_ROWS
    from harness.report import html
    from harness.run.locate import located_by_module, located_steps

    target = out or results / "report.html"
    analysis = open_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie, confident,
                             part_rows=REPORT_PART_ROWS)
    payload = html.write(analysis, target, located_steps(analysis.results), located_by_module(analysis.results))
    console().print(html.summary_line(payload, target))


@command()
def plot(
    results: ResultsArg,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the figures. Default: RESULTS/plots."),
    reference: ReferenceOpt = [],
    reference_run: ReferenceRunOpt = "first",
    near_tie: NearTieOpt = None,
    fmt: list[str] = typer.Option(["png", "svg"], "--format", "-f",
                                  help="png and/or svg (repeatable); csv alone writes only the numbers, drawing nothing."),
    allow_mixed: AllowMixedOpt = [],
    all_cells: AllCellsOpt = False,
) -> None:
    """The report's charts as PNG/SVG files for papers, each with a CSV of the numbers drawn.

    identical (share of runs identical to the reference per setting and batch size), divergence
    (where runs first depart), margins (top-2 margin at the split, reference vs run), slowdown
    (batch-invariant throughput ratio with its range), answers (accuracy per setting with its
    bootstrap interval, where prompts carry answers), splits (where the outputs of a setting and
    prompt part: the runs taking each branch, labelled with its token), survival (the share of runs
    still identical to the reference after t tokens, Kaplan-Meier with a 95% band), flips_by_margin
    (the chance per step that a run departs, by the reference's top-2 margin there), located (where
    `harness locate` traced a pass: each module's largest difference from the reference's pass, in
    the order the pass runs them).
    """
    from harness.report import charts
    from harness.report import plot as plotting
    from harness.run.locate import located_by_module

    for f in fmt:
        allowed("--format", f, tuple(plotting.FORMATS))
    analysis = open_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie)
    data = charts.of_analysis(analysis)
    data.located = located_by_module(analysis.results)
    written, left_out = plotting.write(data, out or results / "plots", tuple(fmt))
    screen = console()
    for path in written:
        screen.print(f"wrote {path}")
    for why in left_out:
        screen.print(f"[yellow]left out[/yellow] {why}")
