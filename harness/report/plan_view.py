"""What `harness plan` shows: the cells and the loads they share, what every cell has in common,
the generations the plan makes, and the power table (what it can bound)."""

from __future__ import annotations

from typing import Any

from harness.analysis import power
from harness.experiment.matrix import Cell, Group
from harness.experiment.schema import LoadedExperiment
from harness.experiment.varying import varying
from harness.report.plain import PlainTable


def plan_view(loaded: LoadedExperiment, cells: list[Cell], groups: list[Group]) -> list[Any]:
    """The plan's renderables, in print order."""
    exp = loaded.experiment
    prompts = len(loaded.prompt_set.prompts)
    shown = varying(cells, loaded.axes)
    fixed = [f"{a}={cells[0][a]}" for a in loaded.axes if a not in shown]
    table = PlainTable(title=f"{exp.name}: {len(cells)} cells in {len(groups)} engine load(s)")
    for col in ["load", "cell"] + shown:
        table.add_column(col)
    for gi, grp in enumerate(groups, 1):
        for cell in grp.cells:
            table.add_row(f"{gi}", cell.id, *[str(cell[a]) for a in shown])
    return [
        table,
        "same in every cell: " + ", ".join(fixed),
        f"{prompts} prompts x {exp.repeats} repeats x {len(cells)} cells = [bold]{prompts * exp.repeats * len(cells)} "
        f"generations[/bold] of up to {exp.max_tokens} tokens; {len(loaded.prompt_set.fillers)} fillers in the pool",
        power_table(prompts, exp.repeats),
    ]


def power_table(prompts: int, repeats: int) -> PlainTable:
    """What the plan can bound: per target divergence rate, the runs and prompts it takes (harness.analysis.power)."""
    pooled, clustered = power.reachable(prompts, repeats)
    table = PlainTable(title=f"power: {prompts} prompts x {repeats} repeats = {prompts * repeats} runs per compared "
                             f"setting; with none departing, the rate is bounded below {100 * pooled:.2g}% pooled "
                             f"over runs, {100 * clustered:.2g}% with prompts as the unit (95%)")
    for col in ("rate", "runs needed", "repeats needed (these prompts)", "prompts needed (prompts as unit)",
                "P(see >= 1) here"):
        table.add_column(col)

    def here(ok: bool) -> str:
        return "" if ok else " (not here)"

    for r in power.table(prompts, repeats).itertuples():
        table.add_row(f"{100 * r.rate:g}%", f"{r.runs_needed}{here(r.bounded_pooled)}", str(r.repeats_needed),
                      f"{r.prompts_needed}{here(r.bounded_prompts)}", f"{100 * r.chance_to_see_one:.0f}%")
    return table
