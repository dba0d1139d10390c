"""Which cells one `harness run` takes: filters by axis value or cell id, and shards.

A shard is a deterministic share of the cells, computed from the whole experiment (not from
what is done), so every array task of a job agrees on who runs what. What is compared runs in
one task, on one node: an engine load is never split (its batch-1 reference cell and the cells
measured against it stay together), and loads that differ only in batch_invariant (the off/on
twins a slowdown divides) go to the same task. With more shards than such units, the extra
shards get nothing (harness submit asks for no more tasks than there are units).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from harness.core.errors import UsageError
from harness.experiment.matrix import Cell, Group


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
        raise UsageError(f"--shard '{text}': expected I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def _twin_key(grp: Group) -> str:
    """Loads with equal keys are compared with each other (batch-invariant off and on)."""
    spec = grp.spec
    return repr((replace(spec, batch_invariant=False, options={}), sorted(spec.options.items())))


def units(groups: list[Group]) -> list[list[Group]]:
    """The loads that must run in one task, together: each load, with its batch-invariant twin."""
    out: dict[str, list[Group]] = {}
    for grp in groups:
        out.setdefault(_twin_key(grp), []).append(grp)
    return list(out.values())


def shard_of(groups: list[Group], index: int, count: int) -> list[tuple[Group, list[Cell]]]:
    """Greedy balance by cell count over whole units: largest first, each to the least-loaded shard."""
    pieces = sorted((u for u in units(groups) if any(g.cells for g in u)),
                    key=lambda u: (-sum(len(g.cells) for g in u), u[0].cells[0].id if u[0].cells else ""))
    load = [0] * count
    mine: list[Group] = []
    for unit in pieces:
        target = min(range(count), key=lambda k: (load[k], k))
        load[target] += sum(len(g.cells) for g in unit)
        if target == index:
            mine += unit
    order = {g.id: k for k, g in enumerate(groups)}
    return [(g, list(g.cells)) for g in sorted(mine, key=lambda g: order[g.id]) if g.cells]


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
            raise UsageError(f"--cells: not cells of this experiment: {', '.join(unknown)} (see 'harness plan')")
    if selection.where and not kept:
        seen = {k: sorted({str(c[k]) for g in groups for c in g.cells}) for k in selection.where}
        raise UsageError(
            "--where " + " ".join(f"{k}={v}" for k, v in selection.where.items()) + " selects no cell of this "
            "experiment; its values there: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in seen.items()))
    if selection.shard is None:
        return [(g, list(g.cells)) for g in kept]
    return shard_of(kept, *selection.shard)
