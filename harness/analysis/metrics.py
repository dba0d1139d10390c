"""Statistics from rows: unique outputs, agreement with a reference, first divergence, bounds.

Everything is computed from stored rows, so a new question can be asked of old results.
Token sequences are compared by hash first; the per-token walk runs once per distinct pair.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from harness.analysis import latency
from harness.core.errors import HarnessError, UsageError
from harness.experiment.reference_rules import DEFAULT_REFERENCE, REFERENCE_RUNS, parse_reference, refuse_reference_run  # noqa: F401
from harness.results import provenance_fields
from harness.results.columns import KEY_COLUMNS, keys_of, option_columns

PROBE_STAT_COLUMNS = [
    "probe_steps", "probe_steps_differed", "probe_logits_compared", "probe_logits_differed",
    "probe_max_abs_diff", "probe_low_margin_frac",
]
#: What must agree between a run and the run it is compared or pooled with: another model file,
#: engine version, row schema or chat template makes a difference that is not the axis's, and so
#: does another machine ('host': the node, its GPU's uuid, driver and CUDA version).
MIXABLE: tuple[str, ...] = provenance_fields.MIXABLE
#: the row columns that say which machine made a row; together they are the 'host' above
MACHINE_COLUMNS = provenance_fields.MACHINE
#: what a compared axis changes by its nature (a dtype export is another model file, another GPU
#: type is another machine, ...)
IMPLIED_BY_AXIS: dict[str, frozenset[str]] = {
    "model": frozenset({"model_sha256", "chat_template", "cpu_kernels"}),
    "dtype": frozenset({"model_sha256", "cpu_kernels"}),  # llama.cpp repacks some weight types, not others
    "engine": frozenset({"engine_version", "model_sha256", "chat_template", "cpu_kernels"}),
    "gpu": frozenset({"host", "cpu_kernels"}),
    # another interpreter: another build of the engine, its chat template and kernels
    "environment": frozenset({"engine_version", "chat_template", "cpu_kernels"}),
    "llamacpp.extra_bufts": frozenset({"cpu_kernels"}),
    "llama-server.extra_bufts": frozenset({"cpu_kernels"}),
}
#: the row columns the pairing rule reads
PROVENANCE_COLUMNS = list(provenance_fields.PAIRED)
ROW_COLUMNS = list(KEY_COLUMNS) + [
    "cell_id", "prompt_id", "repeat", "boot", "load_id", "status", "error", "output_hash", "n_tokens", "target_tokens_per_s",
    "batch_tokens_per_s", "logprobs_hash", "prompt_tokens", "cached_tokens", "context_tokens_used", "ttft_s",
    "preemptions", "batch_preemptions", "draft_proposed", "draft_accepted",
    "prefill_probe_steps", "prefill_probe_steps_differed", "prefill_probe_first_diff_step",
    "prefill_probe_max_abs_diff", "prefill_probe_kl_mean", "prefill_probe_kl_max",
] + PROBE_STAT_COLUMNS + PROVENANCE_COLUMNS


def select_setting(frame: pd.DataFrame, setting: dict[str, Any]) -> pd.DataFrame:
    """The rows of one setting; a setting an engine does not have (a swept option of another engine,
    missing in its rows) matches missing values."""
    mask = np.ones(len(frame), dtype=bool)
    for column, value in setting.items():
        mask &= (frame[column].isna() if pd.isna(value) else frame[column] == value).to_numpy()
    return frame[mask]


def setting_ids(frame: pd.DataFrame, keys: list[str]) -> tuple[np.ndarray, pd.DataFrame]:
    """(per row, the number of its setting; per number, the setting's `keys`), settings numbered in
    sorted order. Worked out per cell, since a cell holds one setting: grouping a million rows by
    a dozen setting columns costs seconds, grouping a few hundred cells nothing."""
    cells = frame.drop_duplicates("cell_id")
    number = cells.groupby(keys, dropna=False, sort=True, observed=True).ngroup().to_numpy()
    per_row = number[pd.Index(cells["cell_id"]).get_indexer(frame["cell_id"])]
    settings = cells[keys].assign(_n=number).drop_duplicates("_n").sort_values("_n").drop(columns="_n")
    return per_row, settings.reset_index(drop=True)


def per_value(column: pd.Series, fn: Callable[[Any], Any], missing: Any = None) -> pd.Series:
    """`fn` of each row's value, computed once per distinct value (an object column; `missing` where
    the value is missing). A million runs of a few outputs cost a few calls, and equal results
    share one Python object instead of a million copies of a text."""
    codes, uniques = pd.factorize(column)
    values = np.empty(len(uniques) + 1, dtype=object)
    values[:-1] = [fn(u) for u in uniques]
    values[-1] = missing
    return pd.Series(values[codes], index=column.index, dtype=object, copy=False)


def pair_lookup(left: pd.Series, right: pd.Series, found: dict[tuple[Any, Any], Any]) -> np.ndarray:
    """found[(left, right)] per row as floats (NaN where absent or None): one lookup per distinct pair."""
    out = np.full(len(left), np.nan)
    if not found or not len(left):
        return out
    table = pd.Series([np.nan if v is None else float(v) for v in found.values()],
                      index=pd.MultiIndex.from_tuples(list(found)))
    wanted = pd.MultiIndex.from_arrays([left.astype(object).to_numpy(), right.astype(object).to_numpy()])
    return table.reindex(wanted).to_numpy(dtype=float)


def chat_template_of(engine_info: pd.Series) -> pd.Series:
    """The chat template a row was made with (its hash where the engine gives one), from engine_info."""

    def one(text: Any) -> str:
        try:
            info = json.loads(text) if isinstance(text, str) and text else {}
        except ValueError:
            return ""
        return str(info.get("chat_template_sha256") or info.get("chat_template") or "")

    return per_value(engine_info, one, missing="")


def _machine_label(host: str, uuid: str, driver: str, cuda: str) -> str:
    extra = ", ".join(x for x in (uuid, driver and f"driver {driver}", cuda and f"CUDA {cuda}") if x)
    return f"{host} ({extra})" if uuid and extra else host


def _machine_of(frame: pd.DataFrame) -> pd.Series:
    """Which machine made each row: 'host (GPU uuid, driver D, CUDA C)', from the columns present."""
    parts = pd.DataFrame({c: frame[c].astype(object).where(frame[c].notna(), "").astype(str) if c in frame else ""
                          for c in MACHINE_COLUMNS}, index=frame.index)
    machines = parts.drop_duplicates()
    labels = {tuple(m): _machine_label(*m) for m in machines.itertuples(index=False)}
    return pd.Series([labels[tuple(m)] for m in parts.itertuples(index=False)] if len(machines) > 1 else
                     [next(iter(labels.values()), "")] * len(parts), index=frame.index, dtype=object)


def _provenance(frame: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame(index=frame.index)
    for col in MIXABLE:
        if col == "chat_template":
            out[col] = chat_template_of(frame["engine_info"]) if "engine_info" in frame else ""
        elif col == "host":
            out[col] = _machine_of(frame)
        elif col == "schema_version" and col in frame:
            out[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64").astype(str)
        else:
            out[col] = frame[col].astype(object).where(frame[col].notna(), "").astype(str) if col in frame else ""
    return out


def _cell_at(frame: pd.DataFrame, i: int) -> str:
    return str(frame["cell_id"].iloc[i]) if "cell_id" in frame else "?"


def refuse_mixed(
    left: pd.DataFrame, right: pd.DataFrame, allowed: Iterable[str], what: str,
    left_name: str = "run", right_name: str = "reference",
) -> None:
    """Raise when rows paired position by position differ in provenance that is not allowed to.

    `left` and `right` hold `cell_id` and the provenance columns (or engine_info), aligned.
    """
    allowed = set(allowed)
    a, b = _provenance(left), _provenance(right)
    for col in MIXABLE:
        if col in allowed:
            continue
        differ = (a[col].to_numpy() != b[col].to_numpy())
        if differ.any():
            i = int(np.flatnonzero(differ)[0])
            raise HarnessError(
                f"{what}: {col} differs between paired rows ({int(differ.sum())} pair(s)), e.g. "
                f"{left_name} cell {_cell_at(left, i)}: {a[col].iloc[i] or '(none)'} vs "
                f"{right_name} cell {_cell_at(right, i)}: {b[col].iloc[i] or '(none)'}; "
                f"a difference in {col} is not the compared axis's. Compare them only on purpose: --allow-mixed {col}"
            )


def parse_allow_mixed(items: Iterable[str]) -> frozenset[str]:
    """--allow-mixed values (repeatable, or comma-separated), each one of MIXABLE."""
    out = set()
    for item in items:
        for name in item.split(","):
            name = name.strip()
            if name not in MIXABLE:
                raise UsageError(f"--allow-mixed '{name}': allowed: {', '.join(MIXABLE)}")
            out.add(name)
    return frozenset(out)


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


@lru_cache(maxsize=65536)
def upper95(diverged: int, runs: int) -> float | None:
    """Exact one-sided 95 % upper bound on the divergence rate (Clopper-Pearson).

    The largest rate p under which seeing at most `diverged` of `runs` still has probability
    0.05. For 0 of n that is 1 - 0.05**(1/n) (0.259 for n = 10; the "rule of three", 3/n, is
    its large-n approximation); for n of n it is 1. Monotone in `diverged`.
    """
    if runs <= 0:
        return None
    if diverged <= 0:
        return 1.0 - 0.05 ** (1.0 / runs)
    if diverged >= runs:
        return 1.0
    k = np.arange(diverged + 1)
    log_choose = math.lgamma(runs + 1) - np.array([math.lgamma(i + 1) + math.lgamma(runs - i + 1) for i in k])

    def tail(p: float) -> float:  # P(X <= diverged | runs, p), decreasing in p
        logs = log_choose + k * math.log(p) + (runs - k) * math.log1p(-p)
        top = logs.max()
        return float(math.exp(top) * np.exp(logs - top).sum())

    lo, hi = diverged / runs, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > 0.05:
            lo = mid
        else:
            hi = mid
    return hi


#: resamples of the prompt-clustered bound (seeded: the same rows give the same bound)
CLUSTER_DRAWS = 2000


def prompt_upper95(diverged: Sequence[int], compared: Sequence[int], seed: int = 0) -> float:
    """A one-sided 95 % upper bound on a setting's divergence rate with prompts, not runs, as the
    independent unit (runs of one prompt share its text and its near ties: they are not
    independent evidence). Arrays hold one entry per prompt.

    No divergence: 1 - 0.05 ** (1 / prompts), the exact bound as if each prompt were one trial.
    Divergences over two or more prompts: the 95th percentile of the pooled rate over prompts
    resampled with replacement (a cluster bootstrap), and never below the pooled bound
    (`upper95` over all runs), which accounts for the binomial noise inside each prompt.
    Divergences in a single prompt: NaN, since one prompt cannot speak for others.
    """
    d = np.asarray(diverged, dtype=float)
    n = np.asarray(compared, dtype=float)
    keep = n > 0
    d, n = d[keep], n[keep]
    if not len(n):
        return float("nan")
    total = int(d.sum())
    if total == 0:
        return 1.0 - 0.05 ** (1.0 / len(n))
    if len(n) < 2:
        return float("nan")
    pick = np.random.default_rng(seed).integers(0, len(n), size=(CLUSTER_DRAWS, len(n)))
    rates = d[pick].sum(axis=1) / n[pick].sum(axis=1)
    return float(max(np.percentile(rates, 95), upper95(total, int(n.sum())) or 0.0))


def reference_repeats(ok: pd.DataFrame, rule: str = "first") -> pd.DataFrame:
    """Per (cell_id, prompt_id) of ok rows, the run that stands for it when it is a reference:
    `reference_repeat`, `reference_share` (the share of its runs that gave that output) and
    `reference_tie` (another output was as frequent; run order chose).

    first: the lowest ok repeat (a failed repeat 0 does not leave the prompt without a reference);
    modal: the first repeat of the most frequent output, so one unlucky run does not decide every
    verdict of the prompt.
    """
    stands, share, tie = _stand_ins(ok, rule)
    chosen = ok[stands]
    return pd.DataFrame({
        "cell_id": chosen["cell_id"].to_numpy(), "prompt_id": chosen["prompt_id"].to_numpy(),
        "reference_repeat": chosen["repeat"].to_numpy(), "reference_share": share[stands],
        "reference_tie": tie[stands],
    })


def _stand_ins(ok: pd.DataFrame, rule: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per ok row: (whether it is the run that stands for its cell and prompt under `rule`, the share
    of its cell and prompt's runs that gave its output, whether another output was as frequent
    under `modal`). On integer codes, since a million rows come through here."""
    refuse_reference_run(rule)
    cell, _ = pd.factorize(ok["cell_id"])
    prompt, prompts = pd.factorize(ok["prompt_id"])
    output, outputs = pd.factorize(ok["output_hash"])
    group = cell.astype(np.int64) * max(len(prompts), 1) + prompt
    combo = group * max(len(outputs), 1) + output
    repeat = ok["repeat"].to_numpy()
    per = pd.DataFrame({"group": group, "combo": combo, "repeat": repeat})
    counted = per.groupby("combo", sort=False).agg(group=("group", "first"), size=("repeat", "size"),
                                                   first=("repeat", "min")).reset_index()
    by_group = counted.groupby("group", sort=False)["size"]
    counted["share"] = counted["size"] / by_group.transform("sum")
    top = counted["size"] == by_group.transform("max")
    counted["tie"] = (top.groupby(counted["group"], sort=False).transform("sum") > 1) & (rule == "modal")
    order = (["group", "first"], [True, True]) if rule == "first" else (["group", "size", "first"], [True, False, True])
    chosen = counted.sort_values(order[0], ascending=order[1], kind="stable").drop_duplicates("group")
    best = chosen.set_index("group")
    at = pd.Index(best.index)
    where = at.get_indexer(group)
    stands = (combo == best["combo"].to_numpy()[where]) & (repeat == best["first"].to_numpy()[where])
    share = counted.set_index("combo")["share"].reindex(combo).to_numpy()
    return stands, share, np.asarray(best["tie"].to_numpy()[where], dtype=bool)


def _refuse_twins(first: pd.DataFrame, keys: list[str]) -> None:
    """Two cells claiming one setting and prompt: name both, never pick one silently."""
    twins = first[first.duplicated(keys, keep=False)]
    if not twins.empty:
        head = twins.sort_values(keys, kind="stable").head(2)  # one setting and prompt, two cells
        a, b = head["cell_id"].iloc[0], head["cell_id"].iloc[1]
        raise HarnessError(
            f"cells {a} and {b} both claim prompt '{head['prompt_id'].iloc[0]}' with the same settings "
            f"({', '.join(f'{k}={head[k].iloc[0]}' for k in ('engine', 'model', 'dtype', 'batch_size'))}); "
            "they come from different experiments (e.g. a stale cell read with --all-cells, or a mixed merge): "
            "remove one, or read the current experiment only"
        )


def against_reference(
    rows: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    reference: dict[str, Any] | None = None,
    allow_mixed: Iterable[str] = (),
    logprobs_for: Callable[[set[str]], dict[str, Sequence[float]]] | None = None,
    reference_run: str = "first",
) -> pd.DataFrame:
    """The ok rows, each with its reference run: `ref_hash`, `reference_cell`, `reference_repeat`,
    `matched`, `first_divergence`.

    The reference of a run is a run of the same prompt with the same settings, except the axes in
    `reference` (default: batch size 1), chosen by `reference_run` (see reference_repeats). The
    reference run itself gets no verdict.
    A run and its reference must agree in provenance (MIXABLE), except what the compared axes
    imply or `allow_mixed` names; otherwise HarnessError.
    """
    reference = dict(DEFAULT_REFERENCE if reference is None else reference)
    keys = keys_of(rows)
    unswept = [a for a in reference if a not in keys]
    if unswept:  # every cell would be its own reference and every run would match
        raise UsageError(f"--reference {unswept[0]}={reference[unswept[0]]}: these results do not sweep "
                         f"{unswept[0]}; swept engine options here: {', '.join(option_columns(rows)) or 'none'}")
    is_ok = (rows["status"] == "ok").to_numpy()
    # columns are added, never written into: a shallow copy (a million rows are not copied twice)
    ok = (rows if is_ok.all() else rows[is_ok]).copy(deep=False)
    stands, share, tie = _stand_ins(ok, reference_run)
    first = ok[stands].assign(reference_share=share[stands], reference_tie=tie[stands])
    _refuse_twins(first[["cell_id"] + keys + ["prompt_id"]], keys + ["prompt_id"])
    for column in ("logprobs_hash", "load_id"):
        if column not in ok:
            ok[column] = None
            first = first.assign(**{column: None})
    ref_table = first[keys + ["prompt_id", "output_hash", "cell_id", "logprobs_hash", "repeat", "reference_share",
                              "reference_tie", "load_id"]].rename(
        columns={"output_hash": "ref_hash", "cell_id": "reference_cell", "logprobs_hash": "ref_logprobs_hash",
                 "repeat": "reference_repeat", "load_id": "reference_load"}
    )
    # Settings are constant inside a cell: find each cell's reference runs once, at the cell level
    # (a few hundred records), then give every run those of its cell and prompt.
    lookup = ok.drop_duplicates("cell_id")[["cell_id"] + keys]
    for axis, value in reference.items():
        lookup[axis] = value
    lookup = lookup.astype({k: ref_table[k].dtype for k in keys if k in ref_table})
    carried = ["ref_hash", "reference_cell", "ref_logprobs_hash", "reference_repeat", "reference_share",
               "reference_tie", "reference_load"]
    per_cell = lookup.merge(ref_table, on=keys, how="inner")[["cell_id", "prompt_id"] + carried]
    merged = ok[["cell_id", "prompt_id"]].merge(per_cell, on=["cell_id", "prompt_id"], how="left")
    for column in carried:  # texts stay Python objects (pandas 3 would convert a million of them to Arrow strings)
        values = merged[column].to_numpy()
        ok[column] = pd.Series(values, index=ok.index, dtype=object) if values.dtype == object else values
    if any(c in ok for c in PROVENANCE_COLUMNS):
        present = [c for c in PROVENANCE_COLUMNS if c in ok]
        # one record per distinct (run's cell, its provenance, reference cell): the same verdict
        paired = ok[ok["reference_cell"].notna()].drop_duplicates(["cell_id", "reference_cell"] + present)
        by_cell = first.drop_duplicates("cell_id").set_index("cell_id")
        refs = by_cell.loc[paired["reference_cell"]].reset_index()
        implied = set().union(*(IMPLIED_BY_AXIS.get(a, frozenset()) for a in reference))
        refuse_mixed(paired.reset_index(drop=True), refs, implied | set(allow_mixed), "comparing runs with their reference")
    # The reference run itself is not evidence of agreement: leave it out of the comparison.
    nodes = dict(zip(first["cell_id"], _machine_of(first)))  # a cell's runs come from one machine
    ok["node"] = ok["cell_id"].map(nodes).astype(object)
    ok["reference_node"] = ok["reference_cell"].map(nodes).astype(object)
    ok["is_reference"] = (ok["cell_id"] == ok["reference_cell"]) & (ok["repeat"] == ok["reference_repeat"])
    ok.loc[ok["is_reference"], "ref_hash"] = None
    has_ref = ok["ref_hash"].notna()
    ok["matched"] = np.where(has_ref, ok["output_hash"] == ok["ref_hash"], np.nan)
    # same boot: the run and its reference run came from one engine load (unknown for older rows)
    known = has_ref & ok["load_id"].notna() & ok["reference_load"].notna()
    ok["same_load"] = pd.array(np.where(known, ok["load_id"] == ok["reference_load"], pd.NA), dtype="boolean")

    pairs = ok.loc[has_ref & (ok["output_hash"] != ok["ref_hash"]), ["output_hash", "ref_hash"]].drop_duplicates()
    divergence: dict[tuple[str, str], int | None] = {}
    if not pairs.empty:
        tokens = tokens_for(set(pairs["output_hash"]) | set(pairs["ref_hash"]))
        for out_hash, ref_hash in pairs.itertuples(index=False):
            divergence[(out_hash, ref_hash)] = first_divergence(tokens[out_hash], tokens[ref_hash])
    ok["first_divergence"] = pair_lookup(ok["output_hash"], ok["ref_hash"], divergence)
    return _logprob_comparison(ok, logprobs_for)


def logprob_difference(a: Sequence[float], b: Sequence[float], steps: int) -> tuple[int | None, float]:
    """(first step whose log-probabilities are not bitwise equal, largest |difference|) over `steps` steps;
    the difference is NaN (not compared), not 0.0, when no step is shared before the split."""
    n = min(len(a), len(b), steps)
    if n == 0:  # the runs part at their first step (or one has none): no step was compared
        return None, float("nan")
    x = np.asarray(a[:n], dtype=np.float32)
    y = np.asarray(b[:n], dtype=np.float32)
    unequal = x.view(np.uint32) != y.view(np.uint32)  # bitwise: NaN equals the same NaN, -0.0 is not 0.0
    if not unequal.any():
        return None, 0.0
    with np.errstate(invalid="ignore"):
        gap = np.abs(x.astype(np.float64) - y.astype(np.float64))
    return int(np.flatnonzero(unequal)[0]), float(np.nanmax(gap)) if np.isfinite(gap).any() else float("nan")


def _logprob_comparison(
    ok: pd.DataFrame, logprobs_for: Callable[[set[str]], dict[str, Sequence[float]]] | None
) -> pd.DataFrame:
    """`logprobs_identical` (tokens equal and every step's chosen-token log-probability bitwise equal
    to the reference's), and where they are not: `logprob_first_diff` (the first step that differs,
    over the steps both runs share) and `logprob_max_abs_diff`. Empty where a side has no log-probabilities."""
    both = ok["ref_hash"].notna() & ok["logprobs_hash"].notna() & ok["ref_logprobs_hash"].notna()
    same = ok["logprobs_hash"] == ok["ref_logprobs_hash"]
    ok["logprobs_identical"] = pd.array(np.where(both, same & (ok["matched"] == 1), pd.NA), dtype="boolean")
    ok["logprob_first_diff"] = np.nan
    ok["logprob_max_abs_diff"] = np.where(both & same, 0.0, np.nan)
    pending = ok[both & ~same]
    if pending.empty or logprobs_for is None:
        return ok
    values = logprobs_for(set(pending["logprobs_hash"]) | set(pending["ref_logprobs_hash"]))
    found: dict[tuple[str, str, float], tuple[int | None, float]] = {}
    first, largest = [], []
    for mine, ref, split in zip(pending["logprobs_hash"], pending["ref_logprobs_hash"], pending["first_divergence"]):
        key = (mine, ref, split)
        if key not in found:
            steps = int(split) if split == split else 1 << 30  # up to the first token that differs
            found[key] = logprob_difference(values.get(mine, []), values.get(ref, []), steps) \
                if mine in values and ref in values else (None, float("nan"))
        first.append(found[key][0])
        largest.append(found[key][1])
    ok.loc[pending.index, "logprob_first_diff"] = pd.to_numeric(pd.Series(first, index=pending.index, dtype=object))
    ok.loc[pending.index, "logprob_max_abs_diff"] = largest
    return ok


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
    group_cols = keys + ["cell_id", "prompt_id"]
    if rows.empty:
        return pd.DataFrame(columns=group_cols + ["runs"])

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
    if compared is None:
        compared = against_reference(rows, tokens_for, reference, allow_mixed, logprobs_for, reference_run)
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


def slowdown(rows: pd.DataFrame, allow_mixed: Iterable[str] = ()) -> pd.DataFrame:
    """What batch-invariant mode costs: cells that differ only in `batch_invariant`, paired.

    Runs are paired by prompt and repeat (the same batch composition), so each pair gives one
    ratio; the median and the spread over pairs are reported. `throughput_ratio` is tokens/s
    with the mode off divided by on (above 1: the mode is slower); `latency_ratio` is the
    request's time to its last token, on divided by off. Engine start and warm-up are not in
    these timings. Beside them, serving latency on each side over the same pairs, and its ratio on /
    off: TTFT, ITL, TPOT and E2EL at p50/p90/p99 (harness.analysis.latency; `ttft_s` and `itl_s` are read
    where the rows have them).
    """
    ok = rows[(rows["status"] == "ok") & rows["target_tokens_per_s"].notna()]
    setting = keys_of(rows, drop=["batch_invariant"])
    keys = setting + ["prompt_id", "repeat"]
    cols = keys + ["batch_tokens_per_s", "target_tokens_per_s", "n_tokens"]
    cols += [c for c in ("ttft_s", "itl_s") if c in ok]
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
        return pd.DataFrame(columns=setting + ["pairs", "throughput_ratio", "latency_ratio"] + SERVING_COLUMNS)
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
        }
    )
    serving = pd.DataFrame.from_dict(
        {key: latency.compared(latency.percentiles(part, "_off"), latency.percentiles(part, "_on"))
         for key, part in g}, orient="index")
    serving.index = out.index
    return pd.concat([out, serving.reindex(columns=SERVING_COLUMNS)], axis=1).reset_index()


#: the slowdown's latency columns: each metric at each percentile, off, on and their ratio
SERVING_COLUMNS = [f"{latency.columns(m, p)}_{side}" for m in latency.METRICS for p in latency.PERCENTILES
                   for side in ("off", "on", "ratio")]


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
