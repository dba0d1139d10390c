"""The scoring half of `harness compare A B --score` (the statistic is harness.analysis.noise_floor):
A's scorer (A's setting, loaded alone with no cache: harness.run.rescore.Scorer) gives every run of
A and of B one value, the mean over its tokens of |decode-time log-probability - A's scoring
log-probability|, setting by setting."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from harness.experiment.matrix import expand
from harness.results.columns import KEY_COLUMNS, keys_of
from harness.results.folder_rows import Results
from harness.run.rescore import Scorer, deltas, not_here, scorable, scorer_spec, scoring_machine


def _values(results: Results, runs: pd.DataFrame, scorer: Scorer, texts: dict[str, str]) -> pd.DataFrame:
    """Each run's mean |decode - score| under `scorer`."""
    tokens = results.tokens_for(set(runs["output_hash"]))
    decode = results.folder.store.values_at("logprobs", runs)
    values = []
    for r, lp in zip(runs.itertuples(index=False), decode):
        d = deltas(lp, scorer(texts[r.prompt_id], r.output_hash, tokens[r.output_hash]))
        values.append(float(np.abs(d).mean()) if len(d) else np.nan)
    return runs.assign(value=values)


def score_settings(a: Results, b: Results, ignore: tuple[str, ...] = ("gpu",),
                   log: Callable[[str], None] = print,
                   any_device: bool = False) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The setting columns (A's keys but batch size and the ignored axes, where B has them too) and,
    lazily, one item per A setting that B has, for harness.analysis.noise_floor.judge. A's scorer
    computes here: a setting whose A runs ran on a GPU this machine lacks is not scored unless
    `any_device` (harness.run.rescore.misplaced)."""
    runs_a, runs_b = scorable(a, log), scorable(b, log)
    setting_a = a.read_rows(columns=["cell_id", *KEY_COLUMNS]).drop_duplicates("cell_id")
    setting_b = b.read_rows(columns=["cell_id", *KEY_COLUMNS]).drop_duplicates("cell_id")
    keys = [k for k in keys_of(setting_a, drop=set(ignore) | {"batch_size"}) if k in setting_a and k in setting_b]
    runs_a = runs_a.drop(columns=["context_tokens", "engine"]).merge(setting_a, on="cell_id")
    runs_b = runs_b.drop(columns=["context_tokens", "engine"]).merge(setting_b, on="cell_id")
    return keys, _scored(a, b, runs_a, runs_b, keys, log, any_device)


def _scored(a: Results, b: Results, runs_a: pd.DataFrame, runs_b: pd.DataFrame, keys: list[str],
            log: Callable[[str], None], any_device: bool) -> Iterator[dict[str, Any]]:
    here = scoring_machine()
    cells = {c.id: (c, loaded) for loaded in a.experiments for c in expand(loaded)}
    texts_b = {p.id: p.text for loaded in b.experiments for p in loaded.prompt_set.prompts}
    for key, part_a in runs_a.groupby(keys, dropna=False, sort=True):
        setting = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        mask = np.ones(len(runs_b), dtype=bool)
        for k, v in setting.items():
            mask &= (runs_b[k].isna() if pd.isna(v) else runs_b[k] == v).to_numpy()
        part_b = runs_b[mask]
        if part_b.empty:
            continue
        cell, loaded = cells[part_a["cell_id"].iloc[0]]
        texts = {p.id: p.text for p in loaded.prompt_set.prompts}
        same_text = part_b["prompt_id"].map(lambda p: p in texts and texts_b.get(p) == texts[p]).astype(bool)
        left_out = int((~same_text).sum())
        part_b = part_b[same_text]
        scorer = Scorer(scorer_spec(cell.load_spec()), loaded.base, log, here)
        why = scorer.refusal or not_here(part_a, here, any_device)
        if why:
            yield {"setting": setting, "left_out": left_out, "why": why}
            continue
        log(f"scoring {len(part_a)} run(s) of A and {len(part_b)} of B with {scorer.label}")
        with scorer:
            if (why := scorer.other_build(part_a)) is not None:
                yield {"setting": setting, "left_out": left_out, "why": why}
                continue
            va = _values(a, part_a, scorer, texts)
            vb = _values(b, part_b, scorer, texts)
        yield {"setting": setting, "left_out": left_out, "a": va, "b": vb}
