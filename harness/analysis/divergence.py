"""Each run against its reference run: first divergence, the run that stands for a reference setting
(first or modal), twin settings refused, and how far log-probabilities moved."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from harness.analysis.frames import pair_lookup
from harness.analysis.mixing import IMPLIED_BY_AXIS, PROVENANCE_COLUMNS, machine_of, refuse_mixed
from harness.core.errors import HarnessError, UsageError
from harness.experiment.reference_rules import DEFAULT_REFERENCE, refuse_reference_run
from harness.results.columns import keys_of, option_columns


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


def _given_stand_ins(ok: pd.DataFrame, carried: pd.DataFrame | None, stand_ins: pd.DataFrame) -> pd.DataFrame:
    """The rows of the runs `stand_ins` names (from `ok` or `carried`), with their share and tie."""
    run = ["cell_id", "prompt_id", "repeat"]
    pool = ok if carried is None or carried.empty else pd.concat(
        [ok, carried[(carried["status"] == "ok").to_numpy()][list(ok.columns.intersection(carried.columns))]],
        ignore_index=True).drop_duplicates(run)
    chosen = stand_ins.rename(columns={"reference_repeat": "repeat"})[run + ["reference_share", "reference_tie"]]
    return pool.merge(chosen.astype({"repeat": pool["repeat"].dtype}), on=run, how="inner")


def refuse_twins(rows: pd.DataFrame) -> None:
    """Two cells claiming one setting and prompt among the ok `rows`: name both, never pick one silently.
    Every statistic that relates runs by their settings (a reference, a batch-invariant pair, a
    setting's percentiles) would count both, so every table refuses them alike, whole or part by part."""
    keys = keys_of(rows)
    ok = rows if (rows["status"] == "ok").all() else rows[(rows["status"] == "ok").to_numpy()]
    _refuse_twins(ok.drop_duplicates(["cell_id", "prompt_id"])[["cell_id"] + keys + ["prompt_id"]], keys + ["prompt_id"])


def _refuse_twins(first: pd.DataFrame, keys: list[str]) -> None:
    """Two cells claiming one setting and prompt in one record per cell and prompt: refuse_twins."""
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
    stand_ins: pd.DataFrame | None = None,
    carried: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The ok rows, each with its reference run: `ref_hash`, `reference_cell`, `reference_repeat`,
    `matched`, `first_divergence`.

    The reference of a run is a run of the same prompt with the same settings, except the axes in
    `reference` (default: batch size 1), chosen by `reference_run` (see reference_repeats). The
    reference run itself gets no verdict.
    A run and its reference must agree in provenance (MIXABLE), except what the compared axes
    imply or `allow_mixed` names; otherwise HarnessError.
    `stand_ins` (reference_repeats of all the runs, where `rows` are some of them: a part that cuts a
    prompt by its runs) names the runs that stand for their cells; those not among `rows` are in
    `carried`, read for that alone: they are no run of this part.
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
    if stand_ins is None:
        stands, share, tie = _stand_ins(ok, reference_run)
        first = ok[stands].assign(reference_share=share[stands], reference_tie=tie[stands])
    else:
        first = _given_stand_ins(ok, carried, stand_ins)
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
    nodes = dict(zip(first["cell_id"], machine_of(first)))  # a cell's runs come from one machine
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


def earliest_moved(compared: pd.DataFrame) -> pd.DataFrame:
    """Per cell that is not its own reference, the run that moved earliest against its reference run
    (`compared`: against_reference's frame): its tokens split first, else its first log-probability
    that differs; with `split`, that step (harness locate rebuilds it)."""
    other = compared[compared["cell_id"].astype(str) != compared["reference_cell"].astype(str)]
    lp_moved = other["logprobs_identical"].eq(False).fillna(False) if "logprobs_identical" in other else False
    moved = other[other["first_divergence"].notna() | lp_moved].copy()
    if moved.empty:
        return moved
    split = moved["first_divergence"].where(moved["first_divergence"].notna(), moved.get("logprob_first_diff"))
    moved["split"] = pd.to_numeric(split, errors="coerce")
    moved = moved[moved["split"].notna()].sort_values(["cell_id", "split", "prompt_id", "repeat"], kind="stable")
    return moved.drop_duplicates("cell_id")
