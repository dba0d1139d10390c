"""Matrix axes -> cells with stable ids -> groups of cells that share one engine load."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from harness.config import AXES, LoadedExperiment, Matrix
from harness.engines.base import LoadSpec, Sampling
from harness.errors import ConfigError

#: Axes that need a new engine load when they change (the rest vary inside one engine).
LOAD_AXES: tuple[str, ...] = ("engine", "model", "dtype", "gpu", "batch_invariant")


def _digest(payload: dict[str, Any], size: int = 12) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:size]


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: every prompt is run `repeats` times with these settings."""

    id: str
    group_id: str
    settings: tuple[tuple[str, Any], ...]
    engine_options: tuple[tuple[str, Any], ...]

    def __getitem__(self, axis: str) -> Any:
        return dict(self.settings)[axis]

    @property
    def as_dict(self) -> dict[str, Any]:
        return dict(self.settings)

    def load_spec(self) -> LoadSpec:
        s = self.as_dict
        return LoadSpec(
            engine=s["engine"],
            model=s["model"],
            dtype=s["dtype"],
            gpu=s["gpu"],
            batch_invariant=s["batch_invariant"],
            options=dict(self.engine_options),
        )

    def sampling(self, max_tokens: int) -> Sampling:
        s = self.as_dict
        return Sampling(s["temperature"], s["top_p"], s["top_k"], s["seed"], max_tokens)


@dataclass(frozen=True)
class Group:
    """Cells served by one engine load, in the order they run."""

    id: str
    spec: LoadSpec
    cells: tuple[Cell, ...]


def _matches(settings: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(settings[k] == v for k, v in entry.items())


def _include_settings(matrix: Matrix, entry: dict[str, Any], index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    defaults = Matrix.model_fields
    for axis in AXES:
        if axis in entry:
            out[axis] = entry[axis]
            continue
        values = getattr(matrix, axis)
        if len(values) == 1:
            out[axis] = values[0]
        elif defaults[axis].default is not None and axis != "model":
            out[axis] = defaults[axis].default[0]
        else:
            raise ConfigError(
                f"include[{index}]: give '{axis}': the matrix has several values for it "
                f"({', '.join(map(str, values))})"
            )
    return out


def expand(loaded: LoadedExperiment) -> list[Cell]:
    """All cells, in run order (grouped by engine load), each once."""
    exp = loaded.experiment
    matrix = exp.matrix
    combos = [dict(zip(AXES, values)) for values in itertools.product(*(getattr(matrix, a) for a in AXES))]
    combos = [c for c in combos if not any(_matches(c, e) for e in loaded.exclude)]
    combos += [_include_settings(matrix, e, i) for i, e in enumerate(loaded.include)]

    common = {
        "max_tokens": exp.max_tokens,
        "repeats": exp.repeats,
        "filler_seed": exp.filler_seed,
        "prompts": loaded.prompt_set.fingerprint(),
    }
    if exp.probe_logits:  # only when on, so that ids of existing results stay valid
        common["probe_logits"] = True
    cells: dict[str, Cell] = {}
    for settings in combos:
        options = loaded.engine_options.get(settings["engine"], {})
        group_key = {a: settings[a] for a in LOAD_AXES} | {"options": options}
        cell_id = _digest(settings | common | {"options": options})
        cells.setdefault(
            cell_id,
            Cell(
                id=cell_id,
                group_id=_digest(group_key, 8),
                settings=tuple((a, settings[a]) for a in AXES),
                engine_options=tuple(sorted(options.items())),
            ),
        )
    if not cells:
        raise ConfigError(f"{loaded.path}: exclude removes every cell of the matrix; nothing to run")
    return list(cells.values())


def group(cells: list[Cell]) -> list[Group]:
    """Cells sharing a load spec, groups in first-seen order, batch sizes ascending inside."""
    order: dict[str, list[Cell]] = {}
    for cell in cells:
        order.setdefault(cell.group_id, []).append(cell)
    groups = []
    for group_id, members in order.items():
        members = sorted(members, key=lambda c: (c["batch_size"], c["seed"], c["temperature"]))
        groups.append(Group(group_id, members[0].load_spec(), tuple(members)))
    return groups
