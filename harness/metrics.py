"""Statistics from rows: unique outputs, agreement with a reference, first divergence, bounds.

Everything is computed from stored rows, so a new question can be asked of old results.
Token sequences are compared by hash first; the per-token walk runs once per distinct pair.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd
from pydantic import ValidationError

from harness.config import AXES, Matrix
from harness.errors import HarnessError

#: Columns that identify comparable settings (a cell, minus the ids).
KEY_COLUMNS: tuple[str, ...] = AXES + ("max_tokens",)
DEFAULT_REFERENCE: dict[str, Any] = {"batch_size": 1}
PROBE_STAT_COLUMNS = [
    "probe_steps", "probe_steps_differed", "probe_logits_compared", "probe_logits_differed",
    "probe_max_abs_diff", "probe_low_margin_frac",
]
ROW_COLUMNS = list(KEY_COLUMNS) + [
    "cell_id", "prompt_id", "repeat", "status", "error", "output_hash", "n_tokens", "target_tokens_per_s",
    "batch_tokens_per_s",
] + PROBE_STAT_COLUMNS


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """First position where `tokens` departs from `reference`; None when identical.

    A sequence that is a strict prefix of the other diverges at its end.
    """
    a = np.asarray(tokens, dtype=np.int64)
    b = np.asarray(reference, dtype=np.int64)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


def upper95(diverged: int, runs: int) -> float | None:
    """One-sided 95 % upper bound on the divergence rate.

    With no divergence in n runs this is the rule of three, 3/n; otherwise the exact
    (Clopper-Pearson) bound, found by bisection on the binomial tail.
    """
    if runs <= 0:
        return None
    if diverged == 0:
        return min(1.0, 3.0 / runs)
    if diverged >= runs:
        return 1.0

    def tail(p: float) -> float:  # P(X <= diverged | runs, p)
        logs = [
            math.lgamma(runs + 1) - math.lgamma(k + 1) - math.lgamma(runs - k + 1)
            + k * math.log(p) + (runs - k) * math.log1p(-p)
            for k in range(diverged + 1)
        ]
        top = max(logs)
        return math.exp(top) * sum(math.exp(x - top) for x in logs)

    lo, hi = diverged / runs, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > 0.05:
            lo = mid
        else:
            hi = mid
    return hi


def parse_reference(items: Iterable[str], option: str = "--reference") -> dict[str, Any]:
    """'axis=value' strings -> typed overrides; empty -> the default (batch_size=1)."""
    out: dict[str, Any] = {}
    for item in items:
        axis, sep, value = item.partition("=")
        axis = axis.strip()
        if not sep or axis not in AXES:
            raise HarnessError(f"{option} '{item}': expected AXIS=VALUE with AXIS one of {', '.join(AXES)}")
        probe = {"model": ["x"], axis: [value.strip()]}
        try:
            out[axis] = getattr(Matrix.model_validate(probe), axis)[0]
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise HarnessError(f"{option} '{item}': {msg}") from None
    return out or dict(DEFAULT_REFERENCE)


def against_reference(
    rows: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    reference: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """The ok rows, each with its reference run: `ref_hash`, `reference_cell`, `matched`, `first_divergence`.

    The reference of a run is the first repeat of the same prompt with the same settings, except
    the axes in `reference` (default: batch size 1). The reference run itself gets no verdict.
    """
    reference = dict(DEFAULT_REFERENCE if reference is None else reference)
    keys = list(KEY_COLUMNS)
    ok = rows[rows["status"] == "ok"].copy()
    ref_rows = ok[ok["repeat"] == 0].drop_duplicates(keys + ["prompt_id"])
    ref_table = ref_rows[keys + ["prompt_id", "output_hash", "cell_id"]].rename(
        columns={"output_hash": "ref_hash", "cell_id": "reference_cell"}
    )
    lookup = ok[keys + ["prompt_id"]].copy()
    for axis, value in reference.items():
        lookup[axis] = value
    lookup = lookup.astype({k: ref_table[k].dtype for k in keys if k in ref_table})
    merged = lookup.merge(ref_table, on=keys + ["prompt_id"], how="left")
    ok["ref_hash"] = merged["ref_hash"].to_numpy()
    ok["reference_cell"] = merged["reference_cell"].to_numpy()
    # The reference run itself is not evidence of agreement: leave it out of the comparison.
    ok["is_reference"] = (ok["cell_id"] == ok["reference_cell"]) & (ok["repeat"] == 0)
    ok.loc[ok["is_reference"], "ref_hash"] = None
    has_ref = ok["ref_hash"].notna()
    ok["matched"] = np.where(has_ref, ok["output_hash"] == ok["ref_hash"], np.nan)

    pairs = ok.loc[has_ref & (ok["output_hash"] != ok["ref_hash"]), ["output_hash", "ref_hash"]].drop_duplicates()
    divergence: dict[tuple[str, str], int | None] = {}
    if not pairs.empty:
        tokens = tokens_for(set(pairs["output_hash"]) | set(pairs["ref_hash"]))
        for out_hash, ref_hash in pairs.itertuples(index=False):
            divergence[(out_hash, ref_hash)] = first_divergence(tokens[out_hash], tokens[ref_hash])
    ok["first_divergence"] = [
        divergence.get((h, r)) if isinstance(r, str) and h != r else None
        for h, r in zip(ok["output_hash"], ok["ref_hash"])
    ]
    ok["first_divergence"] = pd.to_numeric(ok["first_divergence"], errors="coerce")
    return ok


def summarize(
    rows: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    reference: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """One record per (cell, prompt) with agreement statistics against the reference.

    `rows` needs ROW_COLUMNS; `tokens_for(hashes)` returns the token ids of those outputs.
    """
    reference = dict(DEFAULT_REFERENCE if reference is None else reference)
    keys = list(KEY_COLUMNS)
    group_cols = keys + ["cell_id", "prompt_id"]
    if rows.empty:
        return pd.DataFrame(columns=group_cols + ["runs"])

    status = (
        rows.pivot_table(index=group_cols, columns="status", values="repeat", aggfunc="count", fill_value=0)
        .rename(columns=lambda s: f"n_{s}")
    )
    for name in ("n_ok", "n_failed", "n_unsupported", "n_skipped"):
        if name not in status.columns:
            status[name] = 0
    errors = rows[rows["status"] != "ok"].groupby(group_cols, dropna=False)["error"].first().rename("error")
    ok = against_reference(rows, tokens_for, reference)

    g = ok.groupby(group_cols, dropna=False, sort=False)
    stats = pd.DataFrame(
        {
            "runs": g.size(),
            "unique_outputs": g["output_hash"].nunique(),
            "modal_share": ok.groupby(group_cols + ["output_hash"], dropna=False).size().groupby(level=group_cols).max()
            / g.size(),
            "match_rate": g["matched"].mean(),
            "compared": g["matched"].count(),
            "diverged": g["first_divergence"].count(),
            "first_divergence_min": g["first_divergence"].min(),
            "first_divergence_median": g["first_divergence"].median(),
            "tokens_median": g["n_tokens"].median(),
            "tokens_per_s_median": g["target_tokens_per_s"].median(),
            "reference_cell": g["reference_cell"].first(),
        }
    )
    stats["divergence_rate_upper95"] = [
        upper95(int(d), int(c)) if c > 0 else None for d, c in zip(stats["diverged"], stats["compared"])
    ]
    out = status.join(stats, how="left").join(errors, how="left").reset_index()
    out["runs"] = out["runs"].fillna(0).astype(int)
    out["status"] = np.select(
        [out["n_ok"] == out[["n_ok", "n_failed", "n_unsupported", "n_skipped"]].sum(axis=1),
         out["n_unsupported"] > 0, out["n_skipped"] > 0, out["n_failed"] > 0],
        ["ok", "unsupported", "skipped", "failed"], default="mixed",
    )
    out["reference"] = ",".join(f"{k}={v}" for k, v in reference.items())
    order = group_cols + [
        "status", "runs", "unique_outputs", "modal_share", "match_rate", "first_divergence_min",
        "first_divergence_median", "divergence_rate_upper95", "diverged", "compared", "tokens_median",
        "tokens_per_s_median", "reference", "reference_cell", "n_ok", "n_failed", "n_unsupported",
        "n_skipped", "error",
    ]
    return out[order].sort_values(group_cols, kind="stable").reset_index(drop=True)


SLOWDOWN_COLUMNS = [c for c in KEY_COLUMNS if c != "batch_invariant"]


def slowdown(rows: pd.DataFrame) -> pd.DataFrame:
    """What batch-invariant mode costs: cells that differ only in `batch_invariant`, paired.

    Runs are paired by prompt and repeat (the same batch composition), so each pair gives one
    ratio; the median and the spread over pairs are reported. `throughput_ratio` is tokens/s
    with the mode off divided by on (above 1: the mode is slower); `latency_ratio` is the
    request's time to its last token, on divided by off. Engine start and warm-up are not in
    these timings.
    """
    ok = rows[(rows["status"] == "ok") & rows["target_tokens_per_s"].notna()]
    keys = SLOWDOWN_COLUMNS + ["prompt_id", "repeat"]
    cols = keys + ["batch_tokens_per_s", "target_tokens_per_s", "n_tokens"]
    off = ok[~ok["batch_invariant"].astype(bool)][cols]
    on = ok[ok["batch_invariant"].astype(bool)][cols]
    pairs = off.merge(on, on=keys, suffixes=("_off", "_on"))
    if pairs.empty:
        return pd.DataFrame(columns=SLOWDOWN_COLUMNS + ["pairs", "throughput_ratio", "latency_ratio"])
    pairs["throughput"] = pairs["batch_tokens_per_s_off"] / pairs["batch_tokens_per_s_on"]
    latency_on = pairs["n_tokens_on"] / pairs["target_tokens_per_s_on"]
    latency_off = pairs["n_tokens_off"] / pairs["target_tokens_per_s_off"]
    pairs["latency"] = latency_on / latency_off
    g = pairs.groupby(SLOWDOWN_COLUMNS, dropna=False)
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
        }
    )
    return out.reset_index()


def probe_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Logit probes pooled per setting (over prompts and repeats): how much of the logits moved.

    `moved_share` is logits moved / logits compared over all compared steps; `max_abs_diff`
    the largest single move; `low_margin_frac` the mean share of near-tie steps.
    """
    probed = rows[rows["probe_steps"].notna()] if "probe_steps" in rows else rows.iloc[0:0]
    keys = list(KEY_COLUMNS)
    if probed.empty:
        return pd.DataFrame(columns=keys + ["runs", "steps", "steps_differed", "logits_compared",
                                            "logits_differed", "moved_share", "max_abs_diff", "low_margin_frac"])
    g = probed.groupby(keys, dropna=False, sort=True)
    compared, differed = g["probe_logits_compared"].sum(), g["probe_logits_differed"].sum()
    return pd.DataFrame({
        "runs": g.size(),
        "steps": g["probe_steps"].sum(),
        "steps_differed": g["probe_steps_differed"].sum(),
        "logits_compared": compared,
        "logits_differed": differed,
        "moved_share": differed / compared.where(compared > 0),
        "max_abs_diff": g["probe_max_abs_diff"].max(),
        "low_margin_frac": g["probe_low_margin_frac"].mean(),
    }).reset_index()
