"""`harness report`: one self-contained HTML file (data, styles and script inline) from a results folder.

Python decides every number (statistics, divergence points, chart tables); the page's script
only lays them out, filters and paginates. Distinct outputs are stored once and referenced by
hash, so results with thousands of mostly identical runs stay small.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import pandas as pd

from harness import metrics
from harness.config import AXES
from harness.probes import PROBE_COLUMNS
from harness.report import charts as charts_mod
from harness.results import Results

#: filters offered in the viewer, in this order, when the results hold more than one value
FILTER_AXES = ("engine", "batch_size", "dtype", "gpu", "batch_invariant", "model", "seed", "temperature")
PROVENANCE = ("host", "platform", "cpu", "cpu_count", "gpu_name", "gpu_count", "gpu_driver", "cuda_version",
              "engine_version", "python_version", "harness_version", "git_commit", "library_versions")


def _plain(value: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/NA to null, arrays to lists."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (pd.Timestamp, datetime)):
        return value.isoformat()
    return value


def _distinct(column: pd.Series) -> str:
    """The different values of a column, joined: a merged folder from two machines shows both."""
    values = [str(v) for v in column.dropna().unique() if str(v) not in ("", "None")]
    return "; ".join(values[:6]) + (f"; and {len(values) - 6} more" if len(values) > 6 else "")


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [_plain(r) for r in frame.to_dict(orient="records")]


def _outputs(ok: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Each distinct output once: its per-token texts, or the whole text where the engine gave none."""
    out: dict[str, dict[str, Any]] = {}
    for h, pieces, text in zip(ok["output_hash"], ok["token_texts"], ok["text"]):
        if h in out:
            continue
        if pieces is not None and len(pieces):
            out[h] = {"t": [str(p) for p in pieces]}
        else:
            out[h] = {"t": [text or ""], "whole": True}
    return out


def _probe_table(rows: pd.DataFrame, varying: list[str]) -> list[dict[str, Any]]:
    table = metrics.probe_summary(rows)
    if table.empty:
        return []
    table.insert(0, "series", charts_mod.series_labels(table, varying))
    return _records(table[["series", "batch_size", "runs", "steps", "steps_differed", "logits_compared",
                           "logits_differed", "moved_share", "max_abs_diff", "low_margin_frac"]])


def _prompt_texts(results: Results) -> dict[str, str]:
    """Prompt texts by id from the experiment snapshot(s) in the folder's manifest."""
    return {p.id: p.text for loaded in results.experiments for p in loaded.prompt_set.prompts}


def build(
    store: Results, reference: dict[str, Any] | None = None, allow_mixed: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Everything the page shows, as plain data."""
    reference = dict(metrics.DEFAULT_REFERENCE if reference is None else reference)
    rows = store.read_rows()
    annotated = metrics.against_reference(rows, store.tokens_for, reference, allow_mixed)
    chart = charts_mod.compute(rows, annotated, reference, allow_mixed, store.answer_prompts())
    margins = chart.margins[["margin_run", "margin_reference"]].to_dict("index")

    runs = []
    for index, r in zip(annotated.index, annotated.itertuples(index=False)):
        k = None if pd.isna(r.first_divergence) else int(r.first_divergence)
        run = {
            "cell": r.cell_id, "prompt": r.prompt_id, "repeat": int(r.repeat), "status": "ok",
            "s": {a: _plain(getattr(r, a)) for a in AXES}, "h": r.output_hash, "n": int(r.n_tokens),
            "ref": bool(r.is_reference), "refcell": r.reference_cell if isinstance(r.reference_cell, str) else None,
            "m": None if pd.isna(r.matched) else bool(r.matched), "fd": k,
            "tps": _plain(r.target_tokens_per_s),
        }
        if index in margins:
            run["margin"] = [_plain(margins[index]["margin_run"]), _plain(margins[index]["margin_reference"])]
        if not pd.isna(r.probe_steps):
            run["probe"] = {c.removeprefix("probe_"): _plain(getattr(r, c)) for c in PROBE_COLUMNS}
        runs.append(run)
    for r in rows[rows["status"] != "ok"].itertuples(index=False):
        runs.append({
            "cell": r.cell_id, "prompt": r.prompt_id, "repeat": int(r.repeat), "status": r.status,
            "error": r.error or "", "s": {a: _plain(getattr(r, a)) for a in AXES}, "ref": False,
        })

    descriptions = [e.experiment.description for e in store.experiments if e.experiment.description]
    return {
        "meta": {
            "experiment": _distinct(rows["experiment"]),
            "description": " / ".join(descriptions),
            "results": str(store.root),
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "reference": chart.reference,
            "run_ids": sorted(rows["run_id"].dropna().unique().tolist()),
            "max_tokens": sorted(int(v) for v in rows["max_tokens"].dropna().unique()),
            "statuses": {k: int(v) for k, v in rows["status"].value_counts().items()},
            "matrix": {a: sorted(map(str, rows[a].dropna().unique())) for a in AXES},
            "provenance": {c: _distinct(rows[c]) for c in PROVENANCE},
            "cells": int(rows["cell_id"].nunique()),
        },
        "filters": [a for a in FILTER_AXES if rows[a].nunique() > 1] or ["engine"],
        "prompts": _prompt_texts(store),
        "outputs": _outputs(annotated),
        "runs": runs,
        "charts": {
            "identical": _records(chart.identical),
            "divergence": _records(chart.divergence),
            "margins": _records(chart.margins),
            "slowdown": _records(chart.slowdown),
            "probes": _probe_table(rows, chart.varying),
            "answers": _records(chart.answers),
        },
    }


def render(payload: dict[str, Any]) -> str:
    """The page: the template with styles, script and data put inline (no network when opened)."""
    assets = resources.files("harness.report") / "assets"
    data = json.dumps(payload, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    title = f"{payload['meta']['experiment']}: determinism report"
    page = (assets / "report.html").read_text(encoding="utf-8")
    return (
        page.replace("{{TITLE}}", title.replace("<", "&lt;"))
        .replace("{{CSS}}", (assets / "report.css").read_text(encoding="utf-8"))
        .replace("{{JS}}", (assets / "report.js").read_text(encoding="utf-8"))
        .replace("{{DATA}}", data)
    )


def write(
    store: Results, out: Path, reference: dict[str, Any] | None = None, allow_mixed: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Build and write the report atomically; returns the payload (for the CLI's summary line)."""
    payload = build(store, reference, allow_mixed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render(payload), encoding="utf-8")
    tmp.replace(out)
    return payload
