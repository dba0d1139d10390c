"""A folder's rows as every reader opens them: the current cells of its experiment (or all of them),
restricted by --where, with tokens, texts and log-probabilities looked up by output hash."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.core.errors import HarnessError
from harness.experiment.schema import LoadedExperiment
from harness.results.folder import MANIFEST, ResultsFolder

if TYPE_CHECKING:  # pandas is imported where rows are read: `harness run` starts faster
    import pandas as pd

    from harness.results.store_reading import RunPick, RunSlice


@dataclass
class Results:
    """What a reader sees of a folder: the rows of its chosen cells, and which cells were left out."""

    folder: ResultsFolder
    experiments: list[LoadedExperiment]  # the folder's current experiments, loaded once
    cell_ids: list[str]  # the cells read (present on disk)
    stale: list[str]  # cells on disk left out (or read, with all_cells)
    all_cells: bool
    #: only the rows of these prompts (a campaign's part: harness.analysis.partitions); None: every row
    prompt_ids: tuple[str, ...] | None = None
    #: of those prompts' rows, only these runs (a part that cuts one prompt by its runs); None: all
    runs: RunSlice | RunPick | None = None

    @property
    def root(self) -> Path:
        return self.folder.root

    @property
    def option_axes(self) -> list[str]:
        """The engine options the current experiments sweep (each a setting column of the rows)."""
        return list(dict.fromkeys(a for e in self.experiments for a in e.option_axes))

    def read_rows(self, columns: list[str] | None = None, provenance_as_categories: bool = False) -> pd.DataFrame:
        """The rows of the chosen cells (and prompts); `columns` plus the swept option columns (None: every column).
        `provenance_as_categories`: see Store.read_rows."""
        if columns is not None:
            columns = list(dict.fromkeys(columns + self.option_axes))
        return self.folder.store.read_rows(columns, self.cell_ids, provenance_as_categories, self.prompt_ids,
                                           self.runs)

    def restricted(self, where: dict[str, Any], option: str = "--where") -> Results:
        """These results read as the cells whose settings equal `where` alone (one folder as both
        sides of `compare`: one environment against another); none matching is an error."""
        if not where:
            return self
        cells = self.read_rows(columns=["cell_id", *where]).drop_duplicates("cell_id")
        mask = cells["cell_id"].notna()
        for axis, value in where.items():
            if axis not in cells:
                raise HarnessError(f"{option} {axis}={value}: {self.root} has no setting {axis}")
            mask &= cells[axis] == value
        keep = set(cells.loc[mask, "cell_id"])
        if not keep:
            asked = ", ".join(f"{k}={v}" for k, v in where.items())
            raise HarnessError(f"{option} {asked}: no cell of {self.root} has these settings")
        return replace(self, cell_ids=[c for c in self.cell_ids if c in keep])

    def tokens_for(self, hashes: set[str]) -> dict[str, list[int]]:
        return self.folder.store.tokens_for(hashes, self.cell_ids, self.prompt_ids)

    def texts_for(self, hashes: set[str]) -> dict[str, list[str]]:
        return self.folder.store.texts_for(hashes, self.cell_ids, self.prompt_ids)

    def whole_texts_for(self, hashes: set[str]) -> dict[str, str]:
        return self.folder.store.whole_texts_for(hashes, self.cell_ids, self.prompt_ids)

    def logprobs_for(self, hashes: set[str]) -> dict[str, list[float]]:
        return self.folder.store.logprobs_for(hashes, self.cell_ids, self.prompt_ids)

    def margins_for(self, runs: pd.DataFrame) -> pd.Series:
        """Each given run's per-step top-2 margins (None where not recorded), read for those runs only."""
        return self.folder.store.values_at("margins", runs)

    def answer_prompts(self) -> set[str]:
        """Ids of the prompts that carry a parse rule (answer statistics are about those)."""
        return {p.id for e in self.experiments for p in e.prompt_set.prompts if p.parse is not None}


def open_results(root: Path, all_cells: bool = False) -> Results:
    """Open a results folder for reading: the current experiment's cells (all cells on disk with `all_cells`)."""
    folder = ResultsFolder(root)
    if not folder.store.cell_files():
        raise HarnessError(f"{root}: no results here (expected {root}/cells/*.parquet)")
    if not folder.has_manifest():
        raise HarnessError(
            f"{root}: no {MANIFEST} (written by an older harness, or not a results folder); adopt it with "
            f"'harness run EXPERIMENT --out {root}': finished cells of that experiment are kept, others become stale"
        )
    on_disk = [p.stem for p in folder.store.cell_files()]
    experiments = folder.experiments()
    current = {c.id for c in folder.current_cells()}
    stale = folder.stale_ids(current)
    chosen = on_disk if all_cells else [c for c in on_disk if c in current]
    if not chosen:
        raise HarnessError(
            f"{root}: none of the {len(on_disk)} cell(s) on disk belongs to the current experiment "
            f"({', '.join(e.experiment.name for e in experiments)}); run it, or read them with --all-cells"
        )
    return Results(folder, experiments, chosen, stale, all_cells)
