"""Parquet rows on disk: one file per cell, written atomically; resume; reading back."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import harness
from harness.results import layout, provenance_fields
from harness.experiment.axes import AXES_DECLARED
from harness.core.errors import HarnessError

if TYPE_CHECKING:  # pandas is imported where rows are read: `harness run` starts faster
    import pandas as pd


#: 2 added token_texts and the probe_* columns; 3 the answer_* columns; 4 the prefix_cache,
#: context_tokens, prefill_chunk and kv_cache_dtype axes, cached_tokens, context_tokens_used,
#: logprobs_hash and the prefill_probe_* columns; 5 what ran (harness.run.enforced: device, backend,
#: offloaded layers, batch-invariant kernels, CUDA graphs, tensor parallelism, attention backend);
#: 6 seed_check (the seed control's verdict); 7 run_key (what one run depends on: harness.run.reuse);
#: 8 prefill_probe_kl_mean and prefill_probe_kl_max (exact KL of decode vs one prefill, per step);
#: 9 cpu_kernels (llama.cpp's CPU kernel path: extra buffer types in use, build features, llamafile);
#: 10 boot and load_id (the engine load a run came from: cross-boot repeats), python_executable
#: (the interpreter a worker ran under: the environment axis); 11 the kv_cache_tokens and draft_tokens
#: axes, preemptions, batch_preemptions, draft_proposed, draft_accepted and itl_s (serving under load: harness.analysis.latency).
#: Older files read back with the newer columns empty, and the newer axes at their defaults (what
#: those files were run with).
SCHEMA_VERSION = 11

#: The row contract (docs/rows.md). Order here is the column order on disk.
ROW_SCHEMA = pa.schema(
    [
        # identity
        ("schema_version", pa.int16()),
        ("experiment", pa.string()),
        ("run_id", pa.string()),
        ("cell_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("repeat", pa.int32()),
        ("batch_position", pa.int32()),
        ("filler_ids", pa.list_(pa.string())),
        ("run_key", pa.string()),
        # the engine load that made the run: its boot (of the experiment's `boots`) and a load id
        # unique to that worker process (runs with one load id shared an engine load)
        ("boot", pa.int32()),
        ("load_id", pa.string()),
        # settings: one column per declared axis (harness.experiment.axes), named and typed by it
        *[(axis.name, getattr(pa, axis.arrow)()) for axis in AXES_DECLARED],
        ("max_tokens", pa.int32()),
        ("engine_options", pa.string()),
        ("model_file", pa.string()),
        ("model_sha256", pa.string()),
        ("engine_version", pa.string()),
        # outcome
        ("status", pa.string()),
        ("error", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("context_tokens_used", pa.int32()),
        ("cached_tokens", pa.int32()),
        # what the engine's scheduler did to the target: preempted (and recomputed) so many times, and
        # with speculative decoding the tokens drafted for it and accepted; empty where not reported
        ("preemptions", pa.int32()),
        ("batch_preemptions", pa.int32()),
        ("draft_proposed", pa.int32()),
        ("draft_accepted", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("n_tokens", pa.int32()),
        ("text", pa.string()),
        ("token_texts", pa.list_(pa.string())),
        ("finish_reason", pa.string()),
        ("output_hash", pa.string()),
        ("logprobs", pa.list_(pa.float32())),
        ("margins", pa.list_(pa.float32())),
        ("logprobs_hash", pa.string()),
        ("engine_detail", pa.string()),
        # what ran (harness.run.enforced), beside the settings asked for
        ("device", pa.string()),
        ("device_uuid", pa.string()),
        ("backend", pa.string()),
        ("offloaded_layers", pa.int32()),
        ("model_layers", pa.int32()),
        ("batch_invariant_active", pa.bool_()),
        ("cuda_graphs", pa.bool_()),
        ("tensor_parallel_size", pa.int32()),
        ("attention_backend", pa.string()),
        # the seed control's verdict (harness.run.seed_control; empty: not asked for, or greedy)
        ("seed_check", pa.string()),
        # answers (prompts that give an answer and/or a parse rule)
        ("answer_parsed", pa.string()),
        ("answer_expected", pa.string()),
        ("answer_correct", pa.bool_()),
        # logit probes (probe_logits: true), against the same prompt decoded alone
        ("probe_reference", pa.string()),
        ("probe_steps", pa.int32()),
        ("probe_steps_differed", pa.int32()),
        ("probe_first_diff_step", pa.int32()),
        ("probe_logits_compared", pa.int64()),
        ("probe_logits_differed", pa.int64()),
        ("probe_max_abs_diff", pa.float64()),
        ("probe_low_margin_frac", pa.float64()),
        ("prefill_probe_steps", pa.int32()),
        ("prefill_probe_steps_differed", pa.int32()),
        ("prefill_probe_first_diff_step", pa.int32()),
        ("prefill_probe_max_abs_diff", pa.float64()),
        ("prefill_probe_kl_mean", pa.float64()),
        ("prefill_probe_kl_max", pa.float64()),
        # timing
        ("started_at", pa.timestamp("us", tz="UTC")),
        ("prefill_s", pa.float64()),
        ("ttft_s", pa.float64()),
        # gaps between successive output tokens of the target as the caller received them (inter-token
        # latency); empty where the engine hands the output over only at the end
        ("itl_s", pa.list_(pa.float32())),
        ("decode_s", pa.float64()),
        ("wall_s", pa.float64()),
        ("target_tokens_per_s", pa.float64()),
        ("batch_tokens_per_s", pa.float64()),
        # provenance
        ("host", pa.string()),
        ("platform", pa.string()),
        ("cpu", pa.string()),
        ("cpu_count", pa.int32()),
        ("gpu_name", pa.string()),
        ("gpu_count", pa.int32()),
        ("gpu_driver", pa.string()),
        ("gpu_uuid", pa.string()),
        ("gpu_compute_cap", pa.string()),
        ("cuda_version", pa.string()),
        ("library_versions", pa.string()),
        ("python_version", pa.string()),
        ("python_executable", pa.string()),
        ("harness_version", pa.string()),
        ("git_commit", pa.string()),
        ("engine_info", pa.string()),
        ("cpu_kernels", pa.string()),
        ("env", pa.string()),
        ("job_id", pa.string()),
        ("job_array_index", pa.string()),
    ]
)

#: text columns that say where and with what a row was made: the CLI's readers read them as
#: pandas categoricals (they only compare, group and list them, and a categorical does that
#: without hashing a million strings); by default they read back as Python strings
WHERE_MADE = tuple(n for n in provenance_fields.NAMES if ROW_SCHEMA.field(n).type == pa.string())

#: the key of a cell file's metadata that records its landing (run_id, writer, written_at, statuses)
LANDING_KEY = b"harness.landing"

#: statuses a rerun does not redo: the run happened, or the engine's declared rules refuse it
DONE_STATUSES = frozenset({"ok", "unsupported"})


def _refuse_newer(path: Path, table: pa.Table) -> None:
    """A file from a newer harness has columns and meanings this one does not know: refuse it."""
    if "schema_version" not in table.column_names or table.num_rows == 0:
        return
    newest = pc.max(table.column("schema_version")).as_py()
    if newest is not None and newest > SCHEMA_VERSION:
        try:
            writers = sorted(set(pq.ParquetFile(path).read(columns=["harness_version"]).column(0).to_pylist())
                             - {None, ""})
        except (pa.ArrowInvalid, KeyError):
            writers = []
        raise HarnessError(
            f"{path}: written with row schema version {newest} by a newer harness "
            f"({', '.join(writers) or 'version not recorded'}); this harness ({harness.__version__}) reads up to "
            f"version {SCHEMA_VERSION}: upgrade it to read these results"
        )


#: columns every cell file has, whatever its schema version: a file without them is not one
CELL_FILE_COLUMNS = ("cell_id", "prompt_id", "repeat", "status")


def readable(path: Path) -> pq.ParquetFile:
    """A cell file opened for reading; a damaged one (empty, cut short by a full disk or a killed
    copy) is an error naming it and what to do, never a traceback of every reader."""
    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise HarnessError(
            f"{path}: not a readable Parquet file ({exc}); it was cut short or emptied (a full disk, a killed "
            "copy?). Move it out of cells/: its cell then counts as missing and the next run redoes it"
        ) from None
    lacking = [c for c in CELL_FILE_COLUMNS if c not in handle.schema_arrow.names]
    if lacking:
        raise HarnessError(f"{path}: a Parquet file, but not a cell file of this harness (no {', '.join(lacking)} "
                           "column); move it out of cells/")
    return handle


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


def _with_later_axes(table: pa.Table, wanted: list[str] | None) -> pa.Table:
    """A file written before an axis existed was run at that axis's default: say so in its rows."""
    from harness.experiment.axes import LATER_AXES_DEFAULTS

    for name, default in LATER_AXES_DEFAULTS.items():
        if name not in table.column_names and (wanted is None or name in wanted):
            kind = ROW_SCHEMA.field(name).type
            table = table.append_column(pa.field(name, kind), pa.array([default] * table.num_rows, type=kind))
    return table


def _encoded(table: pa.Table) -> pa.Table:
    """Every text column dictionary-encoded, so tables of files of older schemas concatenate."""
    for i, field in enumerate(table.schema):
        if pa.types.is_string(field.type):
            table = table.set_column(i, field.name, pc.dictionary_encode(table.column(i)))
    return table


def _shared_strings(frame: "pd.DataFrame", keep: Iterable[str] = ()) -> "pd.DataFrame":
    """Categorical text columns (but those in `keep`) as object columns whose equal values share one
    Python string.

    A million rows of a 500-byte engine_info cost 8 MB of pointers, not 500 MB of text; the
    values (missing ones as None) are the same as a plain read gives.
    """
    import numpy as np
    import pandas as pd

    for name in frame.columns:
        column = frame[name]
        if isinstance(column.dtype, pd.CategoricalDtype) and name not in keep:
            values = np.append(np.asarray(column.cat.categories, dtype=object), None)
            frame[name] = pd.Series(values[column.cat.codes.to_numpy()], index=frame.index, dtype=object, copy=False)
    return frame


def _file_by_file(read: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`read` of each item, in order, in a few threads: Parquet decodes outside the GIL, so a folder
    of many cell files is read faster than one file after another."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(read, items))


def _read_cell_file(path: Path, wanted: list[str] | None) -> pa.Table:
    """One cell file's `wanted` columns (all when None), its texts dictionary-encoded, later axes filled."""
    footer = readable(path)
    schema = footer.schema_arrow
    names = set(schema.names)
    present = None if wanted is None else [c for c in wanted if c in names]
    # text columns read as Parquet stores them, dictionary-encoded: a cell repeats its settings
    # and provenance in every row, and each distinct value is then one Python string
    chosen = names if present is None else set(present)
    text = [f.name for f in schema if f.name in chosen and pa.types.is_string(f.type)]
    table = pq.ParquetFile(path, read_dictionary=text, metadata=footer.metadata).read(columns=present)
    _refuse_newer(path, table)
    return _encoded(_with_later_axes(table, wanted))


def _rows_at(path: Path) -> list[dict[str, Any]]:
    """A file's rows as written; empty when it is gone or unreadable; refused when a newer harness wrote it."""
    try:
        table = pq.ParquetFile(path).read()
    except (pa.ArrowInvalid, OSError):
        return []
    _refuse_newer(path, table)
    return table.to_pylist()


class Store:
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
        return self.atomic_write(path, lambda tmp: pq.write_table(table, tmp))

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
        return _rows_at(self.part_dir(cell_id) / name)

    def read_cell_rows(self, cell_id: str) -> list[dict[str, Any]]:
        """A cell file's rows as written; empty when the file is gone or unreadable."""
        return _rows_at(self.cell_path(cell_id))

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

    def read_rows(self, columns: list[str] | None = None, cell_ids: Iterable[str] | None = None,
                  provenance_as_categories: bool = False) -> pd.DataFrame:
        """Every row of the finished cells (all, or the given ids), one DataFrame (empty with the schema if none).

        With `provenance_as_categories`, the WHERE_MADE columns are pandas categoricals (for readers
        that only group, compare and list them); every other text column holds Python strings.

        A file written by a newer schema version is refused, never read with its new columns dropped.
        """
        files = self.cell_files(cell_ids)
        if not files:
            return ROW_SCHEMA.empty_table().to_pandas()[columns or ROW_SCHEMA.names]
        wanted = None if columns is None else list(dict.fromkeys(columns + ["schema_version"]))
        tables = _file_by_file(lambda path: _read_cell_file(path, wanted), files)
        frame = _shared_strings(pa.concat_tables(tables, promote_options="default").to_pandas(),
                                keep=WHERE_MADE if provenance_as_categories else ())
        names = columns or ROW_SCHEMA.names + [c for c in frame.columns if c not in ROW_SCHEMA.names]
        for name in names:  # columns newer than some files read back empty
            if name not in frame.columns:
                frame[name] = None
        return frame[names]

    def tokens_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None) -> dict[str, list[int]]:
        """Token ids of the outputs with these hashes (one row each), read without loading all."""
        return self._lists_for("output_hash", "token_ids", hashes, cell_ids)

    def texts_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Each token of the outputs with these hashes decoded on its own (empty where not recorded)."""
        return self._lists_for("output_hash", "token_texts", hashes, cell_ids)

    def whole_texts_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None) -> dict[str, str]:
        """The decoded text of the outputs with these hashes."""
        return self._lists_for("output_hash", "text", hashes, cell_ids)

    def logprobs_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None) -> dict[str, list[float]]:
        """Per-step log-probabilities with these logprobs_hash values (one row each)."""
        return self._lists_for("logprobs_hash", "logprobs", hashes, cell_ids)

    def _lists_for(self, key: str, column: str, hashes: set[str], cell_ids: Iterable[str] | None) -> dict[str, Any]:
        """`column` of one row per wanted `key` value, file by file until every value is found.

        A million rows of a few distinct outputs read the key column and one row per output,
        never every row's list. A value found only in files without `column` (an older schema)
        maps to None.
        """
        import numpy as np

        remaining = set(hashes)
        out: dict[str, Any] = {}
        for path in self.cell_files(cell_ids):
            if not remaining:
                break
            handle = readable(path)
            if key not in handle.schema_arrow.names:
                continue
            keys = handle.read(columns=[key]).column(0)
            index = pc.fill_null(pc.index_in(keys, value_set=pa.array(sorted(remaining), pa.string())), -1)
            index = index.to_numpy()
            rows = np.flatnonzero(index >= 0)
            if rows.size == 0:
                continue
            first = rows[np.unique(index[rows], return_index=True)[1]]
            found = keys.take(pa.array(first)).to_pylist()
            if column not in handle.schema_arrow.names:
                out.update((h, out.get(h)) for h in found)
                continue
            values = handle.read(columns=[column]).column(0).take(pa.array(first)).to_pylist()
            out.update(zip(found, values))
            remaining.difference_update(found)
        return out

    def values_at(self, column: str, runs: "pd.DataFrame") -> "pd.Series":
        """`column` of the given runs (their cell_id, prompt_id and repeat), read for those rows only:
        a per-step list wanted for the few thousand runs that depart, not for a million.
        None where a run or the column is not on disk."""
        import pandas as pd

        out = pd.Series([None] * len(runs), index=runs.index, dtype=object)
        parts = [(str(cell_id), part) for cell_id, part in runs.groupby("cell_id", sort=False)]
        found = _file_by_file(lambda job: self._values_in_cell(column, *job), parts)
        for index, values in found:
            if len(index):
                out.loc[index] = pd.Series(values, index=index, dtype=object)
        return out

    def _values_in_cell(self, column: str, cell_id: str, part: "pd.DataFrame") -> tuple[Any, list[Any]]:
        """(the index of `part`'s runs found in the cell's file, their `column` values)."""
        import numpy as np

        path = self.cell_path(cell_id)
        if not path.is_file():
            return part.index[:0], []
        handle = readable(path)
        if column not in handle.schema_arrow.names:
            return part.index[:0], []
        ids = handle.read(columns=["prompt_id", "repeat"])
        prompts = [str(p) for p in part["prompt_id"].astype(object).unique()]
        repeats = part["repeat"].to_numpy(dtype=np.int64)
        # only the rows that can be wanted become Python values (a few of thousands, in a big cell)
        maybe = pc.and_(pc.is_in(ids.column(0), value_set=pa.array(prompts, pa.string())),
                        pc.is_in(ids.column(1), value_set=pa.array(np.unique(repeats), ids.column(1).type)))
        rows = np.flatnonzero(maybe.to_numpy(zero_copy_only=False))
        where: dict[tuple[str, int], int] = {}
        for row, p, r in zip(rows, ids.column(0).take(pa.array(rows)).to_pylist(),
                             ids.column(1).take(pa.array(rows)).to_pylist()):
            where.setdefault((p, int(r)), int(row))
        at = np.array([where.get((str(p), int(r)), -1) for p, r in zip(part["prompt_id"], repeats)], dtype=np.int64)
        found = at >= 0
        if not found.any():
            return part.index[:0], []
        values = handle.read(columns=[column]).column(0).take(pa.array(at[found]))
        return part.index[found], values.to_pylist()

    def read_cell(self, cell_id: str, columns: list[str] | None = None) -> pd.DataFrame:
        return readable(self.cell_path(cell_id)).read(columns=columns).to_pandas()
