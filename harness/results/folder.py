"""A results folder as one object: its manifest says which experiment fills it and which cells count.

Every reader (summarize, check, report, plot, compare, merge, status) opens a folder through
`open_results`, so it sees the cells of the folder's current experiment only. Cells left by an
earlier version of the experiment (another prompt text, another max_tokens, ...) stay on disk
as *stale* and are read only when asked (`all_cells=True`). The experiment a reader uses is
the snapshot kept in the manifest, never the live YAML file, which may have changed since.

`manifest.json` says which experiment fills the folder; it changes only when that does:
    format, manifest_version, schema_version (of the rows),
    experiments: [{fingerprint, name, source, base, adopted_at, snapshot}]   # current ones

What a landing or a checkpoint records travels with its own file, so that the many array tasks of
a cluster writing into one folder never rewrite a shared file per cell: a cell file's metadata says
who landed it, when and for which run (`Store.landing`), and a running cell's checkpoints are the
part files under `partial/<cell_id>/`, each renamed into place whole. Landing one cell costs the same
in a folder of ten cells and of ten thousand (scripts/bench_landing.py).

Manifest updates are read-modify-write under an exclusive lock (`.manifest.lock`); a cell lands
under a lock of its own (`cells/.<cell_id>.lock`). Both are created exclusively
(harness.results.folder_lock, which works on NFS and Lustre), and files land by an atomic rename. Whether a
cell's rows may replace what is there is decided under the cell's lock, when they land
(`landing_rule`): a finished cell is never replaced by rows that are not.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import harness
from harness.core.errors import HarnessError
from harness.core.redaction import redact_rows
from harness.experiment.config import load_snapshot
from harness.experiment.matrix import Cell, expand
from harness.experiment.schema import LoadedExperiment
from harness.results.folder_lock import exclusive
from harness.results.schema import DONE_STATUSES, SCHEMA_VERSION
from harness.results.store import Store, writer_tag

if TYPE_CHECKING:  # pandas is imported where rows are read: `harness run` starts faster
    pass


MANIFEST = "manifest.json"
MANIFEST_FORMAT = "determinism-harness results"
#: 2: landings and checkpoints left the manifest for their own files (an older harness refuses it)
MANIFEST_VERSION = 2


def fingerprint(loaded: LoadedExperiment) -> str:
    """Hash of the experiment snapshot: equal fingerprints, equal experiments."""
    text = json.dumps(loaded.snapshot, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _weight(statuses: list[str]) -> int:
    """What a cell's rows weigh when they land: done (2) outweighs failed (1), which outweighs
    skipped (0: the GPU type was not on that node); a cell weighs what its lightest row does."""
    return min(2 if s in DONE_STATUSES else 0 if s == "skipped" else 1 for s in statuses)


def landing_rule(old: list[str], new: list[str], replace_done: bool = False) -> str | None:
    """None when rows with statuses `new` may replace a cell whose rows have statuses `old`
    (empty: no cell yet), else why not.

    Rows that are not done never replace a done cell; skipped rows never replace any cell;
    a done cell replaces a done one only when asked (--force). Failed rows replace failed ones
    (the newer failure says more).
    """
    if not old:
        return None
    before = _weight(old)
    after = _weight(new) if new else -1
    if after > before or (after == before == 1) or (after == before == 2 and replace_done):
        return None
    have = "done" if before == 2 else "failed" if before == 1 else "skipped"
    got = "done" if after == 2 else "failed" if after == 1 else "skipped"
    return f"kept the {have} cell already there; this run's {got} rows were not written"


@dataclass(frozen=True)
class Landing:
    """What write_cell did: whether the rows were written, and if not, why."""

    written: bool
    reason: str = ""


@dataclass(frozen=True)
class Adoption:
    """What `adopt` changed: the experiments the folder held before, now replaced."""

    replaced: list[str]  # names of experiments no longer current
    stale: list[str]  # cell ids on disk that no current experiment has


class ResultsFolder:
    """A results folder: cell files (`Store`) plus the manifest that says which of them count."""

    def __init__(self, root: Path, secrets: frozenset[str] = frozenset()) -> None:
        self.root = Path(root)
        self.store = Store(self.root)
        self.manifest_path = self.root / MANIFEST
        #: credential values a writer knows of (its engines' options): no landed row holds them, nor
        #: URL user information or a credential header in its free text (harness.core.redaction)
        self.secrets = secrets

    # -- the manifest ---------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with exclusive(self.root / ".manifest.lock"):
            yield

    def has_manifest(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> dict[str, Any]:
        """The manifest, checked: a newer format or row schema is refused, naming what wrote it."""
        if not self.has_manifest():
            return {"format": MANIFEST_FORMAT, "manifest_version": MANIFEST_VERSION,
                    "schema_version": SCHEMA_VERSION, "experiments": []}
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise HarnessError(f"{self.manifest_path}: not valid JSON ({exc}); the folder's manifest is damaged") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise HarnessError(f"{self.manifest_path}: not a results manifest of this harness")
        for key, known in (("manifest_version", MANIFEST_VERSION), ("schema_version", SCHEMA_VERSION)):
            if int(data.get(key, 0)) > known:
                raise HarnessError(
                    f"{self.manifest_path}: {key} {data[key]} was written by a newer harness "
                    f"({data.get('harness_version', '?')}); this one ({harness.__version__}) knows up to "
                    f"{known}: upgrade it to read these results"
                )
        return data

    def _update(self, change: Any) -> dict[str, Any]:
        """Apply `change` to the manifest under the lock; nothing is written when it returns False."""
        with self._locked():
            data = self.manifest()
            if change(data) is not False:
                self._save(data)
        return data

    def _save(self, data: dict[str, Any]) -> None:
        """Write the manifest (the caller holds the lock)."""
        for moved in ("cells", "partial"):  # version 1 kept these here; the files now carry them
            data.pop(moved, None)
        data["manifest_version"] = MANIFEST_VERSION
        data["schema_version"] = max(int(data.get("schema_version", 0)), SCHEMA_VERSION)
        data["harness_version"] = harness.__version__
        self.store.write_meta(MANIFEST, json.dumps(data, indent=1, sort_keys=True))

    def adopt(self, loaded: LoadedExperiment) -> Adoption:
        """Make `loaded` the folder's current experiment (a no-op when it already is).

        The snapshot is what readers use later; cells of a replaced experiment become stale.
        """
        fp = fingerprint(loaded)
        replaced: list[str] = []

        def change(data: dict[str, Any]) -> bool:
            if [e["fingerprint"] for e in data["experiments"]] == [fp]:
                return False
            replaced.extend(e["name"] for e in data["experiments"])
            data["experiments"] = [{
                "fingerprint": fp,
                "name": loaded.experiment.name,
                "source": str(loaded.path),
                "base": str(loaded.base),
                "adopted_at": datetime.now(timezone.utc).isoformat(),
                "snapshot": loaded.snapshot,
            }]
            return True

        created = not self.has_manifest()
        self._update(change)
        if replaced or created or not (self.root / "experiment.yaml").is_file():
            self.store.write_meta("experiment.yaml", _as_yaml(loaded.snapshot))
        return Adoption(replaced, self.stale_ids() if replaced else [])

    def _landing(self, statuses: Iterable[str], run_id: str) -> dict[str, Any]:
        """The record a landing writes into the cell file: the run, the writer, the experiment."""
        current = [e["fingerprint"] for e in self.manifest()["experiments"]]
        return {
            "experiment": current[0] if len(current) == 1 else current,
            "statuses": dict(Counter(statuses)),
            "run_id": run_id,
            "writer": writer_tag(),
            "written_at": datetime.now(timezone.utc).isoformat(),
        }

    def landed(self, cell_id: str) -> dict[str, Any]:
        """How the cell on disk landed (run_id, writer, written_at, statuses); empty when it is absent."""
        return self.store.landing(cell_id)

    def write_cell(self, cell_id: str, rows: list[dict[str, Any]], run_id: str, replace_done: bool = False) -> Landing:
        """Land a cell's rows, deciding under the cell's lock whether they may replace what is there.

        Many tasks of many nodes land into one folder, each having decided what to run when it
        started; the decision that counts is this one, taken when the rows arrive (`landing_rule`).
        Once the cell on disk is done, its checkpoints are worth nothing (another task still
        running it can only land rows that are refused) and this landing removes them all, those
        of killed tasks included; a cell that is not done keeps them, for the rerun.
        """
        rows = redact_rows(rows, self.secrets)
        new = [r["status"] for r in rows]
        record = self._landing(new, run_id)
        return self._land(cell_id, new, lambda: self.store.write_cell(cell_id, rows, record), replace_done)

    def land_file(self, cell_id: str, source: Path, statuses: list[str]) -> Landing:
        """Land another folder's cell file (its rows' `statuses`) as it is (harness merge), by the same
        rule and lock as rows."""
        import shutil

        dest = self.store.cell_path(cell_id)
        return self._land(cell_id, statuses, lambda: self.store.atomic_write(dest, lambda tmp: shutil.copy2(source, tmp)))

    def _land(self, cell_id: str, new: list[str], write: Any, replace_done: bool = False) -> Landing:
        """Under the cell's lock: `write()` when rows of statuses `new` may replace what is there
        (landing_rule); a cell done now keeps no checkpoints."""
        self.store.cells_dir.mkdir(parents=True, exist_ok=True)
        with exclusive(self.store.cells_dir / f".{cell_id}.lock"):
            old = self.store.statuses(cell_id)
            verdict = landing_rule(old, new, replace_done)
            if verdict is None:
                write()
        now = new if verdict is None else old
        if now and set(now) <= DONE_STATUSES:
            self.store.remove_parts(cell_id)
        return Landing(verdict is None, verdict or "")

    # -- checkpoints of a cell still running ------------------------------------------------

    def checkpoint(self, cell_id: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Keep rows of finished batches of a running cell, as one part file renamed into place.

        Another task that lands the same cell done removes its checkpoint folder, possibly while
        this one writes into it: then the folder is made again and the write tried once more,
        unless the cell is done by now (this task's rows would be refused at landing anyway)."""
        safe = redact_rows(rows, self.secrets)
        try:
            self.store.write_part(cell_id, name, safe)
        except FileNotFoundError:
            if not self.store.is_done(cell_id):
                self.store.write_part(cell_id, name, safe)

    def checkpointed(self, cell_id: str) -> list[dict[str, Any]]:
        """The rows a cell's checkpoints hold, in the order they were written."""
        return [row for name in self.store.parts(cell_id) for row in self.store.read_part(cell_id, name)]

    def partial(self) -> dict[str, int]:
        """Cells with checkpoints not yet replaced by a done cell file: rows kept so far, by cell id."""
        return self.store.part_rows()

    def drop_checkpoints(self, cell_id: str) -> None:
        """Forget a cell's checkpoints (--force redoes the cell from its start)."""
        self.store.remove_parts(cell_id)

    def join(self, other: ResultsFolder, allow_other_experiment: bool) -> None:
        """Take `other`'s experiments as current too (merge; the cell files carry their own records)."""
        theirs = other.manifest()

        def change(data: dict[str, Any]) -> None:
            mine = {e["fingerprint"] for e in data["experiments"]}
            new = [e for e in theirs["experiments"] if e["fingerprint"] not in mine]
            if new and data["experiments"] and not allow_other_experiment:
                raise HarnessError(
                    f"{other.root} holds experiment {new[0]['name']} ({new[0]['fingerprint']}), {self.root} holds "
                    f"{data['experiments'][0]['name']} ({data['experiments'][0]['fingerprint']}): they differ; "
                    "merge them only on purpose, with --allow-mixed experiment"
                )
            data["experiments"] += new

        self._update(change)

    # -- what the manifest says ------------------------------------------------------------

    def experiments(self) -> list[LoadedExperiment]:
        """The current experiments, rebuilt from their snapshots (not from the live files)."""
        out = []
        for entry in self.manifest()["experiments"]:
            out.append(load_snapshot(entry["snapshot"], Path(entry["base"]), self.manifest_path))
        return out

    def experiment(self) -> LoadedExperiment:
        """The one current experiment; an error when there is none or several (a mixed merge)."""
        found = self.experiments()
        if len(found) != 1:
            what = "no experiment" if not found else f"{len(found)} experiments (a merge of different ones)"
            raise HarnessError(f"{self.root}: the manifest holds {what}; name an experiment file instead")
        return found[0]

    def current_cells(self) -> list[Cell]:
        cells: dict[str, Cell] = {}
        for loaded in self.experiments():
            for cell in expand(loaded):
                cells.setdefault(cell.id, cell)
        return list(cells.values())

    def stale_ids(self, current: Iterable[str] | None = None) -> list[str]:
        """Cell files on disk that belong to no current experiment: the one definition of a stale cell.
        `current`: the current cell ids where the caller has them (default: the manifest's experiments')."""
        ids = {c.id for c in self.current_cells()} if current is None else set(current)
        return [p.stem for p in self.store.cell_files() if p.stem not in ids]


def _as_yaml(snapshot: dict[str, Any]) -> str:
    import yaml

    head = "# The experiment that fills this folder, with its prompts inline (a copy; the manifest is what counts).\n"
    return head + yaml.safe_dump(snapshot, sort_keys=False, allow_unicode=True)
