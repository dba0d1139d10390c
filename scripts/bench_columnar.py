"""One group-by of a large results folder in three columnar tools, to weigh a move from
pandas: runs and distinct outputs per (cell, prompt), with two provenance columns.

    python scripts/bench_columnar.py FOLDER TOOL      # TOOL: pandas, polars or duckdb

`pandas` is the harness's own read (pyarrow, dictionary-encoded text) and a pandas group-by;
`polars` and `duckdb` scan the cell files themselves (install them first: they are not
dependencies of the harness). Make a folder with `scripts/bench_scale.py --work DIR`. Prints
records, wall seconds and peak resident memory of this process; run each tool in its own process.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[2] not in ("pandas", "polars", "duckdb"):
        raise SystemExit(__doc__)
    folder, tool = Path(sys.argv[1]), sys.argv[2]
    files = str(folder / "cells" / "*.parquet")
    start = time.perf_counter()
    if tool == "duckdb":
        import duckdb

        out = duckdb.sql(f"SELECT cell_id, prompt_id, count(*) runs, count(DISTINCT output_hash) uniq, "
                         f"any_value(model_sha256), any_value(engine_info) FROM read_parquet('{files}') "
                         "GROUP BY 1, 2").df()
    elif tool == "polars":
        import polars as pl

        out = (pl.scan_parquet(files).group_by(["cell_id", "prompt_id"])
               .agg(pl.len().alias("runs"), pl.col("output_hash").n_unique().alias("uniq"),
                    pl.col("model_sha256").first(), pl.col("engine_info").first()).collect())
    else:
        sys.path.insert(0, str(ROOT))
        from harness.results.store import Store

        rows = Store(folder).read_rows(["cell_id", "prompt_id", "output_hash", "model_sha256", "engine_info"],
                                       provenance_as_categories=True)
        g = rows.groupby(["cell_id", "prompt_id"], sort=False)
        out = g.size().to_frame("runs").join(g["output_hash"].nunique().rename("uniq"))
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{tool}: {len(out)} records in {wall:.2f} s, peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
