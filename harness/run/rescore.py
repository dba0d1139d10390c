"""Re-scoring: each ok run's prompt + output prefilled in one pass by a scoring engine, and the
log-probability it gives every generated token stored beside the one the run had at decode time.

This is the train/inference mismatch RL teams measure (a sampler's log-probabilities against a
trainer's re-scoring pass), and, with the run's own engine and model as the scorer, the decode
vs prefill question: does the arithmetic of one long prefill give each token the probability the
step-by-step decode gave it? The scorer runs alone (batch 1) with no prefix cache; by default it
is the run's own engine, model and dtype, and `--engine` / `--dtype` score under another.

Per run, with d_i the decode-time and s_i the scoring log-probability of token i and
delta_i = s_i - d_i:

    mean_abs_delta   mean of |delta_i|
    max_abs_delta    max of |delta_i|
    k3_kl            mean of exp(delta_i) - 1 - delta_i: the k3 estimate of KL(decode || score)
                     (unbiased when the tokens were sampled from the decode distribution; at
                     greedy decoding they were not, and it is a divergence score, not a KL)
    share_above      share of tokens with |delta_i| > threshold (an importance-sampling clamp)

Scores land in RESULTS/rescored/<scorer id>/<cell id>.parquet, each written whole (atomic rename),
keyed by the run (cell, prompt, repeat) and its output hash; a run whose output changed is never
matched with a stale score. A cell already scored by the same scorer is not scored again (unless
forced), so `rescore` resumes like `run`. Cells with a shared context (context_tokens > 0) are not rescored: the context text
is not stored with the rows.

The scorer is placed like a run: its machine (host, device) is part of its id and of its
description (with the engine's build), so two machines' scores never pool in one set, and runs that
ran on a GPU are not scored on a machine without that GPU (its CPU would define their noise)
unless asked (`any_device`), with a line that says why.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.experiment.matrix import digest, expand
from harness.results.folder_rows import Results

FOLDER = "rescored"
#: the |delta| beyond which a token counts in share_above (nats; 0.18 is a 1.2x ratio, a common clamp)
THRESHOLD = 0.18
SCHEMA = pa.schema([
    ("cell_id", pa.string()), ("prompt_id", pa.string()), ("repeat", pa.int64()), ("output_hash", pa.string()),
    ("score_logprobs", pa.list_(pa.float32())), ("scorer", pa.string()), ("scorer_id", pa.string()),
])
RUN_COLUMNS = ["runs", "tokens", "mean_abs_delta", "max_abs_delta", "k3_kl", "share_above"]


#: the row columns that say what made a run: where (device), under which interpreter, by which engine
#: build; a run is re-read only by the same (`not_here`, `PlacedEngine.other_build`)
BUILT_BY = ["device", "python_executable", "engine", "engine_version"]


def scoring_machine() -> dict[str, str]:
    """Where a scorer loaded in this process computes: the host, its GPUs (or 'cpu'), and the
    interpreter whose engine libraries it loads (scorer and replayer ids name it)."""
    import socket

    from harness.results.provenance import detect_gpus

    return {"host": socket.gethostname(), "device": ", ".join(g.get("name", "") for g in detect_gpus()) or "cpu",
            "python": sys.executable}


def _environment(path: str) -> Path:
    """What tells one Python environment from another: the folder of its interpreter (not resolved:
    two venvs link to one base interpreter)."""
    return Path(os.path.abspath(path)).parent


def foreign(pythons: Any, here: dict[str, str]) -> str | None:
    """Why runs made under the interpreters `pythons` (the rows' `python_executable`) may not be re-read
    by this process's engine (another environment: another engine build, other libraries); None when
    they were made under this one's, or the rows do not say."""
    mine = _environment(here["python"])
    other = sorted({str(p) for p in pythons if isinstance(p, str) and p and _environment(p) != mine})
    if not other:
        return None
    return (f"the runs ran under {', '.join(other)} (another environment); this command runs under {here['python']}, "
            f"whose engine would stand in for theirs. Run it with that interpreter: {other[0]} -m harness ...")


def not_here(runs: pd.DataFrame, here: dict[str, str], any_device: bool = False) -> str | None:
    """Why this process may not re-read `runs` (rows with `python_executable` and `device`): made in
    another environment (`foreign`, always), or on a GPU this machine lacks (`misplaced`, unless
    `any_device`); None where it may. Rescore, replay and compare --score all ask this."""
    return foreign(runs["python_executable"].unique(), here) or (
        None if any_device else misplaced(runs["device"].unique(), here))


def misplaced(devices: Any, here: dict[str, str]) -> str | None:
    """Why runs that ran on `devices` (the rows' what-ran `device`) may not be scored `here`; None
    when they may (CPU runs, runs of unknown device, or this machine has each of their GPUs)."""
    ran = sorted({str(d) for d in devices if isinstance(d, str) and d and d != "cpu"})
    if not ran:
        return None
    have = [name.strip() for name in here["device"].split(",")] if here["device"] != "cpu" else []
    named = [d for d in ran if d != "gpu"]
    if have and all(name.strip() in have for d in named for name in d.split(",")):
        return None
    where = f"this machine ({here['host']}) has " + (", ".join(have) if have else "no GPU: the scorer would compute on its CPU")
    return (f"the runs ran on {', '.join(ran)}; {where}. Score them where they ran (harness rescore on such a node), "
            "or pass --any-device to score them here anyway")


def scorer_spec(spec: Any, engine: str | None = None, dtype: str | None = None) -> Any:
    """The load a run is scored under: its own, alone and without a prefix cache, unless overridden."""
    return replace(spec, engine=engine or spec.engine, dtype=dtype or spec.dtype, prefix_caching=False,
                   options=spec.options if (engine or spec.engine) == spec.engine else {})


class PlacedEngine:
    """One engine loaded in this process to re-read a folder's runs (a scorer, a replayer), described
    with its machine and build. Use it as a context manager: the engine loads on entry and is
    closed on exit."""

    #: the engine class attribute that says why it cannot do this job (None: it can)
    unavailable = "score_unavailable"

    def __init__(self, spec: Any, base: Path | None, log: Callable[[str], None],
                 machine: dict[str, str] | None = None) -> None:
        from harness.engines.registry import engine_class

        self.spec, self.base, self.log = spec, base, log
        self.machine = machine or scoring_machine()
        self.cls = engine_class(spec.engine)
        self.label = spec.label()
        self.engine: Any = None
        self.description = ""
        self._before: dict[str, str | None] = {}

    @property
    def refusal(self) -> str | None:
        """Why this engine cannot do the job, known before a load (None: it may)."""
        why = getattr(self.cls, self.unavailable)
        return None if why is None else f"{self.label}: {why}"

    def __enter__(self) -> PlacedEngine:
        from harness.results.provenance import detect_gpus
        from harness.run.enforced import device_environment

        # before the engine's library is imported: its variables, and the GPUs the setting may see, as
        # a run's worker has them (gpu: cpu sees none: a CUDA build would otherwise compute on one)
        tp = int(self.spec.options.get("tensor_parallel_size") or 1)
        placed = self.cls.environment(self.spec) | device_environment(self.spec.gpu, detect_gpus(), tp)
        # put back on exit: the next engine of this process (a `gpu: any` scorer after a `gpu: cpu` one)
        # is placed from the process's own environment, not from this one's narrowing
        self._before = {name: os.environ.get(name) for name in {*placed, "CUDA_VISIBLE_DEVICES"}}
        os.environ.update(placed)
        try:
            self.engine = self.cls(self.spec, self.log, self.base)
        except BaseException:
            self._put_back()
            raise
        facts = self.engine.describe()
        build = {k: v for k, v in facts.items() if k in ("engine_version", "model_sha256", "engine_info", "build_sha256",
                                                           "cpu_kernels", "platform")}
        self.description = json.dumps({"engine": self.spec.engine, "model": self.spec.model, "dtype": self.spec.dtype,
                                       **self.machine, **build}, sort_keys=True, default=str)
        self.engine_version = str(facts.get("engine_version") or "")
        return self

    def other_build(self, runs: pd.DataFrame) -> str | None:
        """Why this loaded engine may not stand in for the one that made `runs` (rows with `engine` and
        `engine_version`): the same engine at another version, as after an upgrade in place (the
        interpreter's folder, which `foreign` compares, is then the same). None where it may; another
        engine, chosen on purpose (--engine), is compared by the scores themselves."""
        theirs = sorted({str(v) for v in runs.loc[runs["engine"] == self.spec.engine, "engine_version"].dropna()
                         if v} - {self.engine_version})
        if not self.engine_version or not theirs:
            return None
        return (f"the runs were made by {', '.join(theirs)}; this environment's engine is {self.engine_version} "
                "(upgraded in place?), whose numbers would stand for theirs. Re-read them under the version "
                "that made them (pip install it in another environment and run the command there)")

    def __exit__(self, *exc: object) -> None:
        try:
            self.engine.close()
        finally:
            self._put_back()

    def _put_back(self) -> None:
        for name, value in self._before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Scorer(PlacedEngine):
    """One loaded scoring engine; a (prompt, output) pair is scored once, however many runs share it."""

    def __init__(self, spec: Any, base: Path | None, log: Callable[[str], None],
                 machine: dict[str, str] | None = None) -> None:
        super().__init__(spec, base, log, machine)
        self._done: dict[tuple[str, str], list[float]] = {}

    def __call__(self, text: str, output_hash: str, tokens: list[int]) -> list[float]:
        key = (text, output_hash)
        if key not in self._done:
            self._done[key] = self.engine.score(text, list(tokens))
        return self._done[key]


def scorable(results: Results, log: Callable[[str], None]) -> pd.DataFrame:
    """The folder's ok runs that can be scored (a shared context is not stored: those are left out, said)."""
    rows = results.read_rows(columns=["cell_id", "prompt_id", "repeat", "status", "output_hash", "context_tokens",
                                      *BUILT_BY])
    ok = rows[rows["status"] == "ok"]
    shared = ok["context_tokens"].fillna(0) > 0
    if shared.any():
        log(f"{int(shared.sum())} run(s) with a shared context (context_tokens > 0) left out: the context is not stored")
    return ok[~shared]


def rescore(results: Results, engine: str | None = None, dtype: str | None = None,
            log: Callable[[str], None] = print, cell_ids: set[str] | None = None,
            force: bool = False, any_device: bool = False) -> tuple[list[Path], list[str]]:
    """Score the ok runs of the folder's current cells (or of `cell_ids`); a cell already scored by
    the same scorer is skipped unless `force`. Returns (the files written, one per scorer and cell;
    the scorers and cells that refused, each with its reason). A refusal leaves the others to run;
    cells whose runs ran on a GPU this machine lacks refuse unless `any_device` (see `misplaced`)."""
    from harness.engines.base import Unsupported
    from harness.results.store import Store

    ok = scorable(results, log)
    here = scoring_machine()
    cells = {c.id: (c, loaded) for loaded in results.experiments for c in expand(loaded)}
    by_scorer: dict[str, tuple[Any, Any, list[str]]] = {}
    written, refused = [], []
    for cell_id, part in ok.groupby("cell_id", sort=False):
        if cell_id in cells and (cell_ids is None or cell_id in cell_ids):
            cell, loaded = cells[cell_id]
            why = not_here(part, here, any_device)
            if why is not None:
                refused.append(f"cell {cell_id}: {why}")
                continue
            spec = scorer_spec(cell.load_spec(), engine, dtype)
            key = digest({"spec": repr(spec), **here}, 12)
            if force or not _path(results.root, key, cell_id).exists():
                by_scorer.setdefault(key, (spec, loaded, []))[2].append(cell_id)
    for key, (spec, loaded, chosen) in by_scorer.items():
        runs = ok[ok["cell_id"].isin(chosen)]
        tokens = results.tokens_for(set(runs["output_hash"]))
        texts = {p.id: p.text for p in loaded.prompt_set.prompts}
        scorer = Scorer(spec, loaded.base, log, here)
        if scorer.refusal:
            refused.append(scorer.refusal)
            continue
        log(f"scoring {len(runs)} run(s) of {len(chosen)} cell(s) with {scorer.label}")
        try:
            with scorer:
                if (why := scorer.other_build(runs)) is not None:
                    refused.append(f"{scorer.label}: {why}")
                    continue
                records = [{"cell_id": r.cell_id, "prompt_id": r.prompt_id, "repeat": int(r.repeat),
                            "output_hash": r.output_hash, "scorer_id": key,
                            "score_logprobs": scorer(texts[r.prompt_id], r.output_hash, tokens[r.output_hash])}
                           for r in runs.itertuples(index=False)]
        except Unsupported as exc:  # the engine's own rule, met at the first score
            refused.append(f"{scorer.label}: {exc}")
            continue
        store = Store(results.root)
        for cell_id in chosen:
            table = pa.Table.from_pylist([r | {"scorer": scorer.description} for r in records
                                          if r["cell_id"] == cell_id], schema=SCHEMA)
            path = _path(results.root, key, cell_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            store.atomic_write(path, lambda tmp, t=table: pq.write_table(t, tmp))
            written.append(path)
    return written, refused


def side_path(root: Path, folder: str, key: str, cell_id: str) -> Path:
    """One file per re-reader (scorer, replayer) and cell, like cells/: array tasks that re-read
    their own cells never write the same file."""
    return root / folder / key / f"{cell_id}.parquet"


def read_side(root: Path, folder: str, schema: pa.Schema) -> pd.DataFrame:
    """Every file under RESULTS/folder/*/ (an empty frame with the schema's columns when none)."""
    files = sorted((root / folder).glob("*/*.parquet"))
    if not files:
        return pd.DataFrame(columns=schema.names)
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _path(root: Path, scorer_id: str, cell_id: str) -> Path:
    return side_path(root, FOLDER, scorer_id, cell_id)


def read_scores(root: Path) -> pd.DataFrame:
    """Every stored score of a results folder."""
    return read_side(root, FOLDER, SCHEMA)


def deltas(decode: Any, score: Any) -> np.ndarray:
    """score - decode per token, over the tokens both have (NaN steps dropped)."""
    if decode is None or score is None:
        return np.array([])
    n = min(len(decode), len(score))
    d = np.asarray(score[:n], dtype=np.float64) - np.asarray(decode[:n], dtype=np.float64)
    return d[~np.isnan(d)]


def run_stats(delta: np.ndarray, threshold: float = THRESHOLD) -> dict[str, float]:
    """The per-run figures of the module docstring, from its deltas."""
    if not len(delta):
        return {"tokens": 0, "mean_abs_delta": np.nan, "max_abs_delta": np.nan, "k3_kl": np.nan,
                "share_above": np.nan}
    a = np.abs(delta)
    return {"tokens": len(delta), "mean_abs_delta": float(a.mean()), "max_abs_delta": float(a.max()),
            "k3_kl": float(np.mean(np.expm1(delta) - delta)), "share_above": float(np.mean(a > threshold))}


def summary(results: Results, threshold: float = THRESHOLD) -> pd.DataFrame:
    """Per scorer, cell and prompt: the module docstring's figures, pooled over the runs' tokens
    (every token weighs the same), with the cell's settings."""
    from harness.results.columns import KEY_COLUMNS

    keys = list(KEY_COLUMNS) + results.option_axes
    scores = read_scores(results.root)
    columns = ["scorer", "scorer_id", "cell_id", "prompt_id"] + keys + RUN_COLUMNS
    if scores.empty:
        return pd.DataFrame(columns=columns)
    rows = results.read_rows(columns=keys + ["cell_id", "prompt_id", "repeat", "status", "output_hash"])
    ok = rows[rows["status"] == "ok"]
    matched = scores.merge(ok, on=["cell_id", "prompt_id", "repeat", "output_hash"], how="inner")
    if matched.empty:
        return pd.DataFrame(columns=columns)
    matched["decode"] = results.folder.store.values_at("logprobs", matched).to_numpy()
    records = []
    for (sid, cell, prompt), part in matched.groupby(["scorer_id", "cell_id", "prompt_id"], sort=True):
        pooled = np.concatenate([deltas(d, s) for d, s in zip(part["decode"], part["score_logprobs"])])
        records.append({"scorer": part["scorer"].iloc[0], "scorer_id": sid, "cell_id": cell, "prompt_id": prompt,
                        **part[keys].iloc[0].to_dict(), "runs": len(part), **run_stats(pooled, threshold)})
    return pd.DataFrame(records, columns=columns)
