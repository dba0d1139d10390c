"""`replay`: a folder's recorded outputs forced through an engine's decode loop, step by step; `locate`: the
first operation whose output differs between a run and its reference."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from harness.cli.common import (
    AllCellsOpt,
    ResultsArg,
    allowed,
    command,
    data_console,
    open_folder,
    print_located,
    stdout_to_stderr,
    write_frame,
)


@command()
def replay(
    results: ResultsArg,
    engine: Optional[str] = typer.Option(None, "--engine", help="Replay with this engine instead of each run's own "
                                         "(llamacpp; the others refuse with the reason)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Replay with the model in this dtype (e.g. f32: where "
                                        "would the F32 weights have left a Q4_1 run?)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, max=1024, help="Replay each run in a batch "
                                             "of this size, composed as a run of that size would be (1: alone). "
                                             "Default: the run's own batch-mates, at its own position."),
    stats_only: bool = typer.Option(False, "--stats-only", help="Show the figures of replays already stored; replay nothing."),
    per_run: bool = typer.Option(False, "--per-run", help="With json/csv: one record per replayed run, not per cell and prompt."),
    force: bool = typer.Option(False, "--force", help="Replay again cells this replayer has replayed already."),
    any_device: bool = typer.Option(False, "--any-device", help="Replay runs that ran on a GPU this machine lacks here anyway."),
    where: list[str] = typer.Option([], "--where", help="Replay only the cells with this setting, AXIS=VALUE "
                                    "(repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, or json / csv per replayer, cell and prompt."),
    all_cells: AllCellsOpt = False,
) -> None:
    """Feed every recorded token of each ok run back through a decode loop, under the run's own setting or
    another, and compare the whole output with the source, not only up to the first split.

    Per step the replayer gives the forced token's log-probability, its top-1/top-2 margin and the
    token it would have picked itself. Per run: mean and max |delta logprob| against the recorded
    decode, the k3 KL estimate, and the steps where the replayer's argmax differs from the forced
    token ('would have split here'). Replays are stored in RESULTS/replayed/ (the rows are not
    touched): read them again with --stats-only.
    """
    from harness.experiment.settings_args import parse_settings
    from harness.report.replay_view import replay_table
    from harness.run import replay as replaying

    allowed("--format", fmt, ("table", "json", "csv"))
    parse_settings([f"{a}={v}" for a, v in (("engine", engine), ("dtype", dtype)) if v], "--engine/--dtype")
    found = open_folder(results, all_cells).restricted(parse_settings(where, "--where"), "--where")
    screen = data_console(fmt)
    if not stats_only:
        with stdout_to_stderr(fmt != "table"):
            written, refused = replaying.replay(found, engine, dtype, batch_size, log=lambda m: screen.print(escape(m)),
                                                force=force, any_device=any_device)
        if written:
            screen.print(f"wrote {len(written)} replay file(s) under {escape(str(written[0].parent.parent))}")
        for why in refused:
            screen.print(f"[yellow]not replayed[/yellow]: {escape(why)}")
    frame = replaying.per_run(found) if per_run else replaying.summary(found)
    if fmt in ("json", "csv"):
        write_frame(frame, fmt)
    elif frame.empty:
        screen.print("no stored replays for these results (run 'harness replay' without --stats-only)")
    else:
        screen.print(replay_table(replaying.summary(found)))


@command()
def locate(
    results: ResultsArg,
    step: str = typer.Option("both", "--step", help="Which forward pass to rebuild: prefill, split (the step where "
                             "the run split from its reference), or both."),
    stats_only: bool = typer.Option(False, "--stats-only", help="Show the findings already stored; trace nothing."),
    any_device: bool = typer.Option(False, "--any-device", help="Trace runs that ran on a GPU this machine lacks here anyway."),
    where: list[str] = typer.Option([], "--where", help="Locate only the cells with this setting, AXIS=VALUE (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, or json / csv: one record per traced step."),
    all_cells: AllCellsOpt = False,
) -> None:
    """Say why runs split: the first operation whose output differs between a run and its reference.

    For each setting whose runs moved against their reference (tokens, or a log-probability not
    bitwise equal), one run and its reference run are rebuilt forward pass by forward pass exactly
    as they ran (the same batch-mates, padding, positions, load and environment), at the prefill and
    at the step where the run split, and every module's output on the run's own elements is compared:
    the first module that differs is named with the one before it that agreed, then every torch function
    inside the module that holds it (where the two passes call different kernels, both are named). On
    llama.cpp every tensor of the compute graph is compared, by its graph name (attn_norm-0, Qcur-0,
    ffn_out-0, result_output), on the run's own token column. A rebuilt pass whose log-probability is
    not bitwise the row's names nothing: "could not rebuild this step". Traces land in RESULTS/located/
    (per op, with digests for `harness compare` across machines) and RESULTS/located_steps/ (per step).
    Engines: transformers (padded batching), llamacpp and vllm (a load with enforce_eager: true,
    hooks in vLLM's own model worker); the others refuse with the reason.
    """
    from harness.analysis.divergence import earliest_moved
    from harness.analysis.folder_analysis import Analysis
    from harness.experiment.settings_args import parse_settings
    from harness.experiment.varying import varying
    from harness.run import locate as locating

    allowed("--format", fmt, ("table", "json", "csv"))
    allowed("--step", step, ("prefill", "split", "both"))
    found = open_folder(results, all_cells).restricted(parse_settings(where, "--where"), "--where")
    screen = data_console(fmt)
    if not stats_only:
        kinds = locating.STEP_KINDS if step == "both" else (step,)
        analysis = Analysis(found)
        moved, keys = earliest_moved(analysis.compared), varying(analysis.compared, analysis.setting_keys) or ["engine"]
        with stdout_to_stderr(fmt != "table"):
            written, refused = locating.locate(found, moved, keys, kinds, log=lambda m: screen.print(escape(m)),
                                               any_device=any_device)
        if written:
            screen.print(f"wrote {len(written)} trace file(s) under {escape(str(written[0].parent.parent.parent))}")
        for why in refused:
            screen.print(f"[yellow]not located[/yellow]: {escape(why)}")
    print_located(screen, found, fmt)
