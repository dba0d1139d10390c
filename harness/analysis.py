"""One analysis of a results folder: its rows read against one reference under one mixing rule, and
every figure a command shows, each computed once, when first asked for.

`run`'s summary, `summarize`, `check`, `report` and `plot` all read a folder through an `Analysis`,
so that they agree on what a reference, a pairing and a statistic are. Reading never writes into
the folder; `save` does, when asked (`summarize --save`, and `run` after a run).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from harness import answer_metrics, metrics, provenance_fields
from harness.probes import PROBE_COLUMNS
from harness.results import Results

if TYPE_CHECKING:
    import pandas as pd

    from harness.report.charts import Charts

#: the row columns the statistics need (token lists and texts are read per distinct output, not per run)
SUMMARY_COLUMNS = list(dict.fromkeys(metrics.ROW_COLUMNS + answer_metrics.ANSWER_ROW_COLUMNS))
#: the row columns the report and the charts need besides: run ids, the folder's context, probes
REPORT_COLUMNS = list(dict.fromkeys(SUMMARY_COLUMNS + ["run_id", "max_tokens", "experiment"]
                                    + list(provenance_fields.CONTEXT) + list(PROBE_COLUMNS)))


class Analysis:
    """A results folder read against `reference` (default: batch size 1) under `allow_mixed`."""

    def __init__(self, results: Results, reference: dict[str, Any] | None = None,
                 allow_mixed: Iterable[str] = frozenset()) -> None:
        self.results = results
        self.reference = dict(metrics.DEFAULT_REFERENCE if reference is None else reference)
        self.allow_mixed = frozenset(allow_mixed)

    @classmethod
    def parsed(cls, results: Results, reference: list[str], allow_mixed: list[str]) -> Analysis:
        """From command-line values: `--reference AXIS=VALUE ...` and `--allow-mixed FIELD ...`
        (bad values are a UsageError naming what is allowed)."""
        return cls(results, metrics.parse_reference(reference or []), metrics.parse_allow_mixed(allow_mixed))

    # -- rows ----------------------------------------------------------------------------------

    @cached_property
    def rows(self) -> pd.DataFrame:
        """The rows the statistics read (provenance as categoricals)."""
        return self.results.read_rows(columns=SUMMARY_COLUMNS, provenance_as_categories=True)

    @cached_property
    def report_rows(self) -> pd.DataFrame:
        """The rows the report and the charts read."""
        return self.results.read_rows(REPORT_COLUMNS, provenance_as_categories=True)

    # -- statistics ----------------------------------------------------------------------------

    @cached_property
    def summary(self) -> pd.DataFrame:
        """Per cell and prompt: runs, unique outputs, match rate, first divergence, bounds."""
        r = self.results
        return metrics.summarize(self.rows, r.tokens_for, self.reference, self.allow_mixed, r.logprobs_for)

    @cached_property
    def slowdown(self) -> pd.DataFrame:
        """The batch-invariant mode's cost over paired runs."""
        return metrics.slowdown(self.rows, self.allow_mixed)

    @cached_property
    def probes(self) -> pd.DataFrame:
        return metrics.probe_summary(self.rows)

    @cached_property
    def answers(self) -> pd.DataFrame:
        return answer_metrics.answer_summary(self.rows, self.results.answer_prompts(), self.reference)

    @cached_property
    def paired(self) -> pd.DataFrame:
        """The ok report rows, each with its reference run and where it departs from it."""
        return metrics.against_reference(self.report_rows, self.results.tokens_for, self.reference, self.allow_mixed)

    @cached_property
    def charts(self) -> Charts:
        """The data of every chart (report and `harness plot`), splits included."""
        from harness.report import charts

        r = self.results
        data = charts.compute(self.report_rows, self.paired, self.reference, self.allow_mixed, r.answer_prompts(),
                              r.margins_for)
        charts.add_splits(data, self.report_rows, r.tokens_for, r.texts_for)
        return data

    def missing(self) -> pd.DataFrame | None:
        """The current experiments' cells that have no file yet (their settings and id), or None."""
        import pandas as pd

        from harness.matrix import expand

        on_disk = set(self.results.cell_ids)
        missing = pd.DataFrame([c.as_dict | {"cell_id": c.id} for e in self.results.experiments for c in expand(e)
                                if c.id not in on_disk])
        return None if missing.empty else missing.drop_duplicates("cell_id", ignore_index=True)

    # -- writing, only when asked --------------------------------------------------------------

    def save(self, out: Path | None = None) -> None:
        """Write the summaries as Parquet into the folder (summary and slowdown always; probes and
        answers where there are any), each renamed into place whole."""
        from harness.store import Store

        root = Path(out or self.results.root)
        store = Store(root)
        frames = (("summary", self.summary), ("slowdown", self.slowdown), ("probes", self.probes),
                  ("answers", self.answers))
        for name, frame in frames:
            if name in ("summary", "slowdown") or not frame.empty:
                store.atomic_write(root / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp, index=False))
