"""`plan`, `run` and `submit`: an experiment checked, run here, or sent to a cluster."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from harness.cli.common import (
    ReferenceOpt,
    ReferenceRunOpt,
    allowed,
    command,
    console,
    open_analysis,
    open_folder,
)
from harness.core.errors import HarnessError, UsageError, describe_os_error

#: what the summary after a run imports, loaded while the engine worker runs (the summary itself then
#: takes a tenth of a second on a small folder)
SUMMARY_IMPORTS = ("harness.analysis.folder_analysis", "harness.report.table", "harness.experiment.varying",
                   "pyarrow.pandas_compat")


@command()
def plan(
    experiment: Path = typer.Argument(..., help="Experiment YAML file."),
) -> None:
    """Show the cells an experiment expands to and how they share engine loads; runs nothing.

    Below the cells: what every cell has in common, how many generations a run makes, and a power
    table (per divergence rate, the runs and prompts that bound it, and the plan's chance to see one).
    """
    from harness.experiment.config import load_experiment
    from harness.experiment.matrix import expand, group, refuse_ignored
    from harness.report.plan_view import plan_view

    loaded = load_experiment(experiment)
    cells = expand(loaded)
    refuse_ignored(loaded, cells)
    out = console()
    for item in plan_view(loaded, cells, group(cells)):
        out.print(item)


def _experiment_or_folder(path: Path) -> Any:
    """An experiment file, or a results folder whose manifest holds one (array tasks use this)."""
    from harness.experiment.config import load_experiment

    if path.is_dir():
        from harness.results.folder import ResultsFolder  # pyarrow: only for a folder

        folder = ResultsFolder(path)
        if not folder.has_manifest():
            raise HarnessError(f"{path}: a folder without a results manifest; give an experiment YAML file")
        return folder.experiment()
    return load_experiment(path)


@command()
def run(
    ctx: typer.Context,
    experiment: Path = typer.Argument(..., help="Experiment YAML file, or a results folder (runs the experiment it holds)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Results folder (default: results/<name>)."),
    force: bool = typer.Option(False, "--force", help="Redo cells that are already done."),
    reference: ReferenceOpt = [],
    reference_run: ReferenceRunOpt = "first",
    summary: bool = typer.Option(True, "--summary/--no-summary", help="Print the summary table at the end."),
    timeout: Optional[float] = typer.Option(
        None, "--timeout", help="Seconds one engine group may take; past it its unfinished cells are failed."
    ),
    shard: Optional[str] = typer.Option(None, "--shard", help="Run share I of N (0 <= I < N), e.g. 0/4; for array jobs."),
    cells: Optional[str] = typer.Option(None, "--cells", help="Only these cell ids, comma-separated (see 'harness plan')."),
    where: list[str] = typer.Option([], "--where", help="Only cells with AXIS=VALUE (repeatable), e.g. --where gpu=A100."),
    checkpoint_every: float = typer.Option(
        10.0, "--checkpoint-every", min=0, help="Seconds between checkpoints of a running cell's finished batches "
        "(a killed run resumes inside the cell from the last one); 0: after every batch."),
    progress: str = typer.Option("auto", "--progress", help="auto (a bar on a terminal, plain lines in a log or "
                                 "pipe), rich, plain (a line per finished cell and at least one every 30 s), or none "
                                 "(messages only)."),
) -> None:
    """Run an experiment. Finished cells are kept on disk; the same command again resumes.

    Inside a long cell, finished batches are checkpointed (under partial/), so a run killed
    mid-cell (preempted, out of time) resumes from its last checkpoint, without losing or
    doubling a batch.

    Cells that are done (ok, or refused by the engine's rules) are skipped; failed ones and ones
    skipped for want of their GPU type run again. Exit code 0 when no cell ended failed, 1 when one did.
    """
    from harness.report.progress import MODES
    from harness.run.start import RunStart

    allowed("--progress", progress, MODES)
    options = RunOptions(experiment, out, force, reference, reference_run, summary, timeout, shard, cells, where,
                         checkpoint_every, progress)
    begun = ctx.obj if isinstance(ctx.obj, RunStart) else None  # by the `harness` command (harness.cli.entry)
    with begun or RunStart() as start:  # its worker's start overlaps the reading of the experiment
        _run(options, start)


@dataclass(frozen=True)
class RunOptions:
    """`run`'s options, as the command line gave them."""

    experiment: Path
    out: Optional[Path] = None
    force: bool = False
    reference: tuple[str, ...] | list[str] = ()
    reference_run: str = "first"
    summary: bool = True
    timeout: Optional[float] = None
    shard: Optional[str] = None
    cells: Optional[str] = None
    where: tuple[str, ...] | list[str] = ()
    checkpoint_every: float = 10.0
    progress: str = "auto"

    def selection(self) -> Any:
        """The cells asked for: --shard, --cells, --where."""
        from harness.experiment.selection import Selection, parse_shard
        from harness.experiment.settings_args import parse_settings

        return Selection(
            shard=parse_shard(self.shard) if self.shard else None,
            cell_ids=frozenset(c.strip() for c in self.cells.split(",") if c.strip()) if self.cells else None,
            where=parse_settings(list(self.where), "--where"),
        )


def _run(options: RunOptions, start: Any) -> None:
    """The body of `run`, with its start-up (harness.run.start.RunStart) begun."""
    from harness.experiment.matrix import expand, group, refuse_ignored
    from harness.experiment.reference_rules import refuse_reference
    from harness.experiment.selection import apply
    from harness.report.progress import reporter_for

    experiment, reference, reference_run = options.experiment, list(options.reference), options.reference_run
    loaded = _experiment_or_folder(experiment)
    selection = options.selection()
    # refused before the results folder is touched or an engine loads (not after the GPU hours)
    refuse_reference(reference, reference_run, loaded.option_axes)
    all_cells = expand(loaded)
    refuse_ignored(loaded, all_cells)
    chosen = apply(group(all_cells), selection)
    out = options.out or (experiment if experiment.is_dir() else Path("results") / loaded.experiment.name)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: a file, not a folder; name a results folder (new or existing)")
    start.send_ahead(loaded, chosen, out)  # the spare loads it while this process imports pyarrow and adopts
    from harness.results.folder import ResultsFolder
    from harness.run.runner import Runner

    folder = ResultsFolder(out)
    if options.summary:  # the summary's libraries (pandas) load once the engine worker runs
        start.import_once_launched(SUMMARY_IMPORTS)
    screen = console()
    shown = escape(str(out))  # a path is printed as text, whatever brackets it holds
    screen.print(f"[bold]{loaded.experiment.name}[/bold] -> {shown}")
    with reporter_for(options.progress, screen) as reporter:
        runner = Runner(loaded, folder, reporter, group_timeout_s=options.timeout, checkpoint_s=options.checkpoint_every,
                        spare=start.spare)
        adoption = runner.adoption
        if adoption.replaced:
            reporter.log(
                f"note: {out} held another version of experiment(s) {', '.join(adoption.replaced)}; "
                f"{len(adoption.stale)} cell(s) on disk are now stale: kept, listed by 'harness status', left out of "
                "statistics"
            )
        try:
            result = runner.run(force=options.force, selection=selection)
        except KeyboardInterrupt:
            reporter.stop()
            screen.print(f"[yellow]interrupted[/yellow]: {len(folder.store.cell_files())} finished cell(s) are in "
                         f"{shown}; run the same command again to resume")
            raise typer.Exit(130) from None
    counts = ", ".join(f"{v} {k}" for k, v in sorted(result.statuses.items()))
    screen.print(f"ran {len(result.ran)} cell(s) ({counts + ' rows' if counts else 'nothing new'}); "
                 f"{len(result.skipped_done)} already done")
    if options.summary and result.statuses.get("ok", 0) + len(result.skipped_done) > 0:
        _summary_after_run(screen, out, loaded.experiment.name, reference, reference_run)
    if loaded.experiment.rescore and result.ran:
        _rescore_after_run(screen, out, set(result.ran))
    if result.failed:
        screen.print(f"[red]{len(result.failed)} cell(s) failed[/red]: their causes are in 'harness status {shown}'; "
                     "the same command retries them (exit code 1)")
        raise typer.Exit(1)
    skipped = result.statuses.get("skipped", 0)
    if skipped:
        screen.print(f"no cell failed; {skipped} row(s) skipped: their GPU type is not on this machine, and they run "
                     "where it is (exit code 0)")
    else:
        screen.print("every cell run is done (exit code 0)")


def _summary_after_run(screen: Console, out: Path, title: str, reference: list[str], reference_run: str) -> None:
    """The run's summary, printed and saved; one that cannot be made or saved is said, not fatal (the
    run's exit code is the run's)."""
    from harness.cli.statistics import print_summaries

    shown = escape(str(out))
    try:
        analysis = open_analysis(out, reference, reference_run=reference_run)
        print_summaries(screen, title, analysis)
        analysis.save()
        screen.print(f"rows: {shown}/cells/*.parquet   summary: {shown}/summary.parquet")
    except (HarnessError, OSError) as exc:
        why = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        screen.print(f"[yellow]no summary saved[/yellow]: {escape(why)}; the rows are in {shown}/cells "
                     f"(harness summarize {shown} reads them)")


def _rescore_after_run(screen: Console, out: Path, ran: set[str]) -> None:
    """`rescore: true`: the cells this run ran, scored by their own setting (harness.run.rescore); a scorer
    that cannot is said, and the run's exit code stays the run's."""
    from harness.run import rescore as scoring

    try:
        written, refused = scoring.rescore(open_folder(out), log=lambda m: screen.print(escape(m)), cell_ids=ran)
    except (HarnessError, OSError) as exc:
        screen.print(f"[yellow]not rescored[/yellow]: {escape(str(exc))}; 'harness rescore {escape(str(out))}' "
                     "tries again")
        return
    screen.print(f"rescored {len(written)} cell(s): harness rescore {escape(str(out))} --stats-only shows the figures")
    for why in refused:
        screen.print(f"[yellow]not scored[/yellow]: {escape(why)}")


@command()
def submit(
    experiment: Path = typer.Argument(..., help="Experiment YAML file (its 'cluster:' section sets resources)."),
    scheduler: str = typer.Option(..., "--scheduler", "-s", help="slurm or pbs."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Shared results folder (default: results/<name>)."),
    cells: Optional[str] = typer.Option(None, "--cells", help="Only these cell ids (e.g. to resubmit failed ones)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job scripts; write and submit nothing."),
) -> None:
    """Submit the experiment as array jobs: one job per GPU type, one array task per shard.

    The results folder keeps a snapshot of the experiment, and every array task runs that snapshot
    (not the live file), so an edit after submitting cannot mix two versions in one folder.

    Credentials reach the tasks from the environment, never from the snapshot: write them as
    ${NAME} in engine options (http://user:${NAME}@host/v1, --api-key ${NAME}) or use api_key_env,
    reference them in setup lines (export HF_TOKEN="$HF_TOKEN"), and export them before submitting.
    An experiment with a credential written inline is refused, with where it is.
    """
    from harness.experiment.config import load_experiment
    from harness.experiment.matrix import expand, refuse_ignored
    from harness.results.folder import ResultsFolder
    from harness.run import cluster

    allowed("--scheduler", scheduler, cluster.SCHEDULERS)  # before anything is read or adopted
    loaded = load_experiment(experiment)
    refuse_ignored(loaded, expand(loaded))
    cluster.refuse_inline_secrets(loaded)
    out = out or Path("results") / loaded.experiment.name
    ids = [c.strip() for c in cells.split(",") if c.strip()] if cells else None
    screen = console()
    if dry_run:
        for job in cluster.render_jobs(loaded, out, scheduler, ids):
            screen.print(f"[bold]{job.script}[/bold]  ({job.cells} cells, {job.shards} array tasks; not written)")
            sys.stdout.write(job.text + "\n")
        return
    ResultsFolder(out).adopt(loaded)  # the array tasks run this snapshot, not the live file
    jobs = cluster.write_jobs(loaded, out, scheduler, ids)
    for job in cluster.submit(jobs, out):
        screen.print(f"gpu={job.gpu}: job {job.job_id}, {job.shards} array task(s), {job.cells} cells ({job.script})")
    screen.print(f"follow with: harness status {out}")
