"""A folder's cells cut into closed parts, so that a campaign's statistics are computed part by part
with no part needing another's rows.

Every statistic relates a run to runs of its own setting, of its reference setting (the same
settings but the `--reference` axes) or of its batch-invariant twin (`slowdown`), always of the same
prompt. So the cells whose settings are equal but for the reference axes and batch_invariant form a
closed unit, and so does any set of prompts within it: every comparison a part makes finds its
reference runs inside the part. Units are packed into parts of about `budget` rows; a unit larger
than that (a batch-size sweep, a reference-axis sweep) is cut into parts of its prompts, each part all
of the unit's cells restricted to some of its prompts; a single prompt larger than `budget` (1000
repeats of one prompt at batch 1 to 64) is cut by its runs, each part carrying the runs that stand
for their cells (the reference runs, chosen over all runs of the prompt first).
The tables are computed from the parts' per-run and per-prompt pieces
(harness.analysis.partitioned), so cutting a setting's prompts apart changes no figure. A cell's axes
and rows come from its own file (its first row and footer), current and stale cells alike, by
one definition (`unit_key`). Engine options and max_tokens are left out of a unit's key: a unit
may be larger than it needs to be, never smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.experiment.axes import AXES
from harness.results.folder_rows import Results

#: rows a part holds: a part's statistics take about 1.3 KB a row in pandas, so a worker process
#: stays near 400-600 MB (docs/measured.md, "Ten million rows on a login node")
PART_ROWS = 250_000
#: rows a part holds when the report reads it: its pass computes the statistics and the report's
#: chart data and run entries together, and pandas's fixed cost per call is paid per part: parts of
#: 500,000 rows took 12 % less time than twice 250,000 on a 10M-row campaign, at about 1.1 GB per
#: worker (docs/measured.md, "Ten million rows on a login node")
REPORT_PART_ROWS = 500_000
#: axes that pair cells of different settings besides the reference axes (metrics.slowdown)
PAIRING_AXES = ("batch_invariant",)


def _canonical(value: Any) -> Any:
    """One spelling of an axis value, however it was read: numbers as floats (an experiment's 0 and a
    row's 0.0 are one temperature), missing values (None, NaN) as None, anything else as text. Two
    values the statistics' joins take as equal always get one spelling: a key may be coarser than the
    joins, never finer."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


def unit_key(setting: dict[str, Any], reference: dict[str, Any]) -> tuple:
    """The closed unit of a cell whose first row holds `setting`: its fixed axes but the reference
    and pairing axes (left out by name, so no value of the reference is compared here), each value
    canonical. Swept engine options and max_tokens are left out too: cells the statistics relate
    are equal in every key the joins use, so they are equal in these."""
    return tuple((axis, _canonical(setting.get(axis))) for axis in AXES
                 if axis not in PAIRING_AXES and axis not in reference)


@dataclass(frozen=True)
class Part:
    """The cells a part reads, and of their rows only those of `prompts` (None: all of them); of
    those, where `runs` is given, each cell's runs at positions [start, stop) (one prompt cut by runs)."""

    cells: tuple[str, ...]
    prompts: tuple[str, ...] | None = None
    runs: tuple[int, int] | None = None


def cell_sizes(results: Results) -> list[tuple[str, dict[str, Any] | None, int]]:
    """Per cell read, in file order: (cell id, the axes of its first row or None for a file without
    rows, its rows). Read from the files themselves (a few hundred bytes each: their footers and
    first rows), for current and stale cells alike, so the rows that the statistics join are the
    ones that place a cell: one definition whatever the experiment now says."""
    heads = results.folder.store.cell_heads(list(AXES), results.cell_ids)
    return [(record.pop("cell_id"), record if (rows := int(record.pop("rows"))) else None, rows)
            for record in heads.to_dict("records")]


def plan(results: Results, reference: dict[str, Any], budget: int = PART_ROWS) -> list[Part]:
    """The cells of `results` in parts of closed units, each part's cells in file order; one part
    when everything fits `budget` rows. A unit over `budget` is cut by prompt (every reader's
    records join by prompt). A file without rows is related to nothing: it joins the first part."""
    cells = cell_sizes(results)
    if sum(rows for _, _, rows in cells) <= budget:
        return [Part(tuple(results.cell_ids))]
    units: dict[tuple, list[str]] = {}
    empty: list[str] = []
    sizes = {cell_id: rows for cell_id, _, rows in cells}
    for cell_id, setting, _ in cells:
        if setting is None:
            empty.append(cell_id)
        else:
            units.setdefault(unit_key(setting, reference), []).append(cell_id)
    order = {c: i for i, c in enumerate(results.cell_ids)}
    packed: list[list[str]] = [list(empty)]
    cut: list[Part] = []
    filled = 0
    for members in units.values():
        size = sum(sizes[c] for c in members)
        if size > budget:
            cut += _by_prompt(results, sorted(members, key=order.__getitem__), budget)
            continue
        if filled and filled + size > budget:
            packed.append([])
            filled = 0
        packed[-1].extend(members)
        filled += size
    whole = [Part(tuple(sorted(part, key=order.__getitem__))) for part in packed if part]
    return whole + cut


def _by_prompt(results: Results, cells: list[str], budget: int) -> list[Part]:
    """One unit's cells in parts of its prompts, each about `budget` rows, prompts in the order the files
    hold them (a part then reads few of a large file's row groups). A prompt larger than `budget` is
    cut by its runs: parts of the same positions in each cell's runs of it (_by_runs)."""
    read = results.folder.store.read_rows(["cell_id", "prompt_id"], cells)
    counts = read["prompt_id"].value_counts(sort=False)
    parts: list[list[str]] = [[]]
    cut: list[Part] = []
    filled = 0
    for prompt, size in counts.items():
        if size > budget:
            per_cell = read.loc[read["prompt_id"] == prompt, "cell_id"].value_counts()
            cut += _by_runs(tuple(cells), str(prompt), int(per_cell.max()), int(size), budget)
            continue
        if filled and filled + size > budget:
            parts.append([])
            filled = 0
        parts[-1].append(str(prompt))
        filled += int(size)
    whole = [Part(tuple(cells), tuple(chosen)) for chosen in parts if chosen]
    if len(whole) + len(cut) < 2:
        return [Part(tuple(cells))]
    return whole + cut


def _by_runs(cells: tuple[str, ...], prompt: str, most: int, size: int, budget: int) -> list[Part]:
    """One prompt's runs in parts of about `budget` rows: part k holds each cell's runs of the prompt at
    positions [k*step, (k+1)*step) in file order, `most` being the most runs a cell has of it. Each
    part reads the runs that stand for their cells besides (Analysis.stand_ins), so every run is
    compared with the reference run a whole read gives it."""
    step = max(1, math.ceil(most / math.ceil(size / budget)))
    return [Part(cells, (prompt,), (start, start + step)) for start in range(0, most, step)]
