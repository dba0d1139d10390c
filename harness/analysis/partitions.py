"""A folder's cells cut into closed parts, so that a campaign's statistics are computed part by part
with no part needing another's rows.

Every statistic relates a run to runs of its own setting, of its reference setting (the same
settings but the `--reference` axes) or of its batch-invariant twin (`slowdown`). So the cells whose
settings are equal but for the reference axes and batch_invariant form a closed unit: its
statistics are the same whether it is read alone or with the rest of the folder. Units are
packed into parts of about `budget` rows (a unit larger than that stays whole). A cell's axes
and rows come from the experiment that made it, so planning opens no file (but for stale cells
read with --all-cells). Engine options and max_tokens are left out of a unit's key: a unit may
be larger than it needs to be, never smaller.
"""

from __future__ import annotations

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


def _unit_key(cell_id: str, setting: dict[str, Any] | None, reference: dict[str, Any]) -> tuple:
    """The closed unit a cell belongs to: its axes but the reference and pairing axes (left out
    rather than set to the reference's values, which would have to be compared as the rows' types
    compare); a cell of unknown settings is a unit of its own."""
    if setting is None:
        return ("alone", cell_id)
    return tuple((k, repr(v)) for k, v in setting.items() if k not in PAIRING_AXES and k not in reference)


def _cells(results: Results) -> dict[str, tuple[dict[str, Any] | None, int]]:
    """Per cell read, in file order: (its axes, its rows). The current experiments' cells are known
    without opening a file (their axes, and prompts x repeats rows); a stale cell read with
    --all-cells tells its axes in its first row and its rows in its footer."""
    from harness.experiment.matrix import expand

    known = {c.id: (c.as_dict, e.experiment.repeats * len(e.prompt_set.prompts))
             for e in results.experiments for c in expand(e)}
    stale = [c for c in results.cell_ids if c not in known]
    if stale:
        heads = results.folder.store.cell_heads(list(AXES), stale)
        for head in heads.to_dict("records"):
            rows = int(head.pop("rows"))
            known[head.pop("cell_id")] = (head if rows else None, rows)
    return {c: known.get(c, (None, 0)) for c in results.cell_ids}


def plan(results: Results, reference: dict[str, Any], budget: int = PART_ROWS) -> list[list[str]]:
    """The cells of `results` in parts of closed units, each part's cells in file order; one part
    when everything fits `budget` rows."""
    cells = _cells(results)
    if sum(rows for _, rows in cells.values()) <= budget:
        return [list(results.cell_ids)]
    units: dict[tuple, list[str]] = {}
    for cell_id, (setting, _) in cells.items():
        units.setdefault(_unit_key(cell_id, setting, reference), []).append(cell_id)
    parts: list[list[str]] = []
    filled = budget
    for members in units.values():
        size = sum(cells[c][1] for c in members)
        if filled + size > budget:
            parts.append([])
            filled = 0
        parts[-1].extend(members)
        filled += size
    order = {c: i for i, c in enumerate(results.cell_ids)}
    return [sorted(part, key=order.__getitem__) for part in parts]
