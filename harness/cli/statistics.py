"""`summarize`, `rescore`, `compare` and `check`: the statistics of a folder, its re-scoring, two
folders side by side, and the CI gate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

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
    data_console,
    open_analysis,
    open_folder,
    print_located,
    stdout_to_stderr,
    write_frame,
)
from harness.core.errors import HarnessError, UsageError
from harness.report.plain import PlainTable


def print_summaries(screen: Console, title: str, analysis: Any) -> None:
    """The summary table, its verdict lines, and the cost, probe and answer tables where there are any."""
    from harness.report.table import (
        answer_table,
        machine_lines,
        preemption_lines,
        probe_table,
        serving_table,
        slowdown_table,
        summary_table,
        verdict_lines,
    )

    summary, cost, probes, answers = analysis.summary, analysis.slowdown, analysis.probes, analysis.answers
    screen.print(summary_table(summary, f"{title} (reference: {summary['reference'].iloc[0]})"))
    for line in (verdict_lines(summary, analysis.by_setting) + machine_lines(summary) + preemption_lines(summary)
                 + analysis.notes):
        screen.print(line)
    if not cost.empty:
        screen.print(slowdown_table(cost, "batch-invariant mode: cost (off / on, median and range over paired runs)"))
        serving = serving_table(cost, "batch-invariant mode: serving latency over the same pairs (TTFT, ITL, TPOT, "
                                      "E2EL; docs/rows.md#latency)")
        if serving is not None:
            screen.print(serving)
    if not probes.empty:
        screen.print(probe_table(probes, "logit probes: against the same prompt decoded alone, while the prefix is shared"))
    if not answers.empty:
        screen.print(answer_table(answers, "answers: agreement over repeats, accuracy (bootstrap 95% CI over prompts), "
                                           "change against the reference"))


@command()
def summarize(
    results: ResultsArg,
    reference: ReferenceOpt = [],
    reference_run: ReferenceRunOpt = "first",
    near_tie: NearTieOpt = None,
    confident: ConfidentOpt = None,
    fmt: str = typer.Option("table", "--format", "-f", help="table, json or csv (json/csv go to stdout)."),
    what: str = typer.Option(
        "cells", "--what",
        help="With json/csv: 'cells' (per cell and prompt), 'settings' (per setting: divergence rate and its "
             "bounds, median tokens to divergence, near ties), 'slowdown' (batch-invariant cost), 'probes' (logit "
             "probes), 'latency' (per setting: TTFT, ITL, TPOT, E2EL at p50/p90/p99 and their ratios against the "
             "reference setting; also as a table), 'answers' (answer agreement and accuracy per setting), "
             "'survival' (share still identical "
             "after t tokens), 'flips_by_margin' (departures per step by margin bucket) or 'flips' (each departed run "
             "with the reference's margin where it split and its flip class). 'splits': where the "
             "outputs of each cell and prompt part, with how many runs take each branch (also as a table). "
             "'locate': what 'harness locate' found, the first operation whose output differs for each traced "
             "step (also as a table).",
    ),
    allow_mixed: AllowMixedOpt = [],
    all_cells: AllCellsOpt = False,
    save: bool = typer.Option(False, "--save", help="Also write summary.parquet, settings.parquet, slowdown.parquet "
                              "(and probes, answers, survival, flips_by_margin, flips where there are any) into the "
                              "results folder, as 'harness run' does."),
) -> None:
    """Statistics per cell and prompt: unique outputs, match rate vs the reference, first divergence; and,
    where cells differ only in batch_invariant, what the mode costs.

    Reads only: the folder may be read-only (unless --save).
    """
    from harness.analysis.folder_analysis import TABLES

    allowed("--format", fmt, ("table", "json", "csv"))
    allowed("--what", what, tuple(TABLES) + ("latency", "splits", "locate"))
    if what == "locate":
        print_located(data_console(fmt), open_folder(results, all_cells), fmt)
        return
    if what == "splits":
        _print_splits(open_analysis(results, [], all_cells=all_cells), str(results), fmt)
        return
    analysis = open_analysis(results, reference, allow_mixed, all_cells, reference_run, near_tie, confident)
    if save:
        analysis.save()
    if what == "latency":  # read only when asked: it reads every run's inter-token gaps
        _print_latency(analysis, fmt)
    elif fmt in ("json", "csv"):
        write_frame(analysis.table(what), fmt)
    else:
        print_summaries(console(), str(results), analysis)


def _print_latency(analysis: Any, fmt: str) -> None:
    from harness.report.table import latency_table

    frame = analysis.latency
    if fmt in ("json", "csv"):
        write_frame(frame, fmt)
    else:
        reference = ",".join(f"{k}={v}" for k, v in analysis.reference.items())
        console().print(latency_table(frame, f"serving latency per setting (ms) and its ratio to the reference setting "
                                             f"({reference}); docs/rows.md#latency"))


def _print_splits(analysis: Any, folder: str, fmt: str) -> None:
    from harness.analysis.splits import folder_splits
    from harness.report.table import split_table

    frame = folder_splits(analysis)
    if fmt in ("json", "csv"):
        write_frame(frame, fmt)
    elif frame.empty:
        console().print("every cell and prompt gave one output: nothing splits")
    else:
        console().print(split_table(frame, f"{folder}: where the outputs split (branch 0 = most runs)"))


@command()
def rescore(
    results: ResultsArg,
    engine: Optional[str] = typer.Option(None, "--engine", help="Score with this engine instead of each run's own "
                                         "(llamacpp or vllm; others refuse)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Score with the model in this dtype instead of the "
                                        "run's (e.g. f32, to measure what a quantised decode departs from)."),
    threshold: float = typer.Option(0.18, "--threshold", min=0, help="|delta logprob| in nats beyond which a "
                                    "token counts in share_above (0.18: a probability ratio of 1.2)."),
    stats_only: bool = typer.Option(False, "--stats-only", help="Show the figures of scores already stored; score nothing."),
    force: bool = typer.Option(False, "--force", help="Score again cells this scorer has scored already."),
    any_device: bool = typer.Option(False, "--any-device", help="Score runs that ran on a GPU this machine lacks "
                                    "here anyway (by default they are refused: this machine's CPU would define "
                                    "their noise)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, or json / csv per scorer, cell and prompt."),
    all_cells: AllCellsOpt = False,
) -> None:
    """Prefill each ok run's prompt + output in one pass, alone and without a cache, and compare the
    log-probability the scorer gives each generated token with the one decoding gave it: mean and max
    |delta|, the k3 KL estimate and the share of tokens beyond --threshold.

    The scorer is the run's own engine, model and dtype unless --engine or --dtype says otherwise;
    scores are stored in RESULTS/rescored/ (the rows are not touched), so the figures can be read
    again with --stats-only.
    """
    from harness.experiment.settings_args import parse_settings
    from harness.run import rescore as scoring

    allowed("--format", fmt, ("table", "json", "csv"))
    # bad values are refused before anything loads
    parse_settings([f"{a}={v}" for a, v in (("engine", engine), ("dtype", dtype)) if v], "--engine/--dtype")
    found = open_folder(results, all_cells)
    screen = data_console(fmt)  # stdout holds the data
    if not stats_only:
        with stdout_to_stderr(fmt != "table"):
            written, refused = scoring.rescore(found, engine, dtype, log=lambda m: screen.print(escape(m)), force=force,
                                               any_device=any_device)
        if written:
            screen.print(f"wrote {len(written)} score file(s) under {escape(str(written[0].parent.parent))}")
        for why in refused:
            screen.print(f"[yellow]not scored[/yellow]: {escape(why)}")
    frame = scoring.summary(found, threshold)
    if fmt in ("json", "csv"):
        write_frame(frame, fmt)
    elif frame.empty:
        screen.print("no stored scores for these results (run 'harness rescore' without --stats-only)")
    else:
        from harness.report.table import rescore_table

        screen.print(rescore_table(frame, threshold))


def _op_maps(a: Path, b: Path, fmt: str) -> None:
    """`compare MAP_A MAP_B`: two nodes' op maps (from `doctor --ops`) side by side."""
    from harness.analysis import op_maps
    from harness.report.op_view import compare_view

    if not (op_maps.is_op_map(a) and op_maps.is_op_map(b)):
        raise UsageError(f"compare takes two results folders or two op maps (.parquet from 'harness doctor --ops'); "
                         f"got {a} and {b}")
    first, second = op_maps.read(a), op_maps.read(b)
    pairs = op_maps.side_by_side(first, second)
    if fmt in ("json", "csv"):
        write_frame(pairs, fmt)
        return
    screen = console()
    for item in compare_view(pairs, first, second, str(a), str(b)):
        screen.print(item)


@command()
def compare(
    a: Path = typer.Argument(..., help="First results folder (e.g. from an A100 node)."),
    b: Path = typer.Argument(..., help="Second results folder (e.g. from an L40S node)."),
    ignore: list[str] = typer.Option(["gpu"], "--ignore", help="Axes allowed to differ between A and B (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, json or csv (json/csv: one record per run)."),
    allow_mixed: AllowMixedOpt = [],
    all_cells: AllCellsOpt = False,
    score: bool = typer.Option(False, "--score", help="Judge B against A's own noise: every run of both re-scored "
                               "by A's setting (llamacpp, vllm), mean |delta logprob| of B's runs against A's "
                               "repeats and batch sizes, with a permutation p-value (harness.analysis.noise_floor)."),
    gate: bool = typer.Option(False, "--gate", help="With --score: exit 1 when B is beyond A's noise in any "
                              "setting (an engine upgrade or a provider that must stay within it)."),
    any_device: bool = typer.Option(False, "--any-device", help="With --score: score A's runs here even where they "
                                    "ran on a GPU this machine lacks."),
    a_where: list[str] = typer.Option([], "--a-where", help="Read only A's cells with this setting, AXIS=VALUE "
                                      "(repeatable). With --b-where, one folder can be both A and B: "
                                      "'compare F F --a-where environment=current --b-where environment=old "
                                      "--ignore environment' sets two engine environments side by side."),
    b_where: list[str] = typer.Option([], "--b-where", help="Read only B's cells with this setting (repeatable)."),
) -> None:
    """Per prompt and matching setting: same or different between two folders, and where they split.

    Given two op maps (Parquet files from 'harness doctor --ops') instead, it shows both nodes'
    op-level batch invariance side by side, cell by cell, and lists where they disagree.

    Runs are paired on every axis except the ignored ones. Pairs made with another model file,
    engine version, row schema or chat template are refused (a library upgrade would read as a
    GPU difference) unless --allow-mixed names it. Everything else that differs between the
    folders (host, GPU, driver, CUDA, library versions) is printed above the table.
    """
    from harness.analysis.compare import compare as run_compare
    from harness.analysis.mixing import parse_allow_mixed
    from harness.analysis.op_maps import is_op_map
    from harness.experiment.schema import option_axis
    from harness.experiment.settings_args import parse_settings
    from harness.results.columns import KEY_COLUMNS

    allowed("--format", fmt, ("table", "json", "csv"))
    if is_op_map(a) or is_op_map(b):
        _op_maps(a, b, fmt)
        return
    for axis in ignore:
        if axis not in KEY_COLUMNS and option_axis(axis) is None:
            raise UsageError(f"--ignore '{axis}': allowed: {', '.join(KEY_COLUMNS)}, or ENGINE.OPTION")
    if gate and not score:
        raise UsageError("--gate judges the noise floor: give --score too")
    side_a = open_folder(a, all_cells).restricted(parse_settings(a_where, "--a-where"), "--a-where")
    side_b = open_folder(b, all_cells).restricted(parse_settings(b_where, "--b-where"), "--b-where")
    if score:
        _noise_floor(side_a, side_b, tuple(ignore), fmt, gate, any_device)
        return
    result = run_compare(side_a, side_b, tuple(ignore), parse_allow_mixed(allow_mixed))
    if fmt in ("json", "csv"):
        write_frame(result.runs, fmt)
        return
    from harness.report.compare_view import compare_view

    screen = console()
    for item in compare_view(result, str(a), str(b), tuple(ignore)):
        screen.print(item)
    from harness.run.locate import across

    traced = across(side_a, side_b, tuple(ignore))  # where both folders hold `harness locate` traces
    if traced:
        screen.print("where the traced forward passes part (harness locate's digests, op by op):")
    for line in traced:
        screen.print(f"  {escape(line)}")


def _noise_floor(a: Any, b: Any, ignore: tuple[str, ...], fmt: str, gate: bool, any_device: bool) -> None:
    """`compare --score`: one verdict per setting, as lines or records; exit 1 under --gate when one is beyond."""
    from harness.analysis import noise_floor
    from harness.report.compare_view import noise_floor_lines
    from harness.run.noise_scoring import score_settings

    screen = data_console(fmt)
    with stdout_to_stderr(fmt != "table"):
        keys, scored = score_settings(a, b, ignore, log=lambda m: screen.print(escape(m)), any_device=any_device)
        frame = noise_floor.judge(scored, keys)
    if fmt in ("json", "csv"):
        write_frame(frame, fmt)
    else:
        for line in noise_floor_lines(frame):
            screen.print(line)
    if frame.empty:
        raise HarnessError("no setting of B matches one of A: nothing was judged (see --ignore)")
    if gate and not noise_floor.all_within(frame):
        raise typer.Exit(1)


@command()
def check(
    results: ResultsArg,
    expect: Optional[Path] = typer.Option(None, "--expect",
                                          help="A YAML file with an 'expect:' list (default: the experiment's)."),
    reference: ReferenceOpt = [],
    reference_run: ReferenceRunOpt = "first",
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write the verdicts as JUnit XML."),
    allow_mixed: AllowMixedOpt = [],
    all_cells: AllCellsOpt = False,
    fmt: str = typer.Option("table", "--format", "-f", help="table or json ({passed, verdicts: [{rule, passed, "
                            "detail}]} on stdout; the exit code is the same)."),
) -> None:
    """Gate CI on determinism and cost: exit 0 when every expectation holds, 1 when one fails, 2 on bad rules.

    A rule fails when it matches no cell, when one of its conditions judges nothing (no compared
    runs, no paired timings), when a cell it selects never ran or was skipped (unless the rule says
    allow_missing: true), was refused by its engine (unless allow_unsupported: true; the verdict
    lists each refusal's reason), or when a run it selects failed (unless allow_failed: true).
    """
    from harness.analysis import gate
    from harness.experiment.config import load_expectations

    allowed("--format", fmt, ("table", "json"))
    rules = load_expectations(expect) if expect is not None else None
    verdicts = gate.check_folder(open_analysis(results, reference, allow_mixed, all_cells, reference_run), rules)
    passed = all(v.passed for v in verdicts)
    if fmt == "json":
        record = {"folder": str(results), "passed": passed,
                  "verdicts": [{"rule": v.rule, "passed": v.passed, "detail": v.detail} for v in verdicts]}
        sys.stdout.write(json.dumps(record, indent=1) + "\n")
    else:
        table = PlainTable(title=f"{results}: expectations")
        for col in ("rule", "verdict", "detail"):
            table.add_column(col)
        for v in verdicts:
            table.add_row(v.rule, Text("pass", style="green") if v.passed else Text("FAIL", style="red"), v.detail)
        console().print(table)
    if junit is not None:
        gate.write_junit(junit, verdicts, f"harness-check {results.name}")
    if not passed:
        raise typer.Exit(1)
