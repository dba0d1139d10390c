"""Reading cell files back: damaged or newer files refused with a clear message, older ones
filled with their later columns, and rows, token lists, texts and values read by cell."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import harness
from harness.core.errors import HarnessError
from harness.results.schema import CELL_FILE_COLUMNS, ROW_SCHEMA, SCHEMA_VERSION, WHERE_MADE

if TYPE_CHECKING:  # pandas is imported where rows are read: `harness run` starts faster
    import pandas as pd


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


@dataclass(frozen=True)
class RunSlice:
    """Of a cell file's rows (of the prompts read), those at positions [start, stop) in file order: a
    part of a campaign that cuts one prompt by its runs (harness.analysis.partitions)."""

    start: int
    stop: int

    def narrow(self, cell_id: str, handle: pq.ParquetFile, wanted: Any) -> Any:
        """`wanted` (a row mask of the file) kept at the chosen positions among its true rows."""
        import numpy as np

        out = np.zeros_like(wanted)
        out[np.flatnonzero(wanted)[self.start:self.stop]] = True
        return out


@dataclass(frozen=True)
class RunPick:
    """Of a cell file's rows (of the prompts read), the runs named as (cell id, repeat): the runs that
    stand for their cells, carried into each part of a prompt cut by its runs."""

    runs: tuple[tuple[str, int], ...]

    def narrow(self, cell_id: str, handle: pq.ParquetFile, wanted: Any) -> Any:
        """`wanted` (a row mask of the file) kept where the row's repeat is one named for this cell."""
        import numpy as np

        repeats = [repeat for cell, repeat in self.runs if cell == cell_id]
        if not repeats or "repeat" not in handle.schema_arrow.names:
            return np.zeros_like(wanted)
        found = handle.read(columns=["repeat"], use_threads=False).column(0)
        return wanted & pc.is_in(found, value_set=pa.array(repeats, found.type)).to_numpy(zero_copy_only=False)


def _read_cell_file(path: Path, wanted: list[str] | None, prompt_ids: Sequence[str] | None = None,
                    runs: RunSlice | RunPick | None = None) -> pa.Table:
    """One cell file's `wanted` columns (all when None), its texts dictionary-encoded, later axes filled;
    only the rows of `prompt_ids` where given (a campaign's part: harness.analysis.partitions), and of
    those only `runs` where given (filtered before pandas sees them)."""
    footer = readable(path)
    schema = footer.schema_arrow
    names = set(schema.names)
    present = None if wanted is None else [c for c in wanted if c in names]
    # text columns read as Parquet stores them, dictionary-encoded: a cell repeats its settings
    # and provenance in every row, and each distinct value is then one Python string
    chosen = names if present is None else set(present)
    text = [f.name for f in schema if f.name in chosen and pa.types.is_string(f.type)]
    if prompt_ids is not None and "prompt_id" in names:
        text = list(dict.fromkeys(text + ["prompt_id"]))  # its ids compared once each (_rows_of_prompts)
    handle = pq.ParquetFile(path, read_dictionary=text, metadata=footer.metadata)
    if prompt_ids is None and runs is None:
        table = handle.read(columns=present)
    else:
        narrow = None if runs is None else (lambda handle, wanted: runs.narrow(path.stem, handle, wanted))
        table = _rows_of_prompts(handle, present, prompt_ids, narrow)
    _refuse_newer(path, table)
    return _encoded(_with_later_axes(table, wanted))


def _group_starts(handle: pq.ParquetFile) -> Any:
    """Each row group's first row in the file, and the file's row count last."""
    import numpy as np

    sizes = [handle.metadata.row_group(i).num_rows for i in range(handle.metadata.num_row_groups)]
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)


def _rows_of_prompts(handle: pq.ParquetFile, present: list[str] | None, prompt_ids: Sequence[str] | None,
                     narrow: Callable[[pq.ParquetFile, Any], Any] | None = None) -> pa.Table:
    """The rows of `prompt_ids` (None: all) in one cell file, of those the ones `narrow` keeps of their
    mask, reading only the row groups that hold any (a file's runs of a prompt lie together as the
    runner writes them, in groups of Store.ROW_GROUP_ROWS)."""
    import numpy as np

    values = pa.array(list(prompt_ids or ()), pa.string())

    def among(prompts: pa.Array) -> np.ndarray:
        if pa.types.is_dictionary(prompts.type):  # the few distinct ids compared, not a string per row
            known = np.append(pc.is_in(prompts.dictionary, value_set=values).to_numpy(zero_copy_only=False), False)
            return known[pc.fill_null(prompts.indices, -1).to_numpy(zero_copy_only=False)]
        return pc.is_in(prompts, value_set=values).to_numpy(zero_copy_only=False)

    if prompt_ids is None:
        wanted = np.ones(handle.metadata.num_rows, dtype=bool)
    else:
        chunks = handle.read(columns=["prompt_id"], use_threads=False).column(0).chunks
        wanted = np.concatenate([among(c) for c in chunks]) if chunks else np.zeros(0, dtype=bool)
    if narrow is not None:
        wanted = narrow(handle, wanted)
    starts = _group_starts(handle)
    groups = [i for i in range(len(starts) - 1) if wanted[starts[i]:starts[i + 1]].any()]
    if not groups:
        return handle.schema_arrow.empty_table().select(present) if present is not None else \
            handle.schema_arrow.empty_table()
    table = handle.read_row_groups(groups, columns=present)
    keep = np.concatenate([wanted[starts[i]:starts[i + 1]] for i in groups])
    return table.filter(pa.array(keep))


def _taken(handle: pq.ParquetFile, column: str, rows: Any) -> pa.ChunkedArray:
    """`column` at these rows of one file (in their order), reading only the row groups that hold them:
    a part of a campaign wants a per-step list for its prompts' departed runs, not the whole file's."""
    import numpy as np

    starts = _group_starts(handle)
    group_of = np.searchsorted(starts, rows, side="right") - 1
    groups = np.unique(group_of)
    # where each chosen group begins in the table read of the chosen groups alone
    begins = np.concatenate([[0], np.cumsum(np.diff(starts)[groups])])[:-1]
    local = rows - starts[group_of] + begins[np.searchsorted(groups, group_of)]
    return handle.read_row_groups(groups.tolist(), columns=[column]).column(0).take(pa.array(local))


def rows_at(path: Path) -> list[dict[str, Any]]:
    """A file's rows as written; empty when it is gone or unreadable; refused when a newer harness wrote it."""
    try:
        table = pq.ParquetFile(path).read()
    except (pa.ArrowInvalid, OSError):
        return []
    _refuse_newer(path, table)
    return table.to_pylist()



class StoreReading:
    """The reading half of Store (harness.results.store), for a class with `cell_files` and `cell_path`."""

    def read_rows(self, columns: list[str] | None = None, cell_ids: Iterable[str] | None = None,
                  provenance_as_categories: bool = False, prompt_ids: Sequence[str] | None = None,
                  runs: RunSlice | RunPick | None = None) -> pd.DataFrame:
        """Every row of the finished cells (all, or the given ids), one DataFrame (empty with the schema if none).

        With `provenance_as_categories`, the WHERE_MADE columns are pandas categoricals (for readers
        that only group, compare and list them); every other text column holds Python strings.

        A file written by a newer schema version is refused, never read with its new columns dropped.
        `prompt_ids`: only the rows of these prompts (None: every row); `runs`: of those, these runs.
        """
        files = self.cell_files(cell_ids)
        if not files:
            return ROW_SCHEMA.empty_table().to_pandas()[columns or ROW_SCHEMA.names]
        extra = ["schema_version"]
        wanted = None if columns is None else list(dict.fromkeys(columns + extra))
        tables = _file_by_file(lambda path: _read_cell_file(path, wanted, prompt_ids, runs), files)
        frame = _shared_strings(pa.concat_tables(tables, promote_options="default").to_pandas(),
                                keep=WHERE_MADE if provenance_as_categories else ())
        names = columns or ROW_SCHEMA.names + [c for c in frame.columns if c not in ROW_SCHEMA.names]
        for name in names:  # columns newer than some files read back empty
            if name not in frame.columns:
                frame[name] = None
        return frame[names]

    def cell_heads(self, columns: list[str], cell_ids: Iterable[str] | None = None) -> pd.DataFrame:
        """Per finished cell file, in file order: `cell_id`, its row count `rows` (from the footer) and
        `columns` of its first row (a cell holds one setting), later axes filled as read_rows fills
        them; the values of a file without rows are missing. Reads a few hundred bytes a file."""
        import pandas as pd

        def head(path: Path) -> dict[str, Any]:
            footer = readable(path)
            rows = footer.metadata.num_rows
            present = [c for c in columns if c in footer.schema_arrow.names]
            head_group = footer.metadata.num_row_groups and footer.metadata.row_group(0).num_rows
            first = (footer.read_row_group(0, columns=present) if head_group else footer.read(columns=present)) \
                .slice(0, 1) if rows else None
            values = _with_later_axes(first, columns).to_pylist()[0] if first is not None and first.num_rows else {}
            return {"cell_id": path.stem, "rows": rows} | {c: values.get(c) for c in columns}

        return pd.DataFrame(_file_by_file(head, self.cell_files(cell_ids)), columns=["cell_id", "rows", *columns])

    def tokens_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None,
                    prompt_ids: Sequence[str] | None = None) -> dict[str, list[int]]:
        """Token ids of the outputs with these hashes (one row each), read without loading all."""
        return self._lists_for("output_hash", "token_ids", hashes, cell_ids, prompt_ids)

    def texts_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None,
                   prompt_ids: Sequence[str] | None = None) -> dict[str, list[str]]:
        """Each token of the outputs with these hashes decoded on its own (empty where not recorded)."""
        return self._lists_for("output_hash", "token_texts", hashes, cell_ids, prompt_ids)

    def whole_texts_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None,
                         prompt_ids: Sequence[str] | None = None) -> dict[str, str]:
        """The decoded text of the outputs with these hashes."""
        return self._lists_for("output_hash", "text", hashes, cell_ids, prompt_ids)

    def logprobs_for(self, hashes: set[str], cell_ids: Iterable[str] | None = None,
                      prompt_ids: Sequence[str] | None = None) -> dict[str, list[float]]:
        """Per-step log-probabilities with these logprobs_hash values (one row each)."""
        return self._lists_for("logprobs_hash", "logprobs", hashes, cell_ids, prompt_ids)

    def _lists_for(self, key: str, column: str, hashes: set[str], cell_ids: Iterable[str] | None,
                   prompt_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """`column` of one row per wanted `key` value, file by file until every value is found.

        A million rows of a few distinct outputs read the key column and one row per output,
        never every row's list. A value found only in files without `column` (an older schema)
        maps to None. With `prompt_ids` (a campaign's part), only the row groups of those prompts
        are read: a hash of their runs is found among them, and its list is the same in any row.
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
            if prompt_ids is not None and "prompt_id" in handle.schema_arrow.names:
                handle = pq.ParquetFile(path, read_dictionary=["prompt_id"], metadata=handle.metadata)

                def read(name: str, handle: pq.ParquetFile = handle) -> pa.ChunkedArray:
                    return _rows_of_prompts(handle, [name], prompt_ids).column(0)
            else:
                def read(name: str, handle: pq.ParquetFile = handle) -> pa.ChunkedArray:
                    return handle.read(columns=[name]).column(0)
            keys = read(key)
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
            values = read(column).take(pa.array(first)).to_pylist()
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
        """(the index of `part`'s runs found in the cell's file, their `column` values): the wanted runs
        are found among the file's (prompt, repeat) pairs in arrays, not by a Python loop over its rows."""
        import numpy as np

        path = self.cell_path(cell_id)
        if not path.is_file():
            return part.index[:0], []
        handle = readable(path)
        if column not in handle.schema_arrow.names:
            return part.index[:0], []
        ids = handle.read(columns=["prompt_id", "repeat"])
        if ids.num_rows == 0:
            return part.index[:0], []
        prompts = sorted({str(p) for p in part["prompt_id"].astype(object).unique()})
        number = {p: i for i, p in enumerate(prompts)}
        code = pc.fill_null(pc.index_in(ids.column(0), value_set=pa.array(prompts, pa.string())), -1).to_numpy()
        repeat = pc.fill_null(ids.column(1), -1).to_numpy().astype(np.int64)
        wanted_repeat = part["repeat"].to_numpy(dtype=np.int64)
        width = int(max(repeat.max(initial=0), wanted_repeat.max(initial=0))) + 1
        # each (prompt, repeat) as one integer: the file's first row of each, found by binary search
        keys, first = np.unique(np.where((code >= 0) & (repeat >= 0), code * width + repeat, -1), return_index=True)
        wanted = np.array([number[str(p)] for p in part["prompt_id"]], dtype=np.int64) * width + wanted_repeat
        pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        at = np.where(keys[pos] == wanted, first[pos], -1)
        found = at >= 0
        if not found.any():
            return part.index[:0], []
        return part.index[found], _taken(handle, column, at[found]).to_pylist()

    def read_cell(self, cell_id: str, columns: list[str] | None = None) -> pd.DataFrame:
        return readable(self.cell_path(cell_id)).read(columns=columns).to_pandas()
