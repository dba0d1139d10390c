"""`harness report`: one self-contained HTML file (data, styles and script inline) from a results folder.

Python decides every number (statistics, divergence points, chart tables); the page's script
only lays them out, filters and paginates. Distinct outputs are stored once and referenced by
hash, so results with thousands of mostly identical runs stay small.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from harness.analysis.folder_analysis import Analysis
from harness.core.op_recording import is_logits
from harness.experiment.axes import AXES
from harness.experiment.varying import varying
from harness.report import charts as charts_mod
from harness.results import provenance_fields
from harness.results.columns import PROBE_COLUMNS, keys_of
from harness.results.folder_rows import Results
from harness.results.schema import ROW_SCHEMA

#: the folder's context shown in the page's header (harness.results.provenance_fields)
PROVENANCE = provenance_fields.CONTEXT


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


def _listed(values: list[str]) -> str:
    """The different values of a column, joined: a merged folder from two machines shows both."""
    values = [v for v in values if v not in ("", "None")]
    return "; ".join(values[:6]) + (f"; and {len(values) - 6} more" if len(values) > 6 else "")


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [_plain(r) for r in frame.to_dict(orient="records")]


def _outputs(ok: pd.DataFrame, results: Results) -> dict[str, dict[str, Any]]:
    """Each distinct output once: its per-token texts, or the whole text where the engine gave none.

    Read for the distinct outputs only, so a million mostly identical runs cost their few outputs.
    """
    hashes = set(ok["output_hash"].dropna())
    pieces = results.texts_for(hashes)
    missing = {h for h in hashes if not len(pieces.get(h) or [])}
    whole = results.whole_texts_for(missing) if missing else {}
    out: dict[str, dict[str, Any]] = {h: {"t": [str(p) for p in pieces[h]]} for h in hashes - missing}
    for h in missing:
        out[h] = {"t": [whole.get(h) or ""], "whole": True}
    return out


#: repeat ranges an entry lists at most; the rest are counted (a campaign's entry of 2000 runs
#: scattered over 10,000 repeats would otherwise list hundreds of ranges, each entry)
RANGES_SHOWN = 16


def _ranges(repeats: list[int]) -> dict[str, Any]:
    """Sorted repeat numbers as [first, last] runs of consecutive ones (1000 repeats, a few pairs):
    `repeats`, the first RANGES_SHOWN of them, and `ranges_left_out` where there are more."""
    out: list[list[int]] = []
    for r in sorted(repeats):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return {"repeats": out[:RANGES_SHOWN]} | ({"ranges_left_out": len(out) - RANGES_SHOWN}
                                               if len(out) > RANGES_SHOWN else {})


#: the row columns that hold whole numbers: a read where some are missing gives them as floats
WHOLE_NUMBERS = frozenset(f.name for f in ROW_SCHEMA if pa.types.is_integer(f.type))


def _whole(column: str, value: Any) -> Any:
    """A whole-number column's value as an int (4, not 4.0), however the read typed it: one page
    whether a campaign is read whole or part by part."""
    return int(value) if column in WHOLE_NUMBERS and isinstance(value, float) else value


#: what makes runs of one cell and prompt one entry of the runs viewer (and the logit probe's columns)
ENTRY_KEYS = ["cell_id", "prompt_id", "output_hash", "is_reference", "reference_cell", "matched", "first_divergence",
              "n_tokens", "_margin_run", "_margin_ref"]


def _run_entries(ok: pd.DataFrame, problems: pd.DataFrame, margins: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs viewer's entries: runs of one cell and prompt that show the same thing (output,
    verdict, split, margins, probe numbers) are one entry with their count and repeat ranges;
    throughput is their median. The reference run is an entry of its own."""
    return _entries(*_entry_runs(ok, problems, margins))


def _entry_runs(ok: pd.DataFrame, problems: pd.DataFrame,
                margins: dict[Any, dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(per run, what its entry is made of; the runs that did not end ok; per cell, its settings): the
    entries of the runs of one cell and prompt read in several parts are made once they are joined."""
    probe = [c for c in PROBE_COLUMNS if c in ok and ok[c].notna().any()]
    frame = ok[[c for c in dict.fromkeys(ENTRY_KEYS + probe + ["repeat", "target_tokens_per_s"]) if c in ok]].copy()
    for column, name in (("_margin_run", "margin_run"), ("_margin_ref", "margin_reference")):
        given = {i: m[name] for i, m in margins.items() if m.get(name) is not None}
        frame[column] = pd.Series(given, dtype=float).reindex(frame.index)
    # every axis and swept option: what the viewer filters and shows (constant inside a cell)
    return frame, problems, ok.drop_duplicates("cell_id")[["cell_id"] + keys_of(ok)]


def _entries(frame: pd.DataFrame, problems: pd.DataFrame, cells: pd.DataFrame) -> list[dict[str, Any]]:
    """The entries of _entry_runs' frames (see _run_entries)."""
    probe = [c for c in PROBE_COLUMNS if c in frame and frame[c].notna().any()]
    settings = [c for c in cells.columns if c != "cell_id"]
    keys = ENTRY_KEYS + probe
    # aggregate per entry first (a few thousand groups), then build each entry from one record
    g = frame.groupby(keys, dropna=False, sort=False)
    table = g.agg(repeat=("repeat", "min"), count=("repeat", "size"), tps=("target_tokens_per_s", "median")).reset_index()
    # settings are constant inside a cell: put them back from a table of cells, not per entry group
    table = table.merge(cells, on="cell_id", how="left", sort=False)
    repeats = [_ranges([int(x) for x in r]) for r in g["repeat"].agg(list)]
    entries = []
    for r, spans in zip(table.to_dict("records"), repeats):
        k = None if pd.isna(r["first_divergence"]) else int(r["first_divergence"])
        run = {
            "cell": r["cell_id"], "prompt": r["prompt_id"], "repeat": int(r["repeat"]),
            "count": int(r["count"]), **spans, "status": "ok",
            "s": {a: _plain(r[a]) for a in settings}, "h": r["output_hash"], "n": int(r["n_tokens"]),
            "ref": bool(r["is_reference"]),
            "refcell": r["reference_cell"] if isinstance(r["reference_cell"], str) else None,
            "m": None if pd.isna(r["matched"]) else bool(r["matched"]), "fd": k,
            "tps": _plain(r["tps"]),
        }
        if not (pd.isna(r["_margin_run"]) and pd.isna(r["_margin_ref"])):
            run["margin"] = [_plain(r["_margin_run"]), _plain(r["_margin_ref"])]
        if probe and not pd.isna(r.get("probe_steps")):
            run["probe"] = {c.removeprefix("probe_"): _whole(c, _plain(r[c])) for c in probe}
        entries.append(run)
    for values, part in problems.groupby(["cell_id", "prompt_id", "status", "error"], dropna=False, sort=False):
        first = part.iloc[0]
        entries.append({
            "cell": values[0], "prompt": values[1], "repeat": int(part["repeat"].min()), "count": int(len(part)),
            **_ranges(part["repeat"].astype(int).tolist()), "status": values[2],
            "error": values[3] if isinstance(values[3], str) else "", "s": {a: _plain(first[a]) for a in settings if a in first},
            "ref": False,
        })
    return entries


#: margin points the page draws at most; more are thinned evenly (the CSV of `harness plot` has all)
MARGIN_POINTS = 3000


def _margin_points(frame: pd.DataFrame) -> list[dict[str, Any]]:
    pts = frame.dropna(subset=["margin_run", "margin_reference"])
    if len(pts) > MARGIN_POINTS:
        pts = pts.iloc[np.linspace(0, len(pts) - 1, MARGIN_POINTS).astype(int)]
    return _records(pts)


def _probe_table(table: pd.DataFrame, varying: list[str]) -> list[dict[str, Any]]:
    """The logit probes per setting (metrics.probe_summary), labelled like the charts' series."""
    if table.empty:
        return []
    table = table.copy()  # the analysis's own table: a page built twice from one analysis labels it twice
    table.insert(0, "series", charts_mod.series_labels(table, varying))
    return _records(table[["series", "batch_size", "runs", "steps", "steps_differed", "logits_compared",
                           "logits_differed", "moved_share", "max_abs_diff", "low_margin_frac"]])


#: split records the page lists; a folder with more shows the largest splits and says how many it left out
SPLITS_SHOWN = 400


def _split_records(tree: pd.DataFrame) -> dict[str, Any]:
    """The split trees for the page: the cells and prompts with the most runs first, whole trees only."""
    if tree.empty:
        return {"records": [], "left_out": 0}
    size = tree[tree["depth"] == 0].groupby(["cell_id", "prompt_id"])["runs"].sum().sort_values(ascending=False)
    shown, count = [], 0
    for cell, prompt in size.index:
        part = tree[(tree["cell_id"] == cell) & (tree["prompt_id"] == prompt)]
        if count and count + len(part) > SPLITS_SHOWN:
            break
        shown.append(part)
        count += len(part)
    kept = pd.concat(shown)
    columns = ["series", "prompt_id", "cell_id", "depth", "node", "parent_node", "split_at", "branch", "token_text",
               "runs", "unique_outputs", "share"]
    return {"records": _records(kept[columns]), "left_out": int(len(tree) - len(kept))}


def _guarantees(analysis: Analysis) -> dict[str, Any]:
    """Per setting its guarantee class and evidence, and the confident flips (likely bugs), with
    the settings that tell settings apart as their labels."""
    from harness.analysis.flips import likely_bugs

    table = analysis.by_setting
    axes = varying(table, keys_of(table)) or ["engine"]

    def label(rec: dict[str, Any]) -> str:
        return ", ".join(f"{a}={rec[a]}" for a in axes if a in rec and not pd.isna(rec[a]))

    settings = [{"setting": label(r), "guarantee": r["guarantee"], "evidence": r["guarantee_evidence"]}
                for r in table.to_dict("records") if isinstance(r.get("guarantee"), str)]
    bugs = [{"setting": label(r), "prompt": r["prompt_id"], "cell": r["cell_id"], "repeat": int(r["repeat"]),
             "token": int(r["first_divergence"]), "margin": float(r["flip_margin"])}
            for r in likely_bugs(analysis.flips).head(200).to_dict("records")]
    return {"settings": settings, "likely_bugs": bugs, "confident_margin": analysis.confident}


def _prompt_texts(results: Results) -> dict[str, str]:
    """Prompt texts by id from the experiment snapshot(s) in the folder's manifest."""
    return {p.id: p.text for loaded in results.experiments for p in loaded.prompt_set.prompts}


#: the columns whose distinct values the page's header lists
HEADER_COLUMNS = ["experiment", *PROVENANCE]


def report_part(analysis: Analysis) -> dict[str, Any]:
    """What the page needs from one part's runs (a folder, or a part of a campaign): its chart
    data, run entries, distinct outputs and the header's facts, each joinable with other parts'."""
    rows, annotated = analysis.report_rows, analysis.paired
    chart = charts_mod.chart_part(analysis)
    margins = chart.margins[["margin_run", "margin_reference"]].to_dict("index")
    made = _entry_runs(annotated, rows[rows["status"] != "ok"], margins)
    cut = analysis.stand_ins is not None  # some runs of a prompt: its entries are made once the parts are in
    return {
        "charts": chart,
        "runs": [] if cut else _entries(*made),
        "entry_runs": made if cut else None,
        "outputs": _outputs(annotated, analysis.results),
        # each distinct value with each cell and prompt it first appears in: the parts' values join in
        # cell, prompt, then row order, as a whole read's do (a part holds whole prompts)
        "seen": {c: rows[[c, "cell_id", "prompt_id"]].dropna(subset=[c]).drop_duplicates().astype(str).values.tolist()
                 for c in HEADER_COLUMNS},
        "run_ids": set(rows["run_id"].dropna().unique().tolist()),
        "max_tokens": {int(v) for v in rows["max_tokens"].dropna().unique()},
        "statuses": {k: int(v) for k, v in rows["status"].value_counts().items()},
        "matrix": {a: set(map(str, chart.cells[a].dropna().unique())) for a in AXES},  # a cell holds one setting
    }


def _joined_header(parts: list[dict[str, Any]]) -> dict[str, str]:
    """Per header column, its distinct values in cell, prompt and row order, joined as the page shows them."""
    out = {}
    for column in HEADER_COLUMNS:
        found = sorted((cell, prompt, i, value) for i, (value, cell, prompt) in
                       enumerate(seen for part in parts for seen in part["seen"][column]))
        out[column] = _listed(list(dict.fromkeys(value for *_, value in found)))
    return out


def _joined_entries(found: list[tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None]) -> list[dict[str, Any]]:
    """The entries of the runs read in several parts (a prompt cut by its runs), from their parts'
    _entry_runs joined in part order (each part's runs in row order)."""
    made = [f for f in found if f is not None]
    if not made:
        return []
    frame, problems, cells = (pd.concat([m[i] for m in made]) for i in range(3))
    return _entries(frame, problems, cells.drop_duplicates("cell_id"))


def _located_layers(by_module: pd.DataFrame | None) -> list[dict[str, Any]]:
    """Each traced step's largest difference from its reference's pass per layer, and at the logits
    (layer -1: the op that is the logits, harness.core.op_recording.is_logits): how a difference
    grows through the model, a few points per step however many ops were traced."""
    if by_module is None or by_module.empty:
        return []
    frame = by_module.copy()
    logits = frame["name"].astype(str).map(is_logits)
    frame["layer"] = frame["layer"].where(~logits, -1)
    frame = frame.dropna(subset=["layer"])
    frame["trace"] = (frame["setting"].astype(str) + " / " + frame["prompt_id"].astype(str) + ", "
                      + frame["step_kind"].astype(str) + " (step " + frame["step"].astype(str) + ")")
    grown = frame.groupby(["trace", "layer"], sort=False)["max_abs_diff"].max().reset_index()
    return [{"trace": r.trace, "layer": int(r.layer), "max_abs_diff": float(r.max_abs_diff)}
            for r in grown.itertuples(index=False)]


def build(analysis: Analysis, located: pd.DataFrame | None = None,
          located_by_module: pd.DataFrame | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain data, from the folder's parts (one, unless the analysis
    reads a campaign part by part). `located` and `located_by_module`: what `harness locate` stored
    (harness.run.locate.located_steps and located_by_module), handed in: the report reads no trace."""
    store = analysis.results
    parts = analysis.per_part(report_part)
    chart = charts_mod.joined([p["charts"] for p in parts], analysis)
    # a (cell, prompt)'s entries come from one part, in its row order, or from its parts' runs joined
    runs = sorted([e for p in parts for e in p["runs"]] + _joined_entries([p["entry_runs"] for p in parts]),
                  key=lambda e: (e["status"] != "ok", e["cell"], e["prompt"]))
    statuses = pd.Series({}, dtype="int64")
    for part in parts:
        statuses = statuses.add(pd.Series(part["statuses"], dtype="int64"), fill_value=0)
    header = _joined_header(parts)
    descriptions = [e.experiment.description for e in store.experiments if e.experiment.description]
    cells = charts_mod.joined_cells([p["charts"] for p in parts])
    return {
        "meta": {
            "experiment": header["experiment"],
            "description": " / ".join(descriptions),
            "results": str(store.root),
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "reference": chart.reference,
            "run_ids": sorted(set().union(*(p["run_ids"] for p in parts))),
            "max_tokens": sorted(set().union(*(p["max_tokens"] for p in parts))),
            "statuses": {k: int(v) for k, v in statuses.sort_values(ascending=False, kind="stable").items()},
            "matrix": {a: sorted(set().union(*(p["matrix"][a] for p in parts))) for a in AXES},
            "provenance": {c: header[c] for c in PROVENANCE},
            "cells": len(cells),
        },
        "filters": varying(cells, keys_of(cells)) or ["engine"],
        "guarantees": _guarantees(analysis),
        "located": [{"setting": r["setting"], "prompt": r["prompt_id"], "repeat": int(r["repeat"]),
                     "step_kind": r["step_kind"], "step": int(r["step"]), "finding": r["finding"]}
                    for r in (located.to_dict("records") if located is not None else [])],
        "prompts": _prompt_texts(store),
        "outputs": {h: o for p in parts for h, o in p["outputs"].items()},
        "runs": runs,
        "charts": {
            "identical": _records(chart.identical),
            "divergence": _records(chart.divergence.groupby(["series", "batch_size", "first_divergence"])
                                   .size().rename("runs").reset_index()),
            "margins": _margin_points(chart.margins),
            "slowdown": _records(chart.slowdown),
            "probes": _probe_table(analysis.probes, chart.varying),
            "answers": _records(chart.answers),
            "splits": _split_records(chart.splits),
            "survival": _records(chart.survival),
            "flips_by_margin": _records(chart.flips_by_margin),
            "located_layers": _located_layers(located_by_module),
        },
    }


def render(payload: dict[str, Any]) -> str:
    """The page: the template with styles, script and data put inline (no network when opened)."""
    assets = resources.files("harness.report") / "assets"
    # no '<' at all inside the script element: model text such as '<!--' followed by '<script' would
    # otherwise put the HTML parser in its double-escaped state and the page would not load
    data = (json.dumps(payload, allow_nan=False, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
    title = f"{payload['meta']['experiment']}: determinism report"
    page = (assets / "report.html").read_text(encoding="utf-8")
    return (
        page.replace("{{TITLE}}", html.escape(title))
        .replace("{{CSS}}", (assets / "report.css").read_text(encoding="utf-8"))
        .replace("{{JS}}", (assets / "report.js").read_text(encoding="utf-8"))
        .replace("{{DATA}}", data)
    )


def write(analysis: Analysis, out: Path, located: pd.DataFrame | None = None,
          located_by_module: pd.DataFrame | None = None) -> dict[str, Any]:
    """Build and write the report atomically; returns the payload (for the CLI's summary line)."""
    payload = build(analysis, located, located_by_module)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render(payload), encoding="utf-8")
    tmp.replace(out)
    return payload


def summary_line(payload: dict[str, Any], target: Path) -> str:
    """What a written report holds, in one line: runs (entries aggregate runs that show the same
    thing, so runs are counted, not entries), cells, and how many departed from the reference."""
    meta = payload["meta"]
    runs = sum(entry["count"] for entry in payload["runs"])
    departed = sum(record["runs"] for record in payload["charts"]["divergence"])
    return (f"{target}: {runs} runs in {meta['cells']} cells, {departed} departed from the reference "
            f"({meta['reference']}); {target.stat().st_size / 1024:,.0f} KiB")
