"""`harness merge`: several results folders into one, refusing what would mix silently."""

from __future__ import annotations

import filecmp
from pathlib import Path

from harness.core.errors import HarnessError
from harness.results.folder import ResultsFolder


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or filecmp.cmp(a, b, shallow=False)


def _plan(sources: list[ResultsFolder], target: ResultsFolder) -> dict[str, ResultsFolder]:
    """cell id -> the folder to take it from. Done beats not done; done twice (and different) is an error."""
    chosen: dict[str, ResultsFolder] = {p.stem: target for p in target.store.cell_files()}
    # a job array's shards share one experiment: its cells are worked out once, not once a shard
    current: dict[tuple[str, ...], set[str]] = {}
    for source in sources:
        if not source.has_manifest():
            raise HarnessError(f"{source.root}: no results manifest; run it with this harness version first")
        made_by = tuple(e["fingerprint"] for e in source.manifest()["experiments"])
        if made_by not in current:
            current[made_by] = {c.id for c in source.current_cells()}
        for path in source.store.cell_files():
            cell_id = path.stem
            holder = chosen.get(cell_id)
            if cell_id not in current[made_by] or (
                    holder is not None and _same(holder.store.cell_path(cell_id), path)):
                continue
            if holder is None or not holder.store.is_done(cell_id):
                chosen[cell_id] = source
            elif source.store.is_done(cell_id):
                raise HarnessError(
                    f"cell {cell_id} is done in two places: {holder.store.cell_path(cell_id)} and {path}; they "
                    "are two runs of one cell. Remove the one you do not want, then merge again (nothing was copied)"
                )
    return chosen


def merge_folders(sources: list[Path], out: Path, allow_other_experiment: bool) -> tuple[int, int]:
    """Copy the chosen cells into `out` and record the sources' experiments in its manifest; (copied, kept).

    Each cell lands by the folder's landing rule under its lock (ResultsFolder.land_file), as a
    run's rows do: a task still writing into `out` is never overwritten by an older copy, and a
    cell it landed done meanwhile is kept."""
    target = ResultsFolder(out)
    folders = [ResultsFolder(s) for s in sources]
    chosen = _plan(folders, target)
    for folder in folders:  # refuses different experiments before any cell is copied
        target.join(folder, allow_other_experiment)
    copied = 0
    for cell_id, folder in chosen.items():
        if folder is target:
            continue
        source, dest = folder.store.cell_path(cell_id), target.store.cell_path(cell_id)
        if dest.exists() and _same(dest, source):
            continue
        copied += target.land_file(cell_id, source, folder.store.statuses(cell_id)).written
    return copied, len(chosen) - copied
