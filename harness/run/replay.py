"""Forced-decode replay: each recorded output fed back through an engine's decode loop, token by
token, under another setting or on another machine, and compared with the source at every step.

A token comparison ends at the first divergence: after it, two runs are two texts. Replay goes on:
every recorded token of a run is forced through the replayer's decode loop (not a prefill, as
`rescore` does), in a batch composed as asked, and at each step the replayer says what
log-probability it gives the forced token, how far its top-1 led its top-2, and which token it
would have picked itself. So two settings (batch 4 and batch 1, Q4_1 and F32, two machines) are
compared over the whole trajectory, and the steps where the replayer would have left it are named.

Per run, with delta_i = replay_i - source_i (the forced token's log-probability under the replayer
minus the one the run had at decode time):

    steps              steps compared (both sides have a log-probability)
    mean_abs_delta     mean of |delta_i|; max_abs_delta its largest
    k3_kl              mean of exp(delta_i) - 1 - delta_i (as harness.run.rescore)
    would_split_steps  steps where the replayer's own argmax is not the forced token: where, under
                       the replayer, the run would have split; first_would_split the earliest
    would_split_runs   (per cell and prompt) runs with at least one such step

The replayer is the run's own engine, model and dtype unless `engine` / `dtype` say otherwise. The
batch is the run's own: its batch-mates at its position, read from the row, sampling as they did
(the target is forced), unless `batch_size` composes another, as a run of that size would have
been (1: alone). The argmax is greedy's pick: for sampled runs the steps are compared, and
`would_split` says where greedy would have gone elsewhere.

Replays land in RESULTS/replayed/<replay id>/<cell id>.parquet, each written whole, keyed by the run
and its output hash; the replay id names the replayer, the batch rule and the machine. Left out,
and said: runs with a shared context or padded batch-mates (those texts are not stored), runs of
no tokens, and cells of other experiments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.experiment.matrix import digest, expand
from harness.experiment.prompts import Batch, compose_batch
from harness.results.folder_rows import Results
from harness.run.rescore import (
    BUILT_BY,
    PlacedEngine,
    deltas,
    not_here,
    read_side,
    run_stats,
    scorer_spec,
    scoring_machine,
    side_path,
)

FOLDER = "replayed"
SCHEMA = pa.schema([
    ("cell_id", pa.string()), ("prompt_id", pa.string()), ("repeat", pa.int64()), ("output_hash", pa.string()),
    ("replay_logprobs", pa.list_(pa.float32())), ("replay_margins", pa.list_(pa.float32())),
    ("replay_argmax", pa.list_(pa.int32())), ("replayer", pa.string()), ("replay_id", pa.string()),
])
ROW_COLUMNS = ["cell_id", "prompt_id", "repeat", "status", "output_hash", "n_tokens", "context_tokens",
               "filler_tokens", "filler_ids", "batch_position", "batch_size", *BUILT_BY]
RUN_COLUMNS = ["steps", "mean_abs_delta", "max_abs_delta", "k3_kl", "would_split_steps", "first_would_split"]
SUMMARY_COLUMNS = ["runs", "steps", "mean_abs_delta", "max_abs_delta", "k3_kl", "would_split_runs",
                   "would_split_steps", "first_would_split"]


class Replayer(PlacedEngine):
    """One loaded engine that replays recorded outputs (Engine.generate with `force`)."""

    unavailable = "replay_unavailable"

    def __init__(self, spec: Any, base: Path | None, log: Callable[[str], None],
                 machine: dict[str, str] | None = None) -> None:
        from harness.engines.registry import engine_class

        super().__init__(engine_class(spec.engine).replay_spec(spec), base, log, machine)

    def __call__(self, texts: list[str], target: int, sampling: Any, tokens: list[int]) -> Any:
        return self.engine.generate(texts, target, sampling, force=list(tokens)).target


def replayable(results: Results, log: Callable[[str], None]) -> pd.DataFrame:
    """The folder's ok runs that can be replayed; the others are counted in a line each."""
    rows = results.read_rows(columns=ROW_COLUMNS)
    ok = rows[rows["status"] == "ok"]
    stored = (ok["context_tokens"].fillna(0) > 0) | (ok["filler_tokens"].fillna(0) > 0)
    if stored.any():
        log(f"{int(stored.sum())} run(s) with a shared context or padded batch-mates left out: those texts are not stored")
    empty = ok["n_tokens"].fillna(0) <= 0
    if (empty & ~stored).any():
        log(f"{int((empty & ~stored).sum())} run(s) with no tokens left out: nothing to replay")
    return ok[~stored & ~empty]


def run_batch(loaded: Any, run: Any, batch_size: int | None) -> Batch:
    """The batch a run is replayed in: its own (mates and position from the row), or one of `batch_size`."""
    prompts = loaded.prompt_set
    target = prompts.get(run.prompt_id)
    exp = loaded.experiment
    if batch_size is not None:
        return compose_batch(prompts, target, batch_size, int(run.repeat), exp.filler_seed)
    size, position = int(run.batch_size), int(run.batch_position if run.batch_position == run.batch_position else 0)
    if exp.batch_fill == "copies":
        return Batch((target,) * size, position, ())
    by_id = {f.id: f for f in prompts.fillers}
    ids = [] if run.filler_ids is None else [str(i) for i in run.filler_ids]
    mates = [by_id[i] for i in ids]
    return Batch(tuple(mates[:position] + [target] + mates[position:]), position, tuple(ids))


def replay_id(spec: Any, batch_size: int | None, machine: dict[str, str]) -> str:
    """The id of a replayer: its load, the batch rule and where it computes."""
    return digest({"spec": repr(spec), "batch": "own" if batch_size is None else batch_size, **machine}, 12)


def replay(results: Results, engine: str | None = None, dtype: str | None = None, batch_size: int | None = None,
           log: Callable[[str], None] = print, force: bool = False,
           any_device: bool = False) -> tuple[list[Path], list[str]]:
    """Replay the ok runs of the folder's current cells; a cell this replayer has replayed already is
    skipped unless `force`. Returns (the files written, one per replayer and cell; the replayers and
    cells that refused, each with its reason); a refusal leaves the others to run."""
    from harness.results.store import Store

    ok = replayable(results, log)
    here = scoring_machine()
    cells = {c.id: (c, loaded) for loaded in results.experiments for c in expand(loaded)}
    jobs: dict[str, tuple[Any, Any, list[str]]] = {}
    refused: list[str] = []
    for cell_id, part in ok.groupby("cell_id", sort=False):
        if cell_id not in cells:
            continue
        cell, loaded = cells[cell_id]
        why = not_here(part, here, any_device)
        if why is None and batch_size is not None and batch_size > 1 and not loaded.prompt_set.fillers:
            why = (f"--batch-size {batch_size} composes batches from the experiment's fillers, and "
                   f"'{loaded.experiment.name}' has none (give fillers, or replay each run in its own batch)")
        if why is not None:
            refused.append(f"cell {cell_id}: {why}")
            continue
        spec = scorer_spec(cell.load_spec(), engine, dtype)  # alone in its cache: no prefix kept between runs
        key = replay_id(spec, batch_size, here)
        if force or not _path(results.root, key, cell_id).exists():
            jobs.setdefault(key, (spec, loaded, []))[2].append(cell_id)
    written: list[Path] = []
    store = Store(results.root)
    for key, (spec, loaded, chosen) in jobs.items():
        player = Replayer(spec, loaded.base, log, here)
        if player.refusal:
            refused.append(player.refusal)
            continue
        runs = ok[ok["cell_id"].isin(chosen)]
        tokens = results.tokens_for(set(runs["output_hash"]))
        how = "its own batch" if batch_size is None else f"batches of {batch_size}"
        log(f"replaying {len(runs)} run(s) of {len(chosen)} cell(s) with {player.label}, each in {how}")
        exp = loaded.experiment
        with player:
            if (why := player.other_build(runs)) is not None:
                refused.append(f"{player.label}: {why}")
                continue
            description = json.dumps(json.loads(player.description) | {"batch": how}, sort_keys=True)
            for cell_id in chosen:
                cell = cells[cell_id][0]
                records = []
                for run in runs[runs["cell_id"] == cell_id].itertuples(index=False):
                    forced = tokens[run.output_hash]
                    batch = run_batch(loaded, run, batch_size)
                    sampling = cell.sampling(max(exp.max_tokens, len(forced)), exp.unseeded_fillers,
                                             exp.batch_fill == "copies")
                    out = player([p.text for p in batch.prompts], batch.target_position, sampling, forced)
                    records.append({"cell_id": cell_id, "prompt_id": run.prompt_id, "repeat": int(run.repeat),
                                    "output_hash": run.output_hash, "replay_logprobs": out.logprobs,
                                    "replay_margins": out.margins, "replay_argmax": out.argmax,
                                    "replayer": description, "replay_id": key})
                path = _path(results.root, key, cell_id)
                table = pa.Table.from_pylist(records, schema=SCHEMA)
                store.atomic_write(path, lambda tmp, t=table: pq.write_table(t, tmp))
                written.append(path)
    return written, refused


def _path(root: Path, key: str, cell_id: str) -> Path:
    return side_path(root, FOLDER, key, cell_id)


def read_replays(root: Path) -> pd.DataFrame:
    """Every stored replay of a results folder."""
    return read_side(root, FOLDER, SCHEMA)


def per_run(results: Results) -> pd.DataFrame:
    """Each replayed run against its source: RUN_COLUMNS, with the run's settings and the replayer."""
    from harness.results.columns import KEY_COLUMNS

    keys = list(KEY_COLUMNS) + results.option_axes
    replays = read_replays(results.root)
    columns = ["replayer", "replay_id", "cell_id", "prompt_id", "repeat"] + keys + RUN_COLUMNS
    if replays.empty:
        return pd.DataFrame(columns=columns)
    rows = results.read_rows(columns=keys + ["cell_id", "prompt_id", "repeat", "status", "output_hash"])
    matched = replays.merge(rows[rows["status"] == "ok"], on=["cell_id", "prompt_id", "repeat", "output_hash"])
    if matched.empty:
        return pd.DataFrame(columns=columns)
    source = results.folder.store.values_at("logprobs", matched).to_numpy()
    tokens = results.tokens_for(set(matched["output_hash"]))
    records = []
    for run, decode in zip(matched.itertuples(index=False), source):
        stats = run_stats(deltas(decode, run.replay_logprobs))
        forced = np.asarray(tokens[run.output_hash][:len(run.replay_argmax)])
        apart = np.flatnonzero(np.asarray(run.replay_argmax[:len(forced)]) != forced)
        records.append({"replayer": run.replayer, "replay_id": run.replay_id, "cell_id": run.cell_id,
                        "prompt_id": run.prompt_id, "repeat": run.repeat, **{k: getattr(run, k) for k in keys},
                        "steps": stats["tokens"], "mean_abs_delta": stats["mean_abs_delta"],
                        "max_abs_delta": stats["max_abs_delta"], "k3_kl": stats["k3_kl"],
                        "would_split_steps": len(apart), "first_would_split": int(apart[0]) if len(apart) else np.nan})
    return pd.DataFrame(records, columns=columns)


def summary(results: Results) -> pd.DataFrame:
    """Per replayer, cell and prompt: SUMMARY_COLUMNS over its runs (every step weighs the same)."""
    from harness.results.columns import KEY_COLUMNS

    keys = list(KEY_COLUMNS) + results.option_axes
    runs = per_run(results)
    columns = ["replayer", "replay_id", "cell_id", "prompt_id"] + keys + SUMMARY_COLUMNS
    if runs.empty:
        return pd.DataFrame(columns=columns)
    records = []
    for (rid, cell, prompt), part in runs.groupby(["replay_id", "cell_id", "prompt_id"], sort=True):
        steps = part["steps"].to_numpy(dtype=float)
        if steps.sum():
            weight = steps / steps.sum()
            mean, k3 = float(np.nansum(part["mean_abs_delta"] * weight)), float(np.nansum(part["k3_kl"] * weight))
        else:
            mean = k3 = np.nan
        records.append({"replayer": part["replayer"].iloc[0], "replay_id": rid, "cell_id": cell, "prompt_id": prompt,
                        **part[keys].iloc[0].to_dict(), "runs": len(part), "steps": int(steps.sum()),
                        "mean_abs_delta": mean, "max_abs_delta": float(part["max_abs_delta"].max()), "k3_kl": k3,
                        "would_split_runs": int((part["would_split_steps"] > 0).sum()),
                        "would_split_steps": int(part["would_split_steps"].sum()),
                        "first_would_split": part["first_would_split"].min()})
    return pd.DataFrame(records, columns=columns)
