"""One analysis of a results folder: its rows read against one reference under one mixing rule, and
every figure a command shows, each computed once, when first asked for.

`run`'s summary, `summarize`, `check`, `report` and `plot` all read a folder through an `Analysis`,
so that they agree on what a reference, a pairing and a statistic are. Reading never writes into
the folder; `save` does, when asked (`summarize --save`, and `run` after a run).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from harness.analysis import (
    answer_metrics,
    by_setting,
    divergence,
    flips,
    guarantees,
    latency,
    metrics,
    mixing,
    near_ties,
    survival,
)
from harness.analysis.frames import in_run_order
from harness.experiment import reference_rules
from harness.results import columns, provenance_fields
from harness.results.columns import PROBE_COLUMNS
from harness.results.folder_rows import Results
from harness.results.rows import auto_fallbacks

if TYPE_CHECKING:
    import pandas as pd

T = TypeVar("T")


#: the row columns the statistics need (token lists and texts are read per distinct output, not per run)
SUMMARY_COLUMNS = list(dict.fromkeys(metrics.ROW_COLUMNS + answer_metrics.ANSWER_ROW_COLUMNS))
#: the row columns the report and the charts need besides: run ids, the folder's context, probes
REPORT_COLUMNS = list(dict.fromkeys(SUMMARY_COLUMNS + ["run_id", "max_tokens", "experiment"]
                                    + list(provenance_fields.CONTEXT) + list(PROBE_COLUMNS)))


class Analysis:
    """A results folder read against `reference` (default: batch size 1) under `allow_mixed`, the
    reference cell's run of each prompt chosen by `reference_run` (reference_rules.REFERENCE_RUNS)."""

    def __init__(self, results: Results, reference: dict[str, Any] | None = None,
                 allow_mixed: Iterable[str] = frozenset(), reference_run: str = "first",
                 near_tie: float = near_ties.NEAR_TIE, confident: float = flips.CONFIDENT,
                 stand_ins: pd.DataFrame | None = None) -> None:
        reference_rules.refuse_reference_run(reference_run)
        flips.check_thresholds(near_tie, confident)
        self.results = results
        self.reference = dict(reference_rules.DEFAULT_REFERENCE if reference is None else reference)
        self.allow_mixed = frozenset(allow_mixed)
        self.reference_run = reference_run
        #: the top-2 margin below which a step is a near tie (harness.analysis.near_ties)
        self.near_tie = near_tie
        #: the reference margin at or above which a departure is a confident flip (harness.analysis.flips)
        self.confident = confident
        #: where `results` are some runs of a prompt (a part that cuts it by runs): the runs that stand for
        #: their cells, chosen over all its runs (divergence.reference_repeats); None: chosen from the rows
        self.stand_ins = stand_ins

    @classmethod
    def parsed(cls, results: Results, reference: list[str], allow_mixed: list[str],
               reference_run: str = "first", near_tie: float = near_ties.NEAR_TIE,
               confident: float = flips.CONFIDENT) -> Analysis:
        """From command-line values: `--reference AXIS=VALUE ...`, `--allow-mixed FIELD ...`,
        `--reference-run first|modal`, `--near-tie EPS` and `--confident-margin M` (bad values are a
        UsageError naming what is allowed)."""
        from harness.core.errors import UsageError

        if not near_tie <= confident:
            raise UsageError(f"--near-tie {near_tie:g} is above --confident-margin {confident:g}: a near tie is "
                             "a smaller margin than a confident one")
        return cls(results, reference_rules.parse_reference(reference or []), mixing.parse_allow_mixed(allow_mixed),
                   reference_run, near_tie, confident)

    # -- rows ----------------------------------------------------------------------------------

    @cached_property
    def rows(self) -> pd.DataFrame:
        """The rows the statistics read (provenance as categoricals); the report's rows where those
        are in memory already (they hold these columns and more): a folder is read once."""
        if "report_rows" in self.__dict__:
            return self.report_rows
        return self.results.read_rows(columns=SUMMARY_COLUMNS, provenance_as_categories=True)

    @cached_property
    def report_rows(self) -> pd.DataFrame:
        """The rows the report and the charts read."""
        return self.results.read_rows(REPORT_COLUMNS, provenance_as_categories=True)

    # -- statistics ----------------------------------------------------------------------------

    @cached_property
    def compared(self) -> pd.DataFrame:
        """The ok rows, each with its reference run and where it departs from it (divergence.against_reference)."""
        r = self.results
        return divergence.against_reference(self.rows, r.tokens_for, self.reference, self.allow_mixed, r.logprobs_for,
                                         self.reference_run, self.stand_ins, self._carried(SUMMARY_COLUMNS))

    def _carried(self, columns: list[str]) -> pd.DataFrame | None:
        """The runs that stand for their cells where this part holds some runs of a prompt (wherever
        those runs lie), read so each run is compared with the run a whole read gives it; None elsewhere."""
        if self.stand_ins is None:
            return None
        from dataclasses import replace

        from harness.results.store_reading import RunPick

        runs = RunPick(tuple(zip(self.stand_ins["cell_id"], self.stand_ins["reference_repeat"].astype(int).tolist())))
        return replace(self.results, runs=runs).read_rows(columns, provenance_as_categories=True)

    @cached_property
    def setting_keys(self) -> list[str]:
        """The setting columns of the compared runs (columns.keys_of)."""
        return columns.keys_of(self.compared)

    # Every table is computed from per-run or per-prompt pieces (the names with a leading underscore, and
    # `summary` and `flips`): a campaign read part by part joins its parts' pieces and computes the tables
    # from them by this same code (harness.analysis.partitioned), so both reads agree by construction.

    @cached_property
    def summary(self) -> pd.DataFrame:
        """Per cell and prompt: runs, unique outputs, match rate, first divergence, bounds."""
        return metrics.joined_summary(self._summary_cells, self._summary_runs, self._summary_ok, self.reference,
                                      self.reference_run)

    @cached_property
    def _summary_cells(self) -> pd.DataFrame:
        """The summary of every (cell, prompt) whose runs these rows hold whole: all of them, but in a
        part that holds some runs of a prompt (see `_summary_runs`)."""
        if self.stand_ins is not None:
            return metrics.summarize(self.rows.iloc[:0], self.results.tokens_for, self.reference)
        r = self.results
        return metrics.summarize(self.rows, r.tokens_for, self.reference, self.allow_mixed, r.logprobs_for,
                                 self.reference_run, compared=self.compared)

    @cached_property
    def _summary_runs(self) -> pd.DataFrame:
        """Per row, its settings and status, in a part that holds some runs of a prompt: the parts' runs
        are joined, then summarized once (medians and distinct outputs do not add up); else empty."""
        return metrics.statuses(self.rows) if self.stand_ins is not None else self.rows.iloc[:0, :0]

    @cached_property
    def _summary_ok(self) -> pd.DataFrame:
        """Per compared run, the summary's figures (metrics.per_run), in such a part; else empty."""
        return metrics.per_run(self.compared) if self.stand_ins is not None else self.rows.iloc[:0, :0]

    @cached_property
    def _survival_counts(self) -> pd.DataFrame:
        return survival.counts(self.compared)

    @cached_property
    def survival(self) -> pd.DataFrame:
        """Per setting, the share of runs still identical to the reference after t tokens (harness.analysis.survival)."""
        return survival.from_counts(self._survival_counts)

    @cached_property
    def _tie_runs(self) -> pd.DataFrame:
        return near_ties.per_run(self.compared, self.results.margins_for, self.near_tie)

    @cached_property
    def _tie_sums(self) -> pd.DataFrame:
        return near_ties.sums(self._tie_runs, self.setting_keys)

    @cached_property
    def _tie_counts(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        return near_ties.from_sums(self._tie_sums, self.setting_keys)

    @cached_property
    def flips(self) -> pd.DataFrame:
        """Per departed run, in run order: where, the reference's margin there, and its flip class (harness.analysis.flips)."""
        return in_run_order(flips.per_run(self._tie_runs, self.setting_keys, self.near_tie, self.confident))

    @property
    def near_ties(self) -> pd.DataFrame:
        """Per setting: near-tie density and flips per near tie (harness.analysis.near_ties)."""
        return self._tie_counts[0]

    @property
    def flips_by_margin(self) -> pd.DataFrame:
        """Per setting and margin bucket: the chance per step that a run departs (harness.analysis.near_ties)."""
        return self._tie_counts[1]

    @cached_property
    def _floor_counts(self) -> pd.DataFrame:
        return guarantees.floor_counts(self.compared, self.setting_keys)

    @cached_property
    def _floors(self) -> pd.DataFrame:
        return guarantees.floors(self._floor_counts, self.setting_keys)

    @cached_property
    def by_setting(self) -> pd.DataFrame:
        """Per setting: compared runs, divergence rate with both bounds, survival median, near ties,
        flip classes, and the strongest guarantee class that holds (harness.analysis.guarantees)."""
        table = by_setting.agreement(self.summary, survival.medians(self.survival), self.near_ties,
                                     flips.per_setting(self.flips, self.setting_keys))
        return guarantees.classify(table, self._floors, self.answers, reference=self.reference)

    @cached_property
    def _slowdown_rows(self) -> pd.DataFrame:
        rows = self._one_cell_per_setting(self.rows)
        if "batch_invariant" in rows and rows["batch_invariant"].astype(bool).any():
            rows = self.results.read_rows(columns=SUMMARY_COLUMNS + ["itl_s", *metrics.START_UP],
                                          provenance_as_categories=True)
        return metrics.slowdown_rows(rows)

    @cached_property
    def slowdown(self) -> pd.DataFrame:
        """The batch-invariant mode's cost over paired runs, with serving latency on each side (its
        inter-token gaps, a list per run, read only for folders that have runs with the mode on)."""
        return metrics.slowdown(self._slowdown_rows, self.allow_mixed)

    @cached_property
    def _latency_rows(self) -> pd.DataFrame:
        rows = self._one_cell_per_setting(self.results.read_rows(columns=SUMMARY_COLUMNS + ["itl_s"],
                                                                 provenance_as_categories=True))
        wanted = columns.keys_of(rows) + ["cell_id", "prompt_id", "repeat", "status", *latency.COLUMNS]
        return in_run_order(rows, wanted)

    @cached_property
    def latency(self) -> pd.DataFrame:
        """Per setting: TTFT, ITL, TPOT and E2EL at p50/p90/p99 and their ratios against the reference
        setting (harness.analysis.latency); reads the runs' inter-token gaps."""
        rows = self._latency_rows
        return latency.by_setting(rows, columns.keys_of(rows), self.reference)

    @cached_property
    def _probe_rows(self) -> pd.DataFrame:
        return metrics.probe_rows(self._one_cell_per_setting(self.rows))

    @cached_property
    def probes(self) -> pd.DataFrame:
        return metrics.probe_summary(self._probe_rows)

    @cached_property
    def _answer_rows(self) -> pd.DataFrame:
        return answer_metrics.answer_rows(self._one_cell_per_setting(self.rows), self.results.answer_prompts())

    @cached_property
    def answers(self) -> pd.DataFrame:
        return answer_metrics.answer_summary(self._answer_rows, self.results.answer_prompts(), self.reference,
                                             reference_run=self.reference_run)

    def _one_cell_per_setting(self, rows: pd.DataFrame) -> pd.DataFrame:
        """`rows`, once no two cells claim one setting and prompt in them (divergence.refuse_twins):
        the tables that read rows without a reference refuse twins as the compared ones do."""
        if not self.__dict__.get("_twins_checked"):
            divergence.refuse_twins(rows)
            self.__dict__["_twins_checked"] = True
        return rows

    @cached_property
    def paired(self) -> pd.DataFrame:
        """The ok report rows, each with its reference run and where it departs from it (the
        statistics' own pairing, once the report's rows are the rows)."""
        rows = self.report_rows  # read first, so that `rows` is these rows and `compared` pairs them
        if self.rows is rows:
            return self.compared
        r = self.results  # the statistics read their own rows before: pair the report's as well
        return divergence.against_reference(rows, r.tokens_for, self.reference, self.allow_mixed, r.logprobs_for,
                                         self.reference_run, self.stand_ins, self._carried(REPORT_COLUMNS))

    @cached_property
    def seen(self) -> tuple[list[Any], list[Any]]:
        """The distinct engine_info and cpu_kernels values of the rows (what `notes` is made of)."""
        rows = self.rows
        return tuple(_distinct(rows[c]) if c in rows else [] for c in ("engine_info", "cpu_kernels"))

    @cached_property
    def notes(self) -> list[str]:
        return notes_of(*self.seen)

    def missing(self) -> pd.DataFrame | None:
        """The current experiments' cells that have no file yet (their settings and id), or None."""
        import pandas as pd

        from harness.experiment.matrix import expand

        on_disk = set(self.results.cell_ids)
        missing = pd.DataFrame([c.as_dict | {"cell_id": c.id} for e in self.results.experiments for c in expand(e)
                                if c.id not in on_disk])
        return None if missing.empty else missing.drop_duplicates("cell_id", ignore_index=True)

    def per_part(self, fn: Callable[[Analysis], T], with_statistics: bool = True) -> list[T]:
        """`fn` of each part of the folder, in order: here the folder is one part (a campaign's
        Analysis reads it part by part: harness.analysis.partitioned, which computes the statistics
        in the same pass `with_statistics`)."""
        return [fn(self)]

    # -- writing, only when asked --------------------------------------------------------------

    def table(self, name: str) -> pd.DataFrame:
        """One of TABLES by its name."""
        return getattr(self, TABLES[name][0])

    def save(self, out: Path | None = None) -> None:
        """Write the TABLES as Parquet into the folder (those marked always even when empty; the
        others where there are any), each renamed into place whole."""
        from harness.results.store import Store

        root = Path(out or self.results.root)
        store = Store(root)
        for name, (_, stem, always) in TABLES.items():
            frame = self.table(name)
            if always or not frame.empty:
                store.atomic_write(root / f"{stem}.parquet", lambda tmp, f=frame: f.to_parquet(tmp, index=False))


def notes_of(engine_info: Iterable[Any], cpu_kernels: Iterable[Any]) -> list[str]:
    """What the loads chose by themselves (llama.cpp's extra buffers off under auto) and the CPU
    kernel paths the rows were computed in, from the rows' distinct values of those columns."""
    paths = sorted({str(p) for p in cpu_kernels if str(p)})
    return auto_fallbacks(engine_info) + [f"cpu kernels: {p}" for p in paths]


def _distinct(column: pd.Series) -> list[Any]:
    """The distinct present values of a column (on a categorical's codes: no million strings made)."""
    import pandas as pd

    return [v for v in column.unique() if not pd.isna(v)]


#: the tables of an analysis, by the name `summarize --what` takes: (attribute, file stem in the
#: results folder, written even when empty)
TABLES: dict[str, tuple[str, str, bool]] = {
    "cells": ("summary", "summary", True),
    "settings": ("by_setting", "settings", True),
    "slowdown": ("slowdown", "slowdown", True),
    "probes": ("probes", "probes", False),
    "answers": ("answers", "answers", False),
    "survival": ("survival", "survival", False),
    "flips_by_margin": ("flips_by_margin", "flips_by_margin", False),
    "flips": ("flips", "flips", False),
}

