"""Where a results folder keeps its cell files, checkpoints and logs, in the standard library only:
`harness run` looks here before it imports pyarrow (harness.run.ahead), and the store and the
runner name the same places from here."""

from __future__ import annotations

from pathlib import Path

#: the folder's finished cells, one `<cell_id>.parquet` each
CELLS = "cells"
#: finished batches of cells still running, `<cell_id>/<part>.parquet`
PARTIAL = "partial"
#: each engine load's log, `<group_id>.log`, and those of the servers it started
LOGS = "logs"


def cell_file(root: Path, cell_id: str) -> Path:
    return Path(root) / CELLS / f"{cell_id}.parquet"


def group_log(root: Path, group_id: str) -> Path:
    return Path(root) / LOGS / f"{group_id}.log"
