"""Two result folders side by side (e.g. an A100 node's and an L40S node's): same or different.

Runs are matched on every setting except the ignored axes (by default `gpu`), plus prompt and
repeat. Settings present in only one folder are returned too, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from harness.analysis.divergence import first_divergence
from harness.analysis.frames import pair_lookup, per_value
from harness.analysis.mixing import IMPLIED_BY_AXIS, PROVENANCE_COLUMNS, refuse_mixed
from harness.core.errors import HarnessError
from harness.experiment.varying import varying
from harness.results import provenance_fields
from harness.results.columns import KEY_COLUMNS, keys_of
from harness.results.folder_rows import Results

#: where and with what each folder was made; every one that differs is shown beside the comparison
CONTEXT = provenance_fields.CONTEXT
#: texts are not read per run: they are looked up per distinct output (`_with_texts`)
COLUMNS = list(dict.fromkeys(list(KEY_COLUMNS) + ["cell_id", "prompt_id", "repeat", "status", "output_hash",
                                                   "filler_ids"] + PROVENANCE_COLUMNS + list(CONTEXT)))


@dataclass
class Comparison:
    runs: pd.DataFrame  # one record per matched run
    per_setting: pd.DataFrame  # prompts changed per setting (repeat 0), as in the source report
    only_a: pd.DataFrame  # settings found only in A
    only_b: pd.DataFrame
    #: (what, values in A, values in B) for each provenance field that differs between the folders
    context: list[tuple[str, str, str]]


def _values(rows: pd.DataFrame, column: str) -> str:
    return "; ".join(sorted({str(v) for v in rows[column].dropna().unique()} - {""})) or "(none)"


def context_differences(rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> list[tuple[str, str, str]]:
    """Provenance fields whose values differ between two folders' successful rows."""
    out = []
    for column in CONTEXT:
        a, b = _values(rows_a, column), _values(rows_b, column)
        if a != b:
            out.append((column, a, b))
    return out


def compare(
    a: Results, b: Results, ignore: tuple[str, ...] = ("gpu",), allow_mixed: frozenset[str] = frozenset()
) -> Comparison:
    """Runs of A and B with equal settings (but the ignored axes), paired; provenance that differs
    between a pair is refused unless an ignored axis implies it or `allow_mixed` names it."""
    rows_a = a.read_rows(columns=COLUMNS, provenance_as_categories=True)
    rows_b = b.read_rows(columns=COLUMNS, provenance_as_categories=True)
    for frame, other in ((rows_a, rows_b), (rows_b, rows_a)):  # an option swept on one side only: empty
        for column in set(keys_of(other)) - set(frame.columns):
            frame[column] = None
    keys = keys_of(rows_a, drop=ignore)
    rows_a, rows_b = rows_a[rows_a.status == "ok"], rows_b[rows_b.status == "ok"]
    match = keys + ["prompt_id", "repeat"]
    for name, rows in (("A", rows_a), ("B", rows_b)):
        # runs collide only where two cells share the settings: look at the cells first (cheap)
        if rows.drop_duplicates("cell_id").duplicated(keys).any() and rows.duplicated(match).any():
            inside = varying(rows, ignore)
            raise HarnessError(
                f"{name}: {', '.join(inside) or 'an ignored axis'} varies inside this folder, so runs cannot be "
                "paired; ignore only axes that are constant within each folder"
            )
    joined = rows_a.merge(rows_b, on=match, how="outer", suffixes=("_a", "_b"), indicator=True)
    settings_a = rows_a.drop_duplicates("cell_id")[keys].drop_duplicates()  # settings are constant in a cell
    settings_b = rows_b.drop_duplicates("cell_id")[keys].drop_duplicates()
    only_a = settings_a.merge(settings_b, on=keys, how="left", indicator=True)
    only_b = settings_b.merge(settings_a, on=keys, how="left", indicator=True)
    runs = joined[joined["_merge"] == "both"].drop(columns="_merge").copy()
    refuse_other_texts(a, b, runs)
    implied = set().union(*(IMPLIED_BY_AXIS.get(axis, frozenset()) for axis in ignore))
    # one record per distinct pair of cells and provenance: the same verdict as every run pair
    provenance = [c + s for s in ("_a", "_b") for c in ["cell_id"] + PROVENANCE_COLUMNS]
    distinct = runs[provenance].drop_duplicates().reset_index(drop=True)
    side = {s: distinct[[c + s for c in ["cell_id"] + PROVENANCE_COLUMNS]].rename(columns=lambda c, s=s: c.removesuffix(s))
            for s in ("_a", "_b")}
    refuse_mixed(side["_a"], side["_b"], implied | set(allow_mixed), "pairing runs of A and B", "A", "B")
    runs["same"] = runs["output_hash_a"] == runs["output_hash_b"]
    differ = runs.loc[~runs["same"], ["output_hash_a", "output_hash_b"]].drop_duplicates()
    tokens_a = a.tokens_for(set(differ["output_hash_a"]))
    tokens_b = b.tokens_for(set(differ["output_hash_b"]))
    split = {
        (ha, hb): first_divergence(tokens_a[ha], tokens_b[hb]) for ha, hb in differ.itertuples(index=False)
    }
    at = pair_lookup(runs["output_hash_a"], runs["output_hash_b"], split)
    runs["first_divergence"] = pd.array(np.where(np.isnan(at), None, at), dtype="Int64")
    first = runs[runs["repeat"] == 0]
    per_setting = (
        first.groupby(keys, dropna=False)
        .agg(prompts=("prompt_id", "nunique"), changed=("same", lambda s: int((~s).sum())),
             first_divergence_min=("first_divergence", "min"))
        .reset_index()
    )
    runs = _with_texts(runs, a, "_a")
    runs = _with_texts(runs, b, "_b")
    return Comparison(
        runs=runs[match + ["gpu_a", "gpu_b", "same", "first_divergence", "text_a", "text_b",
                           "token_texts_a", "token_texts_b"]]
        if "gpu_a" in runs else runs,
        per_setting=per_setting,
        only_a=only_a[only_a["_merge"] == "left_only"][keys],
        only_b=only_b[only_b["_merge"] == "left_only"][keys],
        context=context_differences(rows_a, rows_b),
    )


def _texts(results: Results) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """A folder's prompt texts and filler texts by id, and its shared contexts (as the snapshots hold them)."""
    prompts = {p.id: p.text for e in results.experiments for p in e.prompt_set.prompts}
    fillers = {f.id: f.text for e in results.experiments for f in e.prompt_set.fillers}
    contexts = sorted({repr(e.experiment.context) for e in results.experiments})
    return prompts, fillers, contexts


def refuse_other_texts(a: Results, b: Results, runs: pd.DataFrame) -> None:
    """Paired runs must have had the same prompt, the same batch-mates and the same shared context in
    both folders: a prompt id is only a name, and two experiments may give it two texts."""
    (prompts_a, fillers_a, contexts_a), (prompts_b, fillers_b, contexts_b) = _texts(a), _texts(b)
    for prompt_id in runs["prompt_id"].unique():
        ta, tb = prompts_a.get(prompt_id), prompts_b.get(prompt_id)
        if ta is not None and tb is not None and ta != tb:
            raise HarnessError(f"prompt '{prompt_id}' has another text in B than in A ({ta[:60]!r} / {tb[:60]!r}): "
                               "runs of two prompts cannot be paired; give the prompts other ids")
    if runs.empty:
        return
    if contexts_a != contexts_b:
        raise HarnessError(f"the shared context differs (A: {', '.join(contexts_a)}; B: {', '.join(contexts_b)}): "
                           "runs with other text before the prompt cannot be paired")
    # an experiment draws its batches per (batch size, prompt, repeat): their texts are compared once each,
    # not once per paired run (a million-run comparison has a few thousand batches; a folder merged from
    # experiments with other filler draws is the case this leaves to the first batch of each)
    batch = [k for k in ("batch_size", "prompt_id", "repeat") if k in runs]
    mates = runs.drop_duplicates(batch)[batch + ["filler_ids_a", "filler_ids_b"]].copy()
    for side, texts in (("_a", fillers_a), ("_b", fillers_b)):
        mates["mates" + side] = [tuple(texts.get(f, f) for f in ids) if ids is not None else ()
                                 for ids in mates["filler_ids" + side]]
    differ = mates[mates["mates_a"] != mates["mates_b"]][batch]
    if not differ.empty:
        other = runs[batch].merge(differ, on=batch)
        first = other.iloc[0]
        raise HarnessError(f"{len(other)} paired run(s) had other batch-mates in B than in A (e.g. prompt "
                           f"'{first.prompt_id}' repeat {first.repeat}): their filler texts or the draw of fillers "
                           "differ (fillers, filler_seed, batch_fill), so a difference could be the batch's, not the "
                           "machine's")


def _with_texts(runs: pd.DataFrame, results: Results, side: str) -> pd.DataFrame:
    """Each run's text and per-token texts, read once per distinct output of that folder."""
    hashes = set(runs["output_hash" + side].dropna())
    pieces, texts = results.texts_for(hashes), results.whole_texts_for(hashes)
    runs["text" + side] = per_value(runs["output_hash" + side], texts.get)
    runs["token_texts" + side] = per_value(runs["output_hash" + side], pieces.get)
    return runs


def around_split(pieces: Sequence[str] | None, text: str, k: int | None, before: int = 50, after: int = 70) -> str:
    """The text near token k, the token itself in [brackets]; the text's start where pieces are unknown."""
    if pieces is None or not len(pieces) or k is None:
        return text[: before + after]
    head = "".join(pieces[:k])
    token = pieces[k] if k < len(pieces) else "(end)"
    tail = "".join(pieces[k + 1 :])
    lead = ("…" + head[-before:]) if len(head) > before else head
    return f"{lead}[{token}]{tail[:after]}"
