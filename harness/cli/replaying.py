"""`replay`: a folder's recorded outputs forced through an engine's decode loop, step by step."""

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
