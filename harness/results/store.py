"""Parquet rows on disk: one file per cell, written atomically; resume; reading back."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from harness.results import layout
from harness.results.schema import DONE_STATUSES, LANDING_KEY, ROW_SCHEMA
from harness.results.store_reading import StoreReading, rows_at

if TYPE_CHECKING:  # pandas is imported where rows are read: `harness run` starts faster
    pass

#: rows per Parquet row group of a cell file: a campaign's part that reads some prompts of a large cell
#: reads only the groups that hold them (store_reading._rows_of_prompts); smaller cells are one group
ROW_GROUP_ROWS = 65_536


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def writer_tag() -> str:
    """Who writes a temporary file (host and pid), so cleanup never removes a live writer's file."""
    return f"{socket.gethostname()}.{os.getpid()}"


def _writer_gone(tmp: Path) -> bool:
    """True when the file's writer was a process of this host that no longer exists.

    Files of other hosts (an array task on another node of a shared folder) are left alone:
    their writer's liveness cannot be seen from here.
    """
    name, _, pid = tmp.name.removesuffix(".tmp").rpartition(".")
    if not pid.isdigit() or not name.endswith("." + socket.gethostname()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


class Store(StoreReading):
    """The cell files of a results folder: `cells/<cell_id>.parquet`, each written atomically.

    Which of them a reader may use is the manifest's business (harness.results.folder); this class
    only reads and writes files, restricted to given cell ids where a caller names them.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cells_dir = self.root / layout.CELLS
        self.partial_dir = self.root / layout.PARTIAL

    def cell_path(self, cell_id: str) -> Path:
        return layout.cell_file(self.root, cell_id)

    def statuses(self, cell_id: str) -> list[str]:
        """The status of each row of a cell; empty when the cell is absent or unreadable."""
        path = self.cell_path(cell_id)
        if not path.is_file():
            return []
        try:  # one file, one column: ParquetFile (pq.read_table would import pyarrow.dataset, and pandas with it)
            return pq.ParquetFile(path).read(columns=["status"]).column("status").to_pylist()
        except (pa.ArrowInvalid, OSError, KeyError):
            return []

    def is_done(self, cell_id: str) -> bool:
        """Done: the file exists and every row is ok or refused by the engine's declared rules.

        Failed rows are retried, and so are skipped ones (the GPU type was not here): they run
        when the experiment runs on a node that has it.
        """
        statuses = self.statuses(cell_id)
        return bool(statuses) and set(statuses) <= DONE_STATUSES

    def atomic_write(self, path: Path, write: Any) -> Path:
        """Write through a temporary file named for this writer, then rename into place."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{writer_tag()}.tmp")
        try:
            write(tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk, a kill: no half-written file is left behind
            tmp.unlink(missing_ok=True)
            raise
        return path

    def write_cell(self, cell_id: str, rows: list[dict[str, Any]], landing: dict[str, Any] | None = None) -> Path:
        """Write all rows of a cell at once: a reader sees the whole cell or none of it. `landing`
        (who landed it, when, for which run) is kept in the file's own metadata."""
        return self._write_rows(self.cell_path(cell_id), rows, landing)

    def landing(self, cell_id: str) -> dict[str, Any]:
        """The landing record a cell file carries (empty: no file, or one written before records)."""
        try:
            meta = pq.read_schema(self.cell_path(cell_id)).metadata or {}
        except (pa.ArrowInvalid, OSError):
            return {}
        raw = meta.get(LANDING_KEY)
        return json.loads(raw) if raw else {}

    def _write_rows(self, path: Path, rows: list[dict[str, Any]], landing: dict[str, Any] | None = None) -> Path:
        """Rows in the row schema, atomically. Swept engine options ('ENGINE.OPTION' keys) are
        setting columns of their own, as text."""
        swept = sorted({k for r in rows for k in r if "." in k and k not in ROW_SCHEMA.names})
        schema = ROW_SCHEMA
        for name in swept:
            schema = schema.append(pa.field(name, pa.string()))
        rows = [r | {k: None if r.get(k) is None else str(r[k]) for k in swept} for r in rows] if swept else rows
        if landing is not None:
            schema = schema.with_metadata({LANDING_KEY: json.dumps(landing, sort_keys=True)})
        table = pa.Table.from_pylist(rows, schema=schema)
        return self.atomic_write(path, lambda tmp: pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS))

    # -- checkpoints: the finished batches of a cell still running, under partial/<cell_id>/ --------

    def part_dir(self, cell_id: str) -> Path:
        return self.partial_dir / cell_id

    def write_part(self, cell_id: str, name: str, rows: list[dict[str, Any]]) -> Path:
        """One checkpoint of a cell: rows of batches that finished since the last one (atomic)."""
        return self._write_rows(self.part_dir(cell_id) / name, rows)

    def parts(self, cell_id: str) -> list[str]:
        """A cell's checkpoint files, oldest first (each was renamed into place whole)."""
        found = self.part_dir(cell_id).glob("*.parquet")
        return [p.name for p in sorted(found, key=lambda p: (_mtime(p), p.name))]

    def part_rows(self) -> dict[str, int]:
        """Rows held in checkpoints, by cell id, read from the files' footers."""
        out: dict[str, int] = {}
        for folder in sorted(self.partial_dir.iterdir()) if self.partial_dir.is_dir() else []:
            for path in folder.glob("*.parquet"):
                try:
                    out[folder.name] = out.get(folder.name, 0) + pq.read_metadata(path).num_rows
                except (pa.ArrowInvalid, OSError):
                    continue  # removed meanwhile, by the task that landed the cell
        return out

    def read_part(self, cell_id: str, name: str) -> list[dict[str, Any]]:
        """A checkpoint's rows as written; empty when the file is gone or unreadable."""
        return rows_at(self.part_dir(cell_id) / name)

    def read_cell_rows(self, cell_id: str) -> list[dict[str, Any]]:
        """A cell file's rows as written; empty when the file is gone or unreadable."""
        return rows_at(self.cell_path(cell_id))

    def remove_parts(self, cell_id: str) -> None:
        """Remove a cell's checkpoint files; its folder goes when nothing else is in it (a part
        another writer is renaming into place right now is left to it)."""
        for path in self.part_dir(cell_id).glob("*.parquet"):
            path.unlink(missing_ok=True)
        for folder in (self.part_dir(cell_id), self.partial_dir):
            try:
                folder.rmdir()  # the last one out leaves no empty folder
            except OSError:
                break

    def write_meta(self, name: str, content: str) -> None:
        self.atomic_write(self.root / name, lambda tmp: tmp.write_text(content, encoding="utf-8"))

    def clean_stale(self) -> int:
        """Remove temporary files (of cells and checkpoints) whose writer, a process of this host, is gone."""
        found = list(self.cells_dir.glob(".*.tmp")) + list(self.partial_dir.glob("*/.*.tmp"))
        stale = [p for p in found if _writer_gone(p)]
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def cell_files(self, cell_ids: Iterable[str] | None = None) -> list[Path]:
        """Finished cell files: all of them, or those of the given ids that exist."""
        if cell_ids is None:
            return sorted(self.cells_dir.glob("*.parquet")) if self.cells_dir.is_dir() else []
        return sorted(p for p in (self.cell_path(c) for c in set(cell_ids)) if p.is_file())
