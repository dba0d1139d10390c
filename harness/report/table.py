"""The summary as a rich table: only the axes that vary are shown, so it fits a terminal."""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd
from rich.markup import escape
from rich.table import Table

from harness.experiment.axes import SHORT as AXIS_SHORT
from harness.experiment.varying import varying
from harness.report.plain import PlainTable
from harness.results.columns import keys_of

#: column names shortened in tables (the axes' own short names, harness.experiment.axes)
SHORT = {**AXIS_SHORT, "prompt_id": "prompt"}


def legend(columns: list[str]) -> str:
    """The shortened axis names among `columns`, spelled out (empty when none is shortened)."""
    used = [f"{SHORT[c]} = {c}" for c in columns if c in SHORT and c != "prompt_id"]
    return ("columns: " + ", ".join(used)) if used else ""


def _fmt(value: object, kind: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * float(value):.0f}%"
    if kind == "pct1":
        return f"{100 * float(value):.1f}%"
    if kind == "int":
        return str(int(value))
    if kind == "f1":
        return f"{float(value):.1f}"
    if kind == "f2":
        return f"{float(value):.2f}"
    if kind == "f3":
        return f"{float(value):.3f}"
    if kind == "g3":
        return f"{float(value):.3g}"
    return str(value)


def _varying(summary: pd.DataFrame) -> list[str]:
    return varying(summary, keys_of(summary))


def machine_lines(summary: pd.DataFrame, most: int = 5) -> list[str]:
    """Where runs were compared with a reference made on another machine (the compared axis is the
    hardware, or --allow-mixed host said so): which machine each side ran on."""
    if "node" not in summary or "reference_node" not in summary:
        return []
    paired = summary[summary["reference_node"].notna() & summary["node"].notna()]
    apart = paired[paired["node"] != paired["reference_node"]].drop_duplicates(["cell_id", "reference_cell"])
    lines = [f"[yellow]compared across machines[/yellow]: cell {r.cell_id} ran on {escape(r.node or '?')}; its "
             f"reference {r.reference_cell} on {escape(r.reference_node or '?')}" for r in apart.head(most).itertuples()]
    if len(apart) > most:
        lines.append(f"(+{len(apart) - most} more cells compared across machines)")
    return lines


def _setting_label(axes: list[str], key: Any) -> str:
    """'engine=vllm, batch_size=8' for one group of settings; a setting the cell does not have (another
    engine's swept option) is left out."""
    key = key if isinstance(key, tuple) else (key,)
    return escape(", ".join(f"{a}={v}" for a, v in zip(axes, key) if not pd.isna(v)))


def _boot_split(rec: dict[str, Any]) -> str:
    """'; same boot as the reference run 8/8 identical, other boots 3/8' where runs of another engine
    load were compared (boots > 1, or a reference from another load); empty otherwise."""
    cross, same = int(rec.get("cross_boot_compared") or 0), int(rec.get("same_boot_compared") or 0)
    if not cross or not same:  # a reference of another load only (another dtype, engine): not a restart
        return ""
    same_d, cross_d = int(rec.get("same_boot_diverged") or 0), int(rec.get("cross_boot_diverged") or 0)
    return (f"; same boot as the reference run {same - same_d}/{same} identical, other boots (engine loads) "
            f"{cross - cross_d}/{cross}")


def _flip_classes(rec: dict[str, Any]) -> str:
    """'; departures: 2 near tie, 1 confident (likely bug)' from a settings record's flip counts."""
    from harness.analysis.flips import CLASSES

    counts = [(c, int(rec.get(f"flips_{c}") or 0)) for c in CLASSES]
    parts = [f"{n} {c.replace('_', ' ')}" + (" (likely bug)" if c == "confident" else "") for c, n in counts if n]
    return f"; departures by reference margin: {', '.join(parts)}" if parts else ""


def verdict_lines(summary: pd.DataFrame, settings: pd.DataFrame | None = None) -> list[str]:
    """One line per setting, over its prompts: how many runs matched the reference, the divergence
    rate's bound with prompts as the unit (and pooled over runs, labelled), how far runs agree
    before they split, and how often a close call flipped. `settings`: harness.analysis.by_setting.agreement
    of the summary (computed here when not given: without survival and near-tie figures)."""
    from harness.analysis.by_setting import agreement

    varying = _varying(summary) or ["engine"]
    settings = agreement(summary) if settings is None else settings
    lines = []
    for rec in settings.sort_values(varying, kind="stable", na_position="last").to_dict("records"):
        label = _setting_label(varying, tuple(rec[a] for a in varying))
        compared, diverged = int(rec["compared"]), int(rec["diverged"])
        guarantee = rec.get("guarantee")
        text = f"{label}: {guarantee.replace('_', ' ') + '; ' if isinstance(guarantee, str) else ''}" \
               f"{compared - diverged}/{compared} runs identical to the reference"
        if diverged:
            text += f", first divergence at token {int(rec['first_divergence_min'])} at the earliest"
            median, by_then = rec.get("median_tokens_to_divergence"), rec.get("departed_by_median")
            if not pd.isna(median):  # said from the runs that had departed by the median, not from all that did
                gone = diverged if by_then is None or pd.isna(by_then) else int(by_then)
                if 2 * gone >= compared:
                    text += f", half departed by token {int(median)} ({gone}/{compared})"
                else:  # the curve's median counts only runs still going that far
                    text += (f", Kaplan-Meier median {int(median)} tokens among the runs still going that far "
                             f"({gone}/{compared} had departed by then; runs that ended sooner leave the count)")
        bound, pooled = rec["upper95_prompts"], rec["upper95_pooled"]
        if pd.isna(bound):
            text += (f"; no bound with prompts as the unit from {int(rec['prompts'])} prompt "
                     f"(pooled over runs: rate < {100 * pooled:.0f}%)")
        else:
            text += (f"; divergence rate < {100 * bound:.0f}% (95% upper bound, prompts as the unit; "
                     f"pooled over runs: < {100 * pooled:.0f}%)")
        if int(rec.get("logprobs_compared") or 0):
            same, compared = int(rec["logprobs_identical_runs"]), int(rec["logprobs_compared"])
            text += f"; {same}/{compared} with bitwise-equal log-probabilities"
        elif compared:
            text += "; log-probabilities not recorded"
        near = rec.get("near_ties")
        if near is not None and not pd.isna(near) and int(near) > 0:
            text += (f"; {int(near)} near ties ({rec['near_tie_density']:.0f} per 1000 tokens), "
                     f"{int(rec['flips_at_near_ties'])} flipped")
        text += _boot_split(rec)
        text += _flip_classes(rec)
        lines.append(text)
    orphans = summary[(summary["runs"] > 0) & summary["reference_cell"].isna()]
    for key, part in orphans.groupby(varying, sort=True, dropna=False):
        label = _setting_label(varying, key)
        lines.append(f"{label}: no reference run ({part['reference'].iloc[0]}) for {len(part)} prompt(s); "
                     "those runs are not compared")
    return lines


#: (cell, prompt) records a terminal table shows; more is for summary.parquet or --format csv
TABLE_ROWS = 200


def shown_records(summary: pd.DataFrame, limit: int = TABLE_ROWS) -> pd.DataFrame:
    """At most `limit` records, those where runs differ, fail or lack a reference first (in table order)."""
    if len(summary) <= limit:
        return summary
    notable = ((summary["unique_outputs"].fillna(1) > 1) | (summary["diverged"].fillna(0) > 0)
               | (summary["status"] != "ok") | summary["reference_cell"].isna())
    return pd.concat([summary[notable], summary[~notable]]).head(limit).sort_index()


#: summary columns left out of the terminal table while all zero (vLLM counts preemptions in every run), unless
#: the folder asked for what they count (a small KV cache: then zero preemptions is the finding)
_ZERO_HIDDEN = {"cached_tokens_median": None, "preempted_runs": "kv_cache_tokens",
                "preempted_batches": "kv_cache_tokens"}


def _nonzero(summary: pd.DataFrame, col: str) -> bool:
    axis = _ZERO_HIDDEN[col]
    asked = axis is not None and axis in summary and summary[axis].fillna(0).gt(0).any()
    return bool(asked or summary[col].fillna(0).gt(0).any())


def summary_table(summary: pd.DataFrame, title: str, limit: int = TABLE_ROWS) -> Table:
    """Per cell and prompt; past `limit` records only the notable ones show, and the caption says so
    (a terminal table of thousands of lines is read by no one and takes seconds to draw)."""
    varying = _varying(summary)
    table = PlainTable(title=title)
    shown = shown_records(summary, limit)
    notes = [legend(varying)]
    if len(shown) < len(summary):
        notes.append(f"{len(shown)} of {len(summary)} records shown: those where runs differ, fail or have no "
                     "reference first; every record: --format csv (or summary.parquet, from run or summarize --save)")
    table.caption = "\n".join(n for n in notes if n) or None
    for col in varying + ["prompt_id"]:
        table.add_column(SHORT.get(col, col))
    extra = [(name, col, kind) for name, col, kind in (
        ("lp\nbitwise", "logprobs_identical", "pct"), ("lp\ndiff@", "logprob_first_diff_min", "int"),
        ("cached", "cached_tokens_median", "int"), ("pre-\nempted", "preempted_runs", "int"),
        ("batch\npreempted", "preempted_batches", "int"),
        ("draft\naccept", "draft_acceptance", "pct"),
    ) if col in summary and summary[col].notna().any() and (col not in _ZERO_HIDDEN or _nonzero(summary, col))]
    for name in ("status", "runs", "unique", "match", "diverge@\nmin/med", "upper95") + tuple(e[0] for e in extra) + ("tok/s",):
        table.add_column(name, justify="right" if name != "status" else "left")
    for rec in shown.to_dict("records"):
        status = rec["status"]
        style = {"ok": "", "unsupported": "yellow", "skipped": "dim", "failed": "red"}.get(status, "magenta")
        div = "-" if _fmt(rec["first_divergence_min"]) == "-" else (
            f"{_fmt(rec['first_divergence_min'], 'int')}/{_fmt(rec['first_divergence_median'], 'f1')}"
        )
        table.add_row(
            *[_fmt(rec[c]) for c in varying + ["prompt_id"]],
            status,
            _fmt(rec["runs"], "int"),
            _fmt(rec["unique_outputs"], "int"),
            _fmt(rec["match_rate"], "pct"),
            div,
            _fmt(rec["divergence_rate_upper95"], "f3"),
            *[_fmt(rec[col], kind) for _, col, kind in extra],
            _fmt(rec["tokens_per_s_median"], "f1"),
            style=style,
        )
    return table


def slowdown_table(cost: pd.DataFrame, title: str) -> Table:
    shown = varying(cost, keys_of(cost, drop=["batch_invariant"]))
    table = PlainTable(title=title, caption=legend(shown) or None)
    for col in shown + ["pairs", "tok/s off", "tok/s on", "throughput x", "latency x", "start-up s off / on"]:
        table.add_column(SHORT.get(col, col), justify="right")
    for rec in cost.to_dict("records"):
        table.add_row(
            *[_fmt(rec[c]) for c in shown],
            _fmt(rec["pairs"], "int"),
            _fmt(rec["tokens_per_s_off"], "f1"),
            _fmt(rec["tokens_per_s_on"], "f1"),
            f"{rec['throughput_ratio']:.2f} ({rec['throughput_ratio_min']:.2f}-{rec['throughput_ratio_max']:.2f})",
            f"{rec['latency_ratio']:.2f} ({rec['latency_ratio_min']:.2f}-{rec['latency_ratio_max']:.2f})",
            _start_up(rec),
        )
    return table


def _start_up(rec: dict) -> str:
    """The engine load plus the cell's warm-up, off / on, in seconds ('-' where not recorded: schema < 12)."""
    sides = []
    for side in ("off", "on"):
        load, warm = rec.get(f"load_s_{side}"), rec.get(f"warmup_s_{side}")
        known = [v for v in (load, warm) if v is not None and v == v]
        sides.append(f"{sum(known):.1f}" if known else "-")
    return " / ".join(sides)


def serving_table(cost: pd.DataFrame, title: str) -> Table | None:
    """The slowdown's serving latency: per setting and metric, p50/p90/p99 with the mode off and on (ms)
    and their ratios on / off; None where no run recorded any latency."""
    from harness.analysis.latency import PERCENTILES, long_form

    shown = varying(cost, keys_of(cost, drop=["batch_invariant"]))
    frame = long_form(cost, shown)
    measured = [c for c in frame.columns if c.endswith("_ms")]
    frame = frame[frame[measured].notna().any(axis=1)] if not frame.empty else frame
    if frame.empty:
        return None
    table = PlainTable(title=title, caption=legend(shown) or None)
    for col in shown + ["metric"]:
        table.add_column(SHORT.get(col, col), justify="right")
    for side in ("off", "on"):
        table.add_column(f"{side} ms\n" + "/".join(f"p{p}" for p in PERCENTILES), justify="right")
    table.add_column("on / off\n" + "/".join(f"p{p}" for p in PERCENTILES), justify="right")
    for rec in frame.to_dict("records"):
        table.add_row(
            *[_fmt(rec[c]) for c in shown], rec["metric"],
            *["/".join(_fmt(rec[f"p{p}_{side}_ms"], "f1") for p in PERCENTILES) for side in ("off", "on")],
            "/".join(_fmt(rec[f"p{p}_ratio"], "f2") for p in PERCENTILES),
        )
    return table


def latency_table(frame: pd.DataFrame, title: str) -> Table:
    """Per setting and metric: p50/p90/p99 in ms and their ratios against the reference setting
    (harness.analysis.latency.by_setting); metrics no run recorded are left out."""
    from harness.analysis.latency import METRICS, PERCENTILES, TITLES, columns

    shown = varying(frame, keys_of(frame)) or ["engine"]
    table = PlainTable(title=title, caption=legend(shown) or None)
    for col in shown + ["runs", "metric"]:
        table.add_column(SHORT.get(col, col), justify="right")
    table.add_column("ms\n" + "/".join(f"p{p}" for p in PERCENTILES), justify="right")
    table.add_column("vs reference\n" + "/".join(f"p{p}" for p in PERCENTILES), justify="right")
    for rec in frame.to_dict("records"):
        for metric in METRICS:
            names = [columns(metric, p) for p in PERCENTILES]
            if all(_fmt(rec.get(n)) == "-" for n in names):
                continue
            table.add_row(*[_fmt(rec[c]) for c in shown], _fmt(rec["runs"], "int"), TITLES[metric],
                          "/".join(_fmt(1000 * rec[n], "f1") for n in names),
                          "/".join(_fmt(rec.get(f"{n}_ratio"), "f2") for n in names))
    return table


def preemption_lines(summary: pd.DataFrame) -> list[str]:
    """Cells that asked for a small KV cache (kv_cache_tokens) and saw no preemption in any run's batch, or
    whose engine does not count them: their runs are not evidence of what preemption does."""
    if "kv_cache_tokens" not in summary or "preempted_batches" not in summary:
        return []
    asked = summary[(summary["kv_cache_tokens"].fillna(0) > 0) & (summary["status"] == "ok")]
    lines = []
    for cell, part in asked.groupby("cell_id", sort=False):
        counted = part["preempted_batches"]
        if counted.isna().all():
            lines.append(f"cell {cell}: the engine does not count preemptions: not preemption evidence")
        elif counted.fillna(0).sum() == 0:
            lines.append(f"cell {cell} (kv_cache_tokens={int(part['kv_cache_tokens'].iloc[0])}, batch_size="
                         f"{int(part['batch_size'].iloc[0])}): no request of any run's batch was preempted: not "
                         "preemption evidence (make the cache smaller or the batch larger)")
    return lines


def _per_setting(frame: pd.DataFrame, title: str, headers: list[str]) -> tuple[Table, list[str]]:
    """A table with one row per setting: the axes that vary in `frame`, then `headers`."""
    shown = varying(frame, keys_of(frame)) or ["engine"]
    table = PlainTable(title=title, caption=legend(shown) or None)
    for col in shown + headers:
        table.add_column(SHORT.get(col, col), justify="right")
    return table, shown


def probe_table(probes: pd.DataFrame, title: str) -> Table:
    """Logit probes per setting: steps compared, how many logits moved, the largest move."""
    table, varying = _per_setting(probes, title, ["runs", "steps", "steps moved", "logits moved", "max |d|",
                                                  "margin<0.1"])
    for rec in probes.to_dict("records"):
        table.add_row(
            *[_fmt(rec[c]) for c in varying],
            _fmt(rec["runs"], "int"),
            _fmt(rec["steps"], "int"),
            _fmt(rec["steps_differed"], "int"),
            f"{_fmt(rec['moved_share'], 'pct1')} of {_fmt(rec['logits_compared'], 'int')}",
            f"{float(rec['max_abs_diff']):.3g}",
            _fmt(rec["low_margin_frac"], "pct1"),
        )
    return table


def answer_table(answers: pd.DataFrame, title: str) -> Table:
    """Answer-level statistics per setting: agreement, accuracy with its interval, change vs the reference."""
    table, varying = _per_setting(answers, title, ["prompts", "TARr", "TARa", "accuracy [95% CI]", "best/worst",
                                                   "answers = ref", "prompts changed", "acc. diff [95% CI]",
                                                   "len spread"])
    for rec in answers.to_dict("records"):
        table.add_row(
            *[_fmt(rec[c]) for c in varying],
            _fmt(rec["prompts"], "int"),
            _fmt(rec["tar_r"], "pct"),
            _fmt(rec["tar_a"], "pct"),
            f"{_fmt(rec['accuracy'], 'pct1')} [{_fmt(rec['accuracy_low'], 'pct1')}, {_fmt(rec['accuracy_high'], 'pct1')}]",
            f"{_fmt(rec['best'], 'pct')}/{_fmt(rec['worst'], 'pct')}",
            _fmt(rec["answer_agreement"], "pct1"),
            _fmt(rec["prompts_changed"], "pct1"),
            "-" if pd.isna(rec["accuracy_diff"]) else
            f"{100 * rec['accuracy_diff']:+.1f} [{100 * rec['diff_low']:+.1f}, {100 * rec['diff_high']:+.1f}]",
            _fmt(rec["length_spread_median"], "f1"),
        )
    return table


def split_table(frame: pd.DataFrame, title: str) -> Table:
    """The split trees: one line per branch, indented by depth, runs and distinct outputs per branch."""
    table = PlainTable(title=title)
    for col in ("cell", "prompt", "at token", "branch", "runs", "unique", "share"):
        table.add_column(col, justify="right" if col in ("at token", "runs", "unique", "share") else "left")
    for (cell, prompt), part in frame.groupby(["cell_id", "prompt_id"], sort=False):
        depth: dict[int, int] = {-1: -1}
        for rec in part.to_dict("records"):
            depth.setdefault(rec["node"], depth.get(rec["parent_node"], -1) + 1)
            label = "  " * depth[rec["node"]] + repr(rec["token_text"])
            table.add_row(cell, prompt, str(rec["split_at"]), label, str(rec["runs"]), str(rec["unique_outputs"]),
                          f"{100 * rec['share']:.1f}%")
    return table


def rescore_table(frame: pd.DataFrame, threshold: float) -> Table:
    """Per scorer and setting (prompts pooled, every token weighing the same): re-scoring figures."""
    varying = _varying(frame)
    table = PlainTable(title="re-scored: decode-time log-probability vs one prefill by the scorer "
                             f"(share beyond |delta| > {threshold:g})")
    for name in ("scorer",) + tuple(varying) + ("runs", "tokens", "mean|Δ|", "max|Δ|", "k3 KL", "share>τ"):
        table.add_column(name)
    weight = frame["tokens"].astype(float)
    for key, part in frame.groupby(["scorer"] + varying, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        w = weight.loc[part.index]
        mean = lambda c: float((part[c] * w).sum() / w.sum()) if w.sum() else float("nan")  # noqa: E731
        scorer = json.loads(key[0])
        table.add_row(f"{scorer['engine']} {scorer['dtype']}", *[str(v) for v in key[1:]], str(int(part["runs"].sum())),
                      str(int(w.sum())), _fmt(mean("mean_abs_delta"), "g3"), _fmt(part["max_abs_delta"].max(), "g3"),
                      _fmt(mean("k3_kl"), "g3"), _fmt(mean("share_above"), "pct1"))
    return table
