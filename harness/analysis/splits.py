"""Where the outputs of one cell and prompt split: the tree of their token sequences.

Thinking Machines' finding reads off it: 1000 runs, 80 unique completions, all equal for 102
tokens, then 992 runs take one token and 8 another. Work is on distinct outputs with their
counts, so 1000 runs cost what their few distinct outputs cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pandas as pd

from harness.results.columns import keys_of

#: the branch of outputs that end where others go on
END = "<end>"


@dataclass(frozen=True)
class Output:
    """One distinct output: its tokens, each token decoded on its own (may be empty), and how many runs gave it."""

    tokens: Sequence[int]
    texts: Sequence[str]
    runs: int


def _token_at(output: Output, index: int) -> int | None:
    return int(output.tokens[index]) if index < len(output.tokens) else None


def split_tree(outputs: list[Output]) -> list[dict[str, Any]]:
    """One record per branch at every token index where outputs part, parents before children.

    Records: `node` (a split, numbered from 0), `parent_node` / `parent_branch` (where it sits;
    -1 for the first split), `split_at` (token index), `branch` (0 = most runs), `token_id`
    (None where outputs end), `token_text`, `runs`, `unique_outputs`, `share` (of the node's runs).
    """
    records: list[dict[str, Any]] = []
    stack: list[tuple[list[Output], int, int, int]] = [(outputs, 0, -1, -1)]  # (group, start, parent, branch)
    node = 0
    while stack:
        group, start, parent, parent_branch = stack.pop()
        if len(group) < 2:
            continue
        index = start
        longest = max(len(o.tokens) for o in group)
        while index <= longest and len({_token_at(o, index) for o in group}) == 1:
            index += 1
        branches: dict[int | None, list[Output]] = {}
        for output in group:
            branches.setdefault(_token_at(output, index), []).append(output)
        ranked = sorted(branches.items(), key=lambda kv: (-sum(o.runs for o in kv[1]), kv[0] is None, kv[0] or 0))
        total = sum(o.runs for o in group)
        children = []
        for rank, (token, members) in enumerate(ranked):
            runs = sum(o.runs for o in members)
            text = next((o.texts[index] for o in members if index < len(o.texts)), "") if token is not None else END
            records.append({"node": node, "parent_node": parent, "parent_branch": parent_branch, "split_at": index,
                            "branch": rank, "token_id": token, "token_text": text, "runs": runs,
                            "unique_outputs": len(members), "share": runs / total})
            if token is not None:
                children.append((members, index + 1, node, rank))
        stack.extend(reversed(children))  # depth first, most-run branch first
        node += 1
    return records


SPLIT_COLUMNS = ["node", "parent_node", "parent_branch", "split_at", "branch", "token_id", "token_text", "runs",
                 "unique_outputs", "share"]


def splits(
    rows: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    texts_for: Callable[[set[str]], dict[str, Sequence[str]]],
    keys: list[str],
) -> pd.DataFrame:
    """The split tree of every cell and prompt (ok rows), with `keys` (the setting columns) in front.

    Cells and prompts whose runs all agree have no records; `runs` / `unique_outputs` of the
    first split's branches add up to the cell's totals.
    """
    return trees(output_counts(rows, keys), tokens_for, texts_for, keys)


def output_counts(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per (cell, prompt, output) of the ok rows: its runs `n`, with `keys` (the setting columns)."""
    ok = rows[rows["status"] == "ok"]
    # settings are constant inside a cell: count per (cell, prompt, output), then put them back per cell
    counts = ok.groupby(["cell_id", "prompt_id", "output_hash"], dropna=False).size().rename("n").reset_index()
    return counts.merge(ok.drop_duplicates("cell_id")[["cell_id"] + keys], on="cell_id", how="left", sort=False)


def trees(
    counts: pd.DataFrame,
    tokens_for: Callable[[set[str]], dict[str, Sequence[int]]],
    texts_for: Callable[[set[str]], dict[str, Sequence[str]]],
    keys: list[str],
) -> pd.DataFrame:
    """The split trees of output_counts (see splits)."""
    several = counts.groupby(["cell_id", "prompt_id"])["output_hash"].transform("nunique") > 1
    counts = counts[several]
    columns = keys + ["cell_id", "prompt_id"] + SPLIT_COLUMNS
    if counts.empty:
        return pd.DataFrame(columns=columns)
    hashes = set(counts["output_hash"])
    tokens, texts = tokens_for(hashes), texts_for(hashes)
    out = []
    for (cell, prompt), part in counts.groupby(["cell_id", "prompt_id"], sort=True):
        front = part.iloc[0][keys].to_dict()
        tree = split_tree([Output(tokens[h], list(texts.get(h) or []), int(n))
                           for h, n in zip(part["output_hash"], part["n"])])
        out += [front | {"cell_id": cell, "prompt_id": prompt} | r for r in tree]
    return pd.DataFrame(out, columns=columns)


def part_splits(analysis: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The splits of one analysis's rows (a folder, or a part of a campaign), and the output counts of a
    part that holds some runs of a prompt (its trees are drawn once the parts' counts are added up)."""
    rows, results = analysis.rows, analysis.results
    keys = keys_of(rows)
    counts = output_counts(rows, keys)
    if analysis.stand_ins is not None:
        return trees(counts.iloc[:0], results.tokens_for, results.texts_for, keys), counts
    return trees(counts, results.tokens_for, results.texts_for, keys), counts.iloc[:0]


def joined_splits(found: list[tuple[pd.DataFrame, pd.DataFrame]], results: Any) -> pd.DataFrame:
    """The split trees of a folder from its parts' part_splits, in cell and prompt order."""
    present = [t for t, _ in found if not t.empty]
    cut = [c for _, c in found if not c.empty]
    if cut:
        from dataclasses import replace

        counts = pd.concat(cut, ignore_index=True)
        keys = [c for c in counts.columns if c not in ("cell_id", "prompt_id", "output_hash", "n")]
        summed = (counts.groupby(["cell_id", "prompt_id", "output_hash"], dropna=False, sort=True)["n"].sum()
                  .reset_index().merge(counts.drop_duplicates("cell_id")[["cell_id"] + keys], on="cell_id", how="left"))
        these = replace(results, cell_ids=list(dict.fromkeys(summed["cell_id"])),
                        prompt_ids=tuple(dict.fromkeys(summed["prompt_id"])), runs=None)
        made = trees(summed, these.tokens_for, these.texts_for, keys)
        present += [made] if not made.empty else []
    if len(present) < 2:
        return present[0] if present else found[0][0]
    return (pd.concat(present, ignore_index=True).sort_values(["cell_id", "prompt_id"], kind="stable")
            .reset_index(drop=True))


def folder_splits(analysis: Any) -> pd.DataFrame:
    """Where the outputs of each cell and prompt of a results folder split (`harness summarize --what
    splits`), part by part where the analysis reads a campaign in parts."""
    return joined_splits(analysis.per_part(part_splits, with_statistics=False), analysis.results)
