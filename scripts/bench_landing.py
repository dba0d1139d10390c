"""What landing a cell costs as a shared results folder fills up: a folder of 1000 array tasks
must not slow each landing down with the number of cells already there.

    python scripts/bench_landing.py [--cells 10,1000,3000] [--land 200] [--work DIR]

For each folder size N, a folder is filled by landing N cells (one row each), then `--land` more
cells are landed through `ResultsFolder.write_cell` (lock, landing rule, cell file with its
landing record) and, alternating with them, the same rows are written by a bare atomic Parquet
write and rename (the least any landing can cost). Prints milliseconds per landing, the ratio to
the bare write, and the ratio to the smallest folder: flat ratios mean the cost does not grow
with the folder. Checkpoints are part files of their own and cost one bare write each.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.results.folder import ResultsFolder  # noqa: E402


def _row(cell_id: str) -> dict:
    return {"cell_id": cell_id, "prompt_id": "p", "repeat": 0, "status": "ok", "token_ids": list(range(64))}


def measure(root: Path, cells: int, land: int) -> tuple[float, float]:
    """Median seconds per landing and per bare write, in a folder already holding `cells` cells."""
    folder = ResultsFolder(root)
    for i in range(cells):
        folder.write_cell(f"fill{i:06d}", [_row(f"fill{i:06d}")], "fill")
    mine, bare = [], []
    for i in range(land):
        cell = f"new{i:06d}"
        t0 = time.perf_counter()
        folder.write_cell(cell, [_row(cell)], "bench")
        mine.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        folder.store.write_part("bare", f"{cell}.parquet", [_row(cell)])
        bare.append(time.perf_counter() - t0)
    return statistics.median(mine), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="10,1000,3000", help="folder sizes to measure, comma-separated")
    parser.add_argument("--land", type=int, default=200, help="cells landed per folder size")
    parser.add_argument("--work", type=Path, default=None, help="where to make the folders (default: a temp dir)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-landing-"))
    print(f"{'cells in folder':>15} {'landing ms':>11} {'bare ms':>8} {'vs bare':>8} {'vs smallest':>12}")
    first = None
    for n in (int(x) for x in args.cells.split(",")):
        root = work / f"n{n}"
        shutil.rmtree(root, ignore_errors=True)
        mine, bare = measure(root, n, args.land)
        first = first or mine
        print(f"{n:>15} {mine * 1e3:>11.2f} {bare * 1e3:>8.2f} {mine / bare:>8.2f} {mine / first:>12.2f}")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
