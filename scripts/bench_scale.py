"""How the readers scale with rows: a seeded synthetic results folder of N rows, built from a real
run's rows, with known injected divergences as the ground truth.

    python scripts/bench_scale.py --rows 10000 100000 1000000 [--source DIR] [--work DIR]

The source is a results folder of a real run (default: runs a 2-prompt llama.cpp experiment on
the shipped model first, about a minute). Every synthetic row is a copy of a real ok row (all
columns, provenance included) with its cell, prompt, repeat and tokens replaced:

- cells: batch_size 1 (the reference) and batch_size 2 for each of C/2 seeds; 5 prompts; R
  repeats each (C x 5 x R = N rows);
- batch-1 runs all give the prompt's base output (64 tokens); in batch-2 cells a seeded share
  of runs takes one of 3 variants, variant j departing from the base at a known token index.

Then it times `harness summarize`, `check`, `status`, `compare` (the folder with itself),
`merge` and `report` as a user runs them (a fresh process each; wall time and peak memory from
/usr/bin/time), and checks every statistic against the ground truth: runs, unique outputs,
diverged counts, first divergence min and median, and the first split of the split tree.
It prints one table per size and exits 1 when a statistic is wrong.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.experiment.config import load_experiment  # noqa: E402
from harness.experiment.matrix import expand  # noqa: E402
from harness.results.folder import ResultsFolder, fingerprint  # noqa: E402
from harness.results.rows import output_hash  # noqa: E402
from harness.results.schema import LANDING_KEY  # noqa: E402

PROMPTS = 5
TOKENS = 64
#: (token index where the variant departs, share of batch-2 runs taking it)
VARIANTS = ((41, 0.02), (17, 0.005), (58, 0.08))

SOURCE_EXPERIMENT = """
name: scale-source
prompts:
  - {id: a, text: "Name a color."}
  - {id: b, text: "Write a haiku about rain."}
repeats: 2
max_tokens: 16
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1]
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 2}
"""


def source_rows(source: Path | None, work: Path) -> pa.Table:
    """The ok rows of a real run (made here when no folder is given)."""
    if source is None:
        source = work / "source"
        (work / "source.yaml").write_text(SOURCE_EXPERIMENT)
        subprocess.run([sys.executable, "-m", "harness", "run", str(work / "source.yaml"), "--out", str(source),
                        "--no-summary"], check=True, cwd=ROOT)
    tables = [pq.read_table(p) for p in sorted((source / "cells").glob("*.parquet"))]
    table = pa.concat_tables(tables, promote_options="default")
    return table.filter(pc.equal(table["status"], "ok"))


def experiment_text(cells: int, repeats: int) -> str:
    seeds = ", ".join(str(s) for s in range(cells // 2))
    prompts = "\n".join(f'  - {{id: p{i}, text: "synthetic prompt {i}"}}' for i in range(PROMPTS))
    return f"""name: scale
prompts:
{prompts}
fillers: ["a filler"]
repeats: {repeats}
max_tokens: {TOKENS}
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2]
  seed: [{seeds}]
expect:
  - {{where: {{batch_size: 1}}, unique_outputs: 1}}
  - {{where: {{batch_size: 2}}, match_rate_min: 0.5, divergence_rate_min: 0.01}}
"""


@dataclass
class Truth:
    """What the statistics must say, per batch-2 cell and prompt (batch-1 cells: nothing diverges)."""

    diverged: dict[tuple[str, str], int]
    first_min: dict[tuple[str, str], int | None]
    first_median: dict[tuple[str, str], float | None]
    unique: dict[tuple[str, str], int]
    root_split: dict[tuple[str, str], tuple[int, tuple[int, ...]]]  # (split_at, runs of each branch, sorted)


def build(folder: Path, template: pa.Table, rows: int, seed: int) -> Truth:
    """Write the synthetic folder: manifest (with the experiment) and one Parquet file per cell."""
    cells = max(2, min(500, rows // 200) // 2 * 2)  # 1M rows: 500 cells x 5 prompts x 400 repeats
    repeats = max(1, rows // (PROMPTS * cells))
    spec = folder.parent / f"{folder.name}.yaml"
    spec.write_text(experiment_text(cells, repeats))
    loaded = load_experiment(spec)
    results = ResultsFolder(folder)
    results.adopt(loaded)
    rng = np.random.default_rng(seed)
    base = {f"p{i}": rng.integers(100, 40000, size=TOKENS).astype(np.int32) for i in range(PROMPTS)}
    variants: dict[tuple[str, int], np.ndarray] = {}
    for p, tokens in base.items():
        for j, (at, _) in enumerate(VARIANTS):
            v = tokens.copy()
            v[at:] = rng.integers(40000, 49000, size=TOKENS - at)
            variants[(p, j)] = v
    outputs = list(base.items()) + list(variants.items())
    hashes = {k: output_hash(v.tolist()) for k, v in outputs}
    as_list = {k: v.tolist() for k, v in outputs}
    pieces = {k: [f"t{t}" for t in v] for k, v in outputs}
    texts = {k: "".join(p) for k, p in pieces.items()}
    truth = Truth({}, {}, {}, {}, {})
    pick = template.take(np.zeros(PROMPTS * repeats, dtype=np.int64))  # one real row, copied
    shares = np.cumsum([s for _, s in VARIANTS])
    for cell in expand(loaded):
        n = PROMPTS * repeats
        prompt_ids = np.repeat([f"p{i}" for i in range(PROMPTS)], repeats)
        choice = np.full(n, -1)
        if cell["batch_size"] == 2:
            draw = rng.random(n)
            choice = np.searchsorted(shares, draw, side="right")
            choice[choice >= len(VARIANTS)] = -1
        keys = [p if c < 0 else (p, int(c)) for p, c in zip(prompt_ids, choice)]
        columns = {
            "cell_id": pa.array([cell.id] * n), "group_id": pa.array([cell.group_id] * n),
            "prompt_id": pa.array(prompt_ids), "repeat": pa.array(np.tile(np.arange(repeats), PROMPTS), pa.int32()),
            "batch_size": pa.array([cell["batch_size"]] * n, pa.int32()), "seed": pa.array([cell["seed"]] * n, pa.int64()),
            "max_tokens": pa.array([TOKENS] * n, pa.int32()), "experiment": pa.array(["scale"] * n),
            "token_ids": pa.array([as_list[k] for k in keys], pa.list_(pa.int32())),
            "n_tokens": pa.array([TOKENS] * n, pa.int32()),
            "token_texts": pa.array([pieces[k] for k in keys], pa.list_(pa.string())),
            "text": pa.array([texts[k] for k in keys]),
            "output_hash": pa.array([hashes[k] for k in keys]),
            "logprobs": pa.array([[-0.5] * TOKENS] * n, pa.list_(pa.float32())),
            "margins": pa.array([[1.0] * TOKENS] * n, pa.list_(pa.float32())),
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
        results.store.atomic_write(results.store.cell_path(cell.id), lambda tmp: pq.write_table(table, tmp))
        if cell["batch_size"] == 2:
            for i in range(PROMPTS):
                p = f"p{i}"
                mine = choice[prompt_ids == p]
                at = [VARIANTS[c][0] for c in mine if c >= 0]
                key = (cell.id, p)
                truth.diverged[key] = len(at)
                truth.first_min[key] = min(at) if at else None
                truth.first_median[key] = float(np.median(at)) if at else None
                truth.unique[key] = len(set(mine.tolist()))
                if at:  # the earliest variant's runs part from all others there
                    early = sum(1 for a in at if a == min(at))
                    truth.root_split[key] = (min(at), tuple(sorted((early, repeats - early))))
    return truth


def timed(args: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run a harness command in a fresh process: (wall s, peak resident MiB, result)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        done = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", out.name, sys.executable, "-m", "harness", *args],
                              capture_output=True, text=True, cwd=ROOT)
        wall, kib = out.read().split()[-2:]
    return float(wall), int(kib) / 1024, done


def check_summary(folder: Path, truth: Truth) -> list[str]:
    """Every statistic of summary.parquet against the ground truth; the wrong ones, described."""
    import pandas as pd

    summary = pd.read_parquet(folder / "summary.parquet")
    wrong = []
    for r in summary.itertuples():
        key = (r.cell_id, r.prompt_id)
        if r.batch_size == 1:
            if r.unique_outputs != 1 or (r.diverged or 0) != 0:
                wrong.append(f"{key}: reference cell shows divergence")
            continue
        expect = (truth.diverged[key], truth.unique[key], truth.first_min[key], truth.first_median[key])
        got = (int(r.diverged), int(r.unique_outputs),
               None if pd.isna(r.first_divergence_min) else int(r.first_divergence_min),
               None if pd.isna(r.first_divergence_median) else float(r.first_divergence_median))
        if got != expect:
            wrong.append(f"{key}: got {got}, truth {expect}")
    if len(summary) != len(truth.diverged) * 2:
        wrong.append(f"summary has {len(summary)} records, expected {len(truth.diverged) * 2}")
    return wrong


def check_splits(folder: Path, truth: Truth) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "harness", "summarize", str(folder), "--what", "splits",
                           "--format", "json"], capture_output=True, text=True, cwd=ROOT)
    records = json.loads(done.stdout or "[]")
    branches: dict[tuple[str, str], tuple[int, list[int]]] = {}
    for r in records:
        if r["node"] == 0:
            branches.setdefault((r["cell_id"], r["prompt_id"]), (r["split_at"], []))[1].append(r["runs"])
    roots = {k: (at, tuple(sorted(runs))) for k, (at, runs) in branches.items()}
    want = truth.root_split
    return [f"split {k}: got {roots.get(k)}, truth {v}" for k, v in want.items() if roots.get(k) != v][:5] + (
        [f"{len(set(roots) - set(want))} splits where none was injected"] if set(roots) - set(want) else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--source", type=Path, help="a results folder of a real run (default: make one)")
    parser.add_argument("--work", type=Path, help="where the folders go (default: a temporary folder, removed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], help="commands to leave out, e.g. report")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = False
    try:
        template = source_rows(args.source, work)
        for n in args.rows:
            folder = work / f"rows-{n}"
            shutil.rmtree(folder, ignore_errors=True)
            truth = build(folder, template, n, args.seed)
            total = sum(pq.read_metadata(p).num_rows for p in (folder / "cells").glob("*.parquet"))
            size = sum(p.stat().st_size for p in (folder / "cells").glob("*.parquet")) / 2**20
            print(f"\n{total} rows in {len(list((folder / 'cells').glob('*.parquet')))} cells ({size:.0f} MiB on disk)")
            print(f"{'command':<34} {'wall s':>7} {'peak MiB':>9}  result")
            commands = {
                "summarize": ["summarize", str(folder), "--save"],
                "check": ["check", str(folder)],
                "status": ["status", str(folder)],
                "compare (folder with itself)": ["compare", str(folder), str(folder)],
                "merge": ["merge", str(folder), "--out", str(work / f"merged-{n}")],
                "report": ["report", str(folder), "--out", str(work / f"report-{n}.html")],
            }
            for name, command in commands.items():
                if name.split()[0] in args.skip:
                    continue
                shutil.rmtree(work / f"merged-{n}", ignore_errors=True)
                wall, mib, done = timed(command)
                note = f"exit {done.returncode}"
                if name == "summarize":
                    wrong = check_summary(folder, truth) + check_splits(folder, truth)
                    note += "; statistics = ground truth" if not wrong else "; WRONG: " + "; ".join(wrong[:5])
                    failed |= bool(wrong)
                if name == "report" and done.returncode == 0:
                    note += f"; {(work / f'report-{n}.html').stat().st_size / 2**20:.1f} MiB HTML"
                failed |= done.returncode != 0
                if done.returncode != 0:
                    note += f" ({(done.stderr or done.stdout).strip().splitlines()[-1:]})"
                print(f"{name:<34} {wall:>7.1f} {mib:>9.0f}  {note}", flush=True)
            shutil.rmtree(work / f"merged-{n}", ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
