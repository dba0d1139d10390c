"""Which cells one `harness run` takes: filters by axis value or cell id, and shards.

A shard is a deterministic share of the cells, computed from the whole experiment (not from
what is done), so every array task of a job agrees on who runs what. Engine loads are kept
whole when there are at least as many loads as shards; only then are large ones split.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from harness.errors import HarnessError
from harness.matrix import Cell, Group


@dataclass(frozen=True)
class Selection:
    shard: tuple[int, int] | None = None  # (index from 0, count)
    cell_ids: frozenset[str] | None = None
    where: dict[str, Any] = field(default_factory=dict)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' with 0 <= I < N (SLURM array ids start at 0; the PBS script subtracts 1)."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not sep or n < 1 or not 0 <= i < n:
        raise HarnessError(f"--shard '{text}': expected I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def _pieces(groups: list[Group], count: int) -> list[tuple[Group, list[Cell]]]:
    pieces = [(g, list(g.cells)) for g in groups if g.cells]
    while len(pieces) < count:
        largest = max(range(len(pieces)), key=lambda k: len(pieces[k][1]), default=None)
        if largest is None or len(pieces[largest][1]) < 2:
            break
        grp, cells = pieces.pop(largest)
        half = (len(cells) + 1) // 2
        pieces[largest:largest] = [(grp, cells[:half]), (grp, cells[half:])]
    return pieces


def shard_of(groups: list[Group], index: int, count: int) -> list[tuple[Group, list[Cell]]]:
    """Greedy balance by cell count: largest pieces first, each to the least-loaded shard."""
    pieces = sorted(_pieces(groups, count), key=lambda p: (-len(p[1]), p[1][0].id))
    load = [0] * count
    mine: list[tuple[Group, list[Cell]]] = []
    for grp, cells in pieces:
        target = min(range(count), key=lambda k: (load[k], k))
        load[target] += len(cells)
        if target == index:
            mine.append((grp, cells))
    order = {g.id: k for k, g in enumerate(groups)}
    return sorted(mine, key=lambda p: (order[p[0].id], p[1][0]["batch_size"]))


def apply(groups: list[Group], selection: Selection) -> list[tuple[Group, list[Cell]]]:
    """The (group, cells) pairs this run takes, in run order."""
    kept: list[Group] = []
    for grp in groups:
        cells = tuple(
            c for c in grp.cells
            if (selection.cell_ids is None or c.id in selection.cell_ids)
            and all(c[k] == v for k, v in selection.where.items())
        )
        if cells:
            kept.append(replace(grp, cells=cells))
    if selection.cell_ids is not None:
        known = {c.id for g in groups for c in g.cells}
        unknown = sorted(selection.cell_ids - known)
        if unknown:
            raise HarnessError(f"--cells: not cells of this experiment: {', '.join(unknown)} (see 'harness plan')")
    if selection.shard is None:
        return [(g, list(g.cells)) for g in kept]
    return shard_of(kept, *selection.shard)
