"""`status` and `merge`: what a results folder holds, and several folders made one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from harness.cli.common import ResultsArg, allowed, command, console
from harness.core.errors import UsageError


@command()
def status(
    results: ResultsArg,
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
    from harness.experiment.config import load_experiment
    from harness.experiment.matrix import expand
    from harness.report.status_view import status_view
    from harness.results.folder import ResultsFolder
    from harness.results.status import folder_status

    allowed("--format", fmt, ("table", "json"))
    cells = expand(load_experiment(experiment)) if experiment is not None else None
    found = folder_status(ResultsFolder(results), cells)
    if ids is not None:
        sys.stdout.write(",".join(found.ids({s.strip() for s in ids.split(",")})) + "\n")
    elif fmt == "json":
        sys.stdout.write(json.dumps(found.record(str(results)), indent=1, default=str) + "\n")
    else:
        screen = console()
        for item in status_view(found, str(results)):
            screen.print(item)


@command()
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
    from harness.results.merge import merge_folders

    if any(a.strip() != "experiment" for item in allow_mixed for a in item.split(",")):
        raise UsageError(f"--allow-mixed {', '.join(allow_mixed)}: merge allows only 'experiment'")
    copied, kept = merge_folders(sources, out, allow_other_experiment=bool(allow_mixed))
    console().print(f"{copied} cell(s) copied into {out}; {kept} already there")
