"""Statistics from rows: unique outputs, agreement with a reference, first divergence, bounds.

Everything is computed from stored rows, so a new question can be asked of old results.
Token sequences are compared by hash first; the per-token walk runs once per distinct pair.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from harness.analysis import latency
from harness.analysis.bounds import upper95
from harness.analysis.divergence import against_reference
from harness.analysis.frames import in_run_order
from harness.analysis.mixing import PROVENANCE_COLUMNS, refuse_mixed
from harness.experiment.reference_rules import DEFAULT_REFERENCE
from harness.results.columns import KEY_COLUMNS, keys_of

PROBE_STAT_COLUMNS = [
    "probe_steps", "probe_steps_differed", "probe_logits_compared", "probe_logits_differed",
    "probe_max_abs_diff", "probe_low_margin_frac",
]

ROW_COLUMNS = list(KEY_COLUMNS) + [
    "cell_id", "prompt_id", "repeat", "boot", "load_id", "status", "error", "output_hash", "n_tokens", "target_tokens_per_s",
    "batch_tokens_per_s", "logprobs_hash", "prompt_tokens", "cached_tokens", "context_tokens_used", "ttft_s",
    "preemptions", "batch_preemptions", "draft_proposed", "draft_accepted",
    "prefill_probe_steps", "prefill_probe_steps_differed", "prefill_probe_first_diff_step",
    "prefill_probe_max_abs_diff", "prefill_probe_kl_mean", "prefill_probe_kl_max",
] + PROBE_STAT_COLUMNS + PROVENANCE_COLUMNS


#: per (cell, prompt): engine loads seen, the most unique outputs within one load, and the runs
#: compared with a reference run of the same load (same boot) and of another (cross boot)
BOOT_COLUMNS = ["loads", "unique_outputs_within_load", "same_boot_compared", "same_boot_diverged",
                "cross_boot_compared", "cross_boot_diverged"]


def _by_boot(ok: pd.DataFrame, g: Any) -> pd.DataFrame:
    """BOOT_COLUMNS of the compared runs `ok` (with load_id and same_load), grouped as `g` (their groupby
    by cell and prompt: its group numbers are reused, as factorizing the keys of a million rows again
    costs a tenth of a second each time)."""
    group = g.ngroup()
    labels = g.size().index  # in the order ngroup numbers the groups
    same = ok["same_load"]
    same_boot, cross_boot = same.fillna(False).to_numpy(dtype=bool), (~same).fillna(False).to_numpy(dtype=bool)
    judged = ok["matched"].notna().to_numpy()
    departed = ok["first_divergence"].notna().to_numpy()
    flags = pd.DataFrame({"same_boot_compared": same_boot & judged, "same_boot_diverged": same_boot & departed,
                          "cross_boot_compared": cross_boot & judged, "cross_boot_diverged": cross_boot & departed},
                         index=ok.index)
    counts = flags.groupby(group).sum()
    counts.index = labels[counts.index]
    within = ok.groupby([group, ok["load_id"]], sort=False)["output_hash"].nunique().groupby(level=0).max()
    within.index = labels[within.index]
    out = pd.DataFrame({"loads": g["load_id"].nunique(), "unique_outputs_within_load": within})
    return out.join(counts)


def summarize(
    rows: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    reference: dict[str, Any] | None = None,
    allow_mixed: Iterable[str] = (),
    logprobs_for: Callable[[set[str]], dict[str, Sequence[float]]] | None = None,
    reference_run: str = "first",
    compared: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """One record per (cell, prompt) with agreement statistics against the reference.

    `rows` needs ROW_COLUMNS; `tokens_for(hashes)` returns the token ids of those outputs;
    `compared`: against_reference of these rows, where the caller has it already.
    """
    reference = dict(DEFAULT_REFERENCE if reference is None else reference)
    keys = keys_of(rows)
    if rows.empty:
        return pd.DataFrame(columns=keys + ["cell_id", "prompt_id", "runs"])
    if compared is None:
        compared = against_reference(rows, tokens_for, reference, allow_mixed, logprobs_for, reference_run)
    return summary_of(rows, per_run(compared), keys, reference, reference_run)


#: per run, what a summary reads of its row besides the per_run figures
RUN_STATUS_COLUMNS = ["cell_id", "prompt_id", "status", "error"]


def per_run(compared: pd.DataFrame) -> pd.DataFrame:
    """Per compared (ok) run, the values the summary's figures are made of, by cell and prompt."""
    by = ["cell_id", "prompt_id"]
    # only what the statistics read: a copy of every column of a million rows costs what it holds
    used = by + ["output_hash", "matched", "first_divergence", "n_tokens", "target_tokens_per_s", "reference_cell",
                 "reference_repeat", "reference_share", "reference_tie", "node", "reference_node",
                 "logprob_first_diff", "logprob_max_abs_diff", "load_id", "same_load"]
    ok = compared[used]  # a new frame (columns chosen by a list): columns are added to it
    counts = ("preemptions", "batch_preemptions", "draft_proposed", "draft_accepted")
    for column in ("cached_tokens", "prompt_tokens", "context_tokens_used") + counts:
        ok[column] = compared[column] if column in compared else np.nan
    for column in counts:  # nullable ints as floats, NaN where the engine does not count
        ok[column] = pd.to_numeric(ok[column], errors="coerce").astype(float)
    for column, count in (("preempted", "preemptions"), ("batch_preempted", "batch_preemptions")):
        ok[column] = (ok[count] > 0).astype(float).where(ok[count].notna())
    ok["identical_lp"] = compared["logprobs_identical"].astype("Float64")
    return ok


def statuses(rows: pd.DataFrame) -> pd.DataFrame:
    """Every row's settings, status and error: with per_run of its compared runs, what summary_of reads
    (for the runs of one (cell, prompt) that lie in several parts of a campaign, joined first: see
    harness.analysis.partitioned)."""
    return rows[list(dict.fromkeys(keys_of(rows) + RUN_STATUS_COLUMNS))]


def joined_summary(cells: pd.DataFrame, rows: pd.DataFrame, ok: pd.DataFrame, reference: dict[str, Any],
                   reference_run: str) -> pd.DataFrame:
    """The summary of `cells` (summarized whole) and of the (cell, prompt)s whose runs were read in
    several parts (their statuses() and per_run(), joined), in one order: settings, cell, prompt."""
    if rows.empty:
        return cells
    more = summary_of(rows, ok, keys_of(rows), reference, reference_run)
    if cells.empty:
        return more
    order = keys_of(more) + ["cell_id", "prompt_id"]
    return (pd.concat([cells, more], ignore_index=True).sort_values(order, kind="stable", na_position="last")
            .reset_index(drop=True))


def summary_of(rows: pd.DataFrame, ok: pd.DataFrame, keys: list[str], reference: dict[str, Any],
               reference_run: str) -> pd.DataFrame:
    """One record per (cell, prompt): `rows` (settings, status and error of every run) and `ok` (per_run
    of the compared runs) summarized."""
    group_cols = keys + ["cell_id", "prompt_id"]
    # Settings are constant inside a cell: group by (cell, prompt), then put the settings back.
    by = ["cell_id", "prompt_id"]
    settings = rows.drop_duplicates("cell_id")[["cell_id"] + keys]
    status = (
        rows.groupby(by + ["status"], sort=False).size().unstack("status", fill_value=0)
        .rename(columns=lambda s: f"n_{s}")
    )
    status.columns.name = None
    for name in ("n_ok", "n_failed", "n_unsupported", "n_skipped"):
        if name not in status.columns:
            status[name] = 0
    errors = rows[rows["status"] != "ok"].groupby(by)["error"].first().rename("error")
    g = ok.groupby(by, sort=False)
    stats = pd.DataFrame(
        {
            "runs": g.size(),
            "unique_outputs": g["output_hash"].nunique(),
            "modal_share": ok.groupby(by + ["output_hash"]).size().groupby(level=by).max() / g.size(),
            "match_rate": g["matched"].mean(),
            "compared": g["matched"].count(),
            "diverged": g["first_divergence"].count(),
            "first_divergence_min": g["first_divergence"].min(),
            "first_divergence_median": g["first_divergence"].median(),
            "tokens_median": g["n_tokens"].median(),
            "tokens_per_s_median": g["target_tokens_per_s"].median(),
            "reference_cell": g["reference_cell"].first(),
            "reference_repeat": g["reference_repeat"].first(),
            "reference_share": g["reference_share"].first(),
            "reference_tie": g["reference_tie"].first(),
            "node": g["node"].first(),
            "reference_node": g["reference_node"].first(),
            "logprobs_identical": g["identical_lp"].mean(),
            "logprobs_compared": g["identical_lp"].count(),
            "logprob_first_diff_min": g["logprob_first_diff"].min(),
            "logprob_max_abs_diff": g["logprob_max_abs_diff"].max(),
            "prompt_tokens_median": g["prompt_tokens"].median(),
            "cached_tokens_median": g["cached_tokens"].median(),
            # runs the engine preempted at least once, and runs with a preempted request anywhere in
            # their batch (NaN: the engine does not count preemptions)
            "preempted_runs": g["preempted"].sum(min_count=1),
            "preempted_batches": g["batch_preempted"].sum(min_count=1),
            "preemptions": g["preemptions"].sum(min_count=1),
            # speculative decoding: drafted tokens the model accepted, over all runs
            "draft_acceptance": g["draft_accepted"].sum(min_count=1) / g["draft_proposed"].sum(min_count=1),
        }
    )
    stats = stats.join(_by_boot(ok, g))
    stats["divergence_rate_upper95"] = [
        upper95(int(d), int(c)) if c > 0 else None for d, c in zip(stats["diverged"], stats["compared"])
    ]
    out = status.join(stats, how="left").join(errors, how="left").reset_index().merge(settings, on="cell_id")
    out["runs"] = out["runs"].fillna(0).astype(int)
    out["status"] = np.select(
        [out["n_ok"] == out[["n_ok", "n_failed", "n_unsupported", "n_skipped"]].sum(axis=1),
         out["n_unsupported"] > 0, out["n_skipped"] > 0, out["n_failed"] > 0],
        ["ok", "unsupported", "skipped", "failed"], default="mixed",
    )
    out["reference"] = ",".join(f"{k}={v}" for k, v in reference.items())
    out["reference_run"] = reference_run
    order = group_cols + [
        "status", "runs", "unique_outputs", "modal_share", "match_rate", "first_divergence_min",
        "first_divergence_median", "divergence_rate_upper95", "diverged", "compared", "logprobs_identical",
        "logprobs_compared", "logprob_first_diff_min", "logprob_max_abs_diff", "tokens_median",
        "prompt_tokens_median", "cached_tokens_median", "preempted_runs", "preempted_batches", "preemptions",
        "draft_acceptance",
        "tokens_per_s_median", "reference", "reference_run", "reference_cell", "reference_repeat",
        "reference_share", "reference_tie", "node", "reference_node", "n_ok", "n_failed", "n_unsupported",
        "n_skipped", "error",
    ] + BOOT_COLUMNS
    return out[order].sort_values(group_cols, kind="stable").reset_index(drop=True)


def slowdown_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The runs `slowdown` pairs, with the columns it reads, in run order: none where no run has the
    mode on (nothing pairs). Pairs lie in one prompt's runs, so a campaign's parts give these rows
    and the parent pairs them as one read would (harness.analysis.partitioned)."""
    ok = rows[((rows["status"] == "ok") & rows["target_tokens_per_s"].notna()).to_numpy()]
    if "batch_invariant" not in ok or not ok["batch_invariant"].astype(bool).any():
        ok = ok.iloc[0:0]
    wanted = keys_of(rows) + ["cell_id", "prompt_id", "repeat", "status", "batch_tokens_per_s", "target_tokens_per_s",
                              "n_tokens", "ttft_s", "itl_s", *START_UP, *PROVENANCE_COLUMNS]
    return in_run_order(ok, wanted)


def slowdown(rows: pd.DataFrame, allow_mixed: Iterable[str] = ()) -> pd.DataFrame:
    """What batch-invariant mode costs: cells that differ only in `batch_invariant`, paired.

    Runs are paired by prompt and repeat (the same batch composition), so each pair gives one
    ratio; the median and the spread over pairs are reported. `throughput_ratio` is tokens/s
    with the mode off divided by on (above 1: the mode is slower); `latency_ratio` is the
    request's time to its last token, on divided by off. Engine start and warm-up are not in
    these timings: they are shown beside them (`load_s_off` / `_on`: the engine loads', `warmup_s_off`
    / `_on`: the cells' warm-up batches, medians). Beside them, serving latency on each side over the
    same pairs, and its ratio on / off: TTFT, ITL, TPOT and E2EL at p50/p90/p99
    (harness.analysis.latency; `ttft_s` and `itl_s` are read where the rows have them).
    """
    ok = rows[(rows["status"] == "ok") & rows["target_tokens_per_s"].notna()]
    setting = keys_of(rows, drop=["batch_invariant"])
    keys = setting + ["prompt_id", "repeat"]
    cols = keys + ["batch_tokens_per_s", "target_tokens_per_s", "n_tokens"]
    cols += [c for c in ("ttft_s", "itl_s", *START_UP) if c in ok]
    cols += [c for c in ["cell_id"] + PROVENANCE_COLUMNS if c in ok]
    off = ok[~ok["batch_invariant"].astype(bool)][cols]
    on = ok[ok["batch_invariant"].astype(bool)][cols]
    pairs = off.merge(on, on=keys, suffixes=("_off", "_on"))
    if not pairs.empty and any(c in ok for c in PROVENANCE_COLUMNS):
        side = {s: pairs[[c + s for c in ["cell_id"] + PROVENANCE_COLUMNS if c in ok]].rename(
            columns=lambda c, s=s: c.removesuffix(s)) for s in ("_off", "_on")}
        # a slowdown divides two throughputs: never of two machines, whatever --allow-mixed says
        refuse_mixed(side["_off"], side["_on"], set(allow_mixed) - {"host"}, "pairing batch-invariant off/on runs",
                     "off", "on")
    if pairs.empty:
        return pd.DataFrame(columns=setting + ["pairs", "throughput_ratio", "latency_ratio"]
                            + [f"{c}_{side}" for c in START_UP for side in ("off", "on")] + SERVING_COLUMNS)
    pairs["throughput"] = pairs["batch_tokens_per_s_off"] / pairs["batch_tokens_per_s_on"]
    latency_on = pairs["n_tokens_on"] / pairs["target_tokens_per_s_on"]
    latency_off = pairs["n_tokens_off"] / pairs["target_tokens_per_s_off"]
    pairs["latency"] = latency_on / latency_off
    g = pairs.groupby(setting, dropna=False)
    out = pd.DataFrame(
        {
            "pairs": g.size(),
            "throughput_ratio": g["throughput"].median(),
            "throughput_ratio_min": g["throughput"].min(),
            "throughput_ratio_max": g["throughput"].max(),
            "latency_ratio": g["latency"].median(),
            "latency_ratio_min": g["latency"].min(),
            "latency_ratio_max": g["latency"].max(),
            "tokens_per_s_off": g["batch_tokens_per_s_off"].median(),
            "tokens_per_s_on": g["batch_tokens_per_s_on"].median(),
            # start-up beside the cost, since the mode changes it too (kernel variants, compile, graphs)
            **{f"{c}_{side}": g[f"{c}_{side}"].median() if f"{c}_{side}" in pairs else np.nan
               for c in START_UP for side in ("off", "on")},
        }
    )
    serving = pd.DataFrame.from_dict(
        {key: latency.compared(latency.percentiles(part, "_off"), latency.percentiles(part, "_on"))
         for key, part in g}, orient="index")
    serving.index = out.index
    return pd.concat([out, serving.reindex(columns=SERVING_COLUMNS)], axis=1).reset_index()


#: the start-up columns (schema 12) the slowdown shows beside the cost, medians over the pairs' loads and cells
START_UP = ("load_s", "warmup_s")
#: the slowdown's latency columns: each metric at each percentile, off, on and their ratio
SERVING_COLUMNS = [f"{latency.columns(m, p)}_{side}" for m in latency.METRICS for p in latency.PERCENTILES
                   for side in ("off", "on", "ratio")]


def probe_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The probed runs with the columns `probe_summary` reads, in run order (a run's probe is its own:
    a campaign's parts give these rows and the parent sums them as one read would)."""
    probed = rows[rows["probe_steps"].notna().to_numpy()] if "probe_steps" in rows else rows.iloc[0:0]
    wanted = keys_of(rows) + ["cell_id", "prompt_id", "repeat", *PROBE_STAT_COLUMNS]
    return in_run_order(probed, wanted)


def probe_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Logit probes pooled per setting (over prompts and repeats): how much of the logits moved.

    `moved_share` is logits moved / logits compared over all compared steps; `max_abs_diff`
    the largest single move; `low_margin_frac` the mean share of near-tie steps.
    """
    probed = rows[rows["probe_steps"].notna()] if "probe_steps" in rows else rows.iloc[0:0]
    keys = keys_of(rows)
    if probed.empty:
        return pd.DataFrame(columns=keys + ["runs", "steps", "steps_differed", "logits_compared",
                                            "logits_differed", "moved_share", "max_abs_diff", "low_margin_frac"])
    g = probed.groupby(keys, dropna=False, sort=True)

    def counted(column: str) -> pd.Series:  # whole numbers, whether or not a read typed them as floats
        return g[column].sum().astype("int64")

    compared, differed = counted("probe_logits_compared"), counted("probe_logits_differed")
    return pd.DataFrame({
        "runs": g.size(),
        "steps": counted("probe_steps"),
        "steps_differed": counted("probe_steps_differed"),
        "logits_compared": compared,
        "logits_differed": differed,
        "moved_share": differed / compared.where(compared > 0),
        "max_abs_diff": g["probe_max_abs_diff"].max(),
        "low_margin_frac": g["probe_low_margin_frac"].mean(),
    }).reset_index()
