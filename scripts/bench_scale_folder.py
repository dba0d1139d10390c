"""The synthetic results folders `bench_scale.py` times: seeded, of N rows, in one of the shapes users
run, each row a copy of a real run's ok row with its cell, prompt, repeat and tokens replaced, and
known injected divergences as the ground truth.

Shapes (SHAPES), every one with batch size 1 as the reference:
- seeds: batch sizes 1 and 2 for each of C/2 seeds, 5 prompts (1M rows: 500 cell files, 10M: 1000);
  every seed is a unit of its own (harness.analysis.partitions);
- sweep: a batch-size sweep, 10 batch sizes of one seed, 1000 prompts (10M rows: 10 cell files of 1M
  rows): one unit, which a read part by part cuts by prompt;
- prompt: one prompt, 10 batch sizes for each of S seeds (10M rows: 100 seeds, 1000 cell files of
  10,000 runs of that prompt): every seed a unit of one prompt;
- repeats: the textbook's shape, one prompt and one seed at 10 batch sizes, every run a repeat of it
  (1M rows: 10 cell files of 100,000 runs): one unit of one prompt, which a read part by part cuts
  by its runs.
Batch-1 runs all give the prompt's base output (64 tokens); in the other cells a seeded share of runs
takes one of 3 variants, variant j departing from the base at a known token index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results.folder import ResultsFolder, fingerprint
from harness.results.rows import output_hash
from harness.results.schema import LANDING_KEY
from harness.results.store import ROW_GROUP_ROWS

TOKENS = 64
#: (token index where the variant departs, share of the non-reference runs taking it)
VARIANTS = ((41, 0.02), (17, 0.005), (58, 0.08))
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Shape:
    """A folder's matrix for `rows` rows: batch sizes, seeds, prompts and repeats."""

    batch_sizes: tuple[int, ...]
    seeds: int
    prompts: int
    repeats: int


def shape_of(name: str, rows: int) -> Shape:
    """The matrix of one of SHAPES at about `rows` rows."""
    if name == "seeds":
        cells = max(2, min(1000, rows // 2000) // 2 * 2)
        return Shape((1, 2), cells // 2, 5, max(1, rows // (5 * cells)))
    if name == "sweep":
        prompts = max(1, min(1000, rows // 10_000))
        return Shape(SWEEP, 1, prompts, max(1, rows // (len(SWEEP) * prompts)))
    if name == "prompt":
        seeds = max(1, min(100, rows // 100_000))
        return Shape(SWEEP, seeds, 1, max(1, rows // (len(SWEEP) * seeds)))
    if name == "repeats":
        return Shape(SWEEP, 1, 1, max(1, rows // len(SWEEP)))
    raise ValueError(f"unknown shape '{name}'; allowed: {', '.join(SHAPES)}")


SHAPES = ("seeds", "sweep", "prompt", "repeats")


def experiment_text(shape: Shape) -> str:
    seeds = ", ".join(str(s) for s in range(shape.seeds))
    prompts = "\n".join(f'  - {{id: p{i}, text: "synthetic prompt {i}"}}' for i in range(shape.prompts))
    return f"""name: scale
prompts:
{prompts}
fillers: ["a filler"]
repeats: {shape.repeats}
max_tokens: {TOKENS}
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [{", ".join(map(str, shape.batch_sizes))}]
  seed: [{seeds}]
expect:
  - {{where: {{batch_size: 1}}, unique_outputs: 1}}
  - {{where: {{batch_size: 2}}, match_rate_min: 0.5, divergence_rate_min: 0.01}}
"""


@dataclass
class Truth:
    """What the statistics must say, per non-reference cell and prompt (batch-1 cells: nothing diverges)."""

    diverged: dict[tuple[str, str], int]
    first_min: dict[tuple[str, str], int | None]
    first_median: dict[tuple[str, str], float | None]
    unique: dict[tuple[str, str], int]
    root_split: dict[tuple[str, str], tuple[int, tuple[int, ...]]]  # (split_at, runs of each branch, sorted)
    records: int  # cells x prompts: the summary's records


def same_lists(n: int, value: float) -> pa.Array:
    """n lists of TOKENS float32 values, all `value`."""
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * TOKENS)
    return pa.ListArray.from_arrays(offsets, pa.array(np.full(n * TOKENS, value, dtype=np.float32)))


def _outputs(prompts: int, rng: np.random.Generator) -> pa.Table:
    """The few distinct outputs: base p0..pN-1, then (p, variant j) at prompts + 3p + j."""
    base = [rng.integers(100, 40000, size=TOKENS).astype(np.int32) for _ in range(prompts)]
    variants = []
    for tokens in base:
        for at, _ in VARIANTS:
            v = tokens.copy()
            v[at:] = rng.integers(40000, 49000, size=TOKENS - at)
            variants.append(v)
    outputs = base + variants
    return pa.table({
        "token_ids": pa.array([v.tolist() for v in outputs], pa.list_(pa.int32())),
        "token_texts": pa.array([[f"t{t}" for t in v] for v in outputs], pa.list_(pa.string())),
        "text": pa.array(["".join(f"t{t}" for t in v) for v in outputs]),
        "output_hash": pa.array([output_hash(v.tolist()) for v in outputs]),
    })


def _truth(truth: Truth, cell_id: str, choice: np.ndarray, shape: Shape) -> None:
    """The ground truth of one non-reference cell's runs (`choice`: the variant of each, -1 for the base)."""
    by_prompt = choice.reshape(shape.prompts, shape.repeats)  # rows are prompt-major
    for i in range(shape.prompts):
        mine = by_prompt[i]
        at = [VARIANTS[c][0] for c in mine if c >= 0]
        key = (cell_id, f"p{i}")
        truth.diverged[key] = len(at)
        truth.first_min[key] = min(at) if at else None
        truth.first_median[key] = float(np.median(at)) if at else None
        truth.unique[key] = len(set(mine.tolist()))
        if at:  # the earliest variant's runs part from all others there
            early = sum(1 for a in at if a == min(at))
            truth.root_split[key] = (min(at), tuple(sorted((early, shape.repeats - early))))


def build(folder: Path, template: pa.Table, shape: Shape, seed: int) -> Truth:
    """Write the synthetic folder: manifest (with the experiment) and one Parquet file per cell, its rows
    prompt-major in row groups of the harness's own size, as the harness writes them."""
    spec = folder.parent / f"{folder.name}.yaml"
    spec.write_text(experiment_text(shape))
    loaded = load_experiment(spec)
    results = ResultsFolder(folder)
    results.adopt(loaded)
    rng = np.random.default_rng(seed)
    distinct = _outputs(shape.prompts, rng)
    cells = expand(loaded)
    truth = Truth({}, {}, {}, {}, {}, len(cells) * shape.prompts)
    n = shape.prompts * shape.repeats
    pick = template.take(np.zeros(n, dtype=np.int64))  # one real row, copied
    shares = np.cumsum([s for _, s in VARIANTS])
    prompt_ids = pa.array(np.repeat([f"p{i}" for i in range(shape.prompts)], shape.repeats))
    prompt_number = np.repeat(np.arange(shape.prompts), shape.repeats)
    repeats = pa.array(np.tile(np.arange(shape.repeats), shape.prompts), pa.int32())
    for cell in cells:
        choice = np.full(n, -1)
        if cell["batch_size"] != 1:
            choice = np.searchsorted(shares, rng.random(n), side="right")
            choice[choice >= len(VARIANTS)] = -1
        which = np.where(choice < 0, prompt_number, shape.prompts + prompt_number * len(VARIANTS) + choice)
        runs = distinct.take(pa.array(which))
        columns = {
            "cell_id": pa.array([cell.id] * n), "group_id": pa.array([cell.group_id] * n),
            "prompt_id": prompt_ids, "repeat": repeats,
            "batch_size": pa.array([cell["batch_size"]] * n, pa.int32()), "seed": pa.array([cell["seed"]] * n, pa.int64()),
            "max_tokens": pa.array([TOKENS] * n, pa.int32()), "experiment": pa.array(["scale"] * n),
            "token_ids": runs["token_ids"], "n_tokens": pa.array([TOKENS] * n, pa.int32()),
            "token_texts": runs["token_texts"], "text": runs["text"], "output_hash": runs["output_hash"],
            "logprobs": same_lists(n, -0.5), "margins": same_lists(n, 1.0),
            "logprobs_hash": pa.array([None] * n, pa.string()),
            "filler_ids": pa.array([[] if cell["batch_size"] == 1 else ["filler-00"]] * n, pa.list_(pa.string())),
        }
        table = pick
        for name, values in columns.items():
            table = table.set_column(table.schema.get_field_index(name), name, values)
        # the landing record travels in the cell file's own metadata, as a real landing writes it
        landing = {"experiment": fingerprint(loaded), "statuses": {"ok": n}, "run_id": "synthetic",
                   "writer": "bench_scale", "written_at": "2026-01-01T00:00:00+00:00"}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               LANDING_KEY: json.dumps(landing, sort_keys=True)})
        results.store.atomic_write(results.store.cell_path(cell.id),
                                   lambda tmp, t=table: pq.write_table(t, tmp, row_group_size=ROW_GROUP_ROWS))
        if cell["batch_size"] != 1:
            _truth(truth, cell.id, choice, shape)
    return truth
