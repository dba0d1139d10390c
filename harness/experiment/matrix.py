"""Matrix axes -> cells with stable ids -> groups of cells that share one engine load."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from harness.core.errors import ConfigError
from harness.core.redaction import redact
from harness.engines.base import Ignore, LoadSpec, Refuse, Sampling
from harness.engines.registry import engine_class, options_model
from harness.experiment import yamlsrc
from harness.experiment.axes import AXES, AXES_DECLARED, BY_NAME, LATER_AXES_DEFAULTS, LATER_GROUP_DEFAULTS, LOAD_AXES
from harness.experiment.schema import LoadedExperiment, Matrix, option_axis, option_value


def digest(payload: dict[str, Any], size: int = 12) -> str:
    """A short, stable hash of plain data (key order does not matter): cell, group, settings and run ids."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:size]


@dataclass(frozen=True)
class Cell:
    """One point of the matrix: every prompt is run `repeats` times with these settings."""

    id: str
    group_id: str
    settings: tuple[tuple[str, Any], ...]
    engine_options: tuple[tuple[str, Any], ...]
    #: the id without the prompt set and repeat count: what one run's output depends on beside its
    #: batch (harness.run.reuse); cells of two versions of an experiment with equal settings share it
    settings_id: str = ""

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
            prefill_chunk=s["prefill_chunk"],
            kv_cache_dtype=s["kv_cache_dtype"],
            prefix_caching=s["prefix_cache"] != "off",
            kv_cache_tokens=s["kv_cache_tokens"],
            draft_tokens=s["draft_tokens"],
        )

    def sampling(self, max_tokens: int, unseeded_fillers: bool = False, copies: bool = False) -> Sampling:
        s = self.as_dict
        return Sampling(s["temperature"], s["top_p"], s["top_k"], s["seed"], max_tokens, unseeded_fillers, copies)


@dataclass(frozen=True)
class Group:
    """Cells served by one engine load, in the order they run."""

    id: str
    spec: LoadSpec
    cells: tuple[Cell, ...]


def _matches(settings: dict[str, Any], entry: dict[str, Any]) -> bool:
    """Whether an include/exclude entry names these settings, as written or as stored (redacted: an
    experiment rebuilt from its snapshot holds both its matrix and its entries without credentials)."""
    return all(settings[k] == v or redact(settings[k], k) == redact(v, k) for k, v in entry.items())


def _include_settings(matrix: Matrix, options: dict[str, list[str]], entry: dict[str, Any], index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    defaults = Matrix.model_fields
    for axis in AXES + tuple(options):
        if axis in entry:
            out[axis] = entry[axis]
            continue
        values = options[axis] if axis in options else getattr(matrix, axis)
        if len(values) == 1:
            out[axis] = values[0]
        elif axis in defaults and defaults[axis].default is not None and axis != "model":
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
    swept = loaded.option_axes
    names = AXES + tuple(swept)
    lists = [getattr(matrix, a) for a in AXES] + [swept[a] for a in swept]
    combos = [dict(zip(names, values)) for values in itertools.product(*lists)]
    combos = [c for c in combos if not any(_matches(c, e) for e in loaded.exclude)]
    combos += [_include_settings(matrix, swept, e, i) for i, e in enumerate(loaded.include)]

    common = {
        "max_tokens": exp.max_tokens,
        "repeats": exp.repeats,
        "filler_seed": exp.filler_seed,
        "prompts": loaded.prompt_set.fingerprint(),
    }
    for flag in ("probe_logits", "probe_prefill", "unseeded_fillers", "seed_control"):
        if getattr(exp, flag):  # only when on, so that ids of existing results stay valid
            common[flag] = True
    if exp.batch_fill != "fillers":
        common["batch_fill"] = exp.batch_fill
    cells: dict[str, Cell] = {}
    for settings in combos:
        options = dict(loaded.engine_options.get(settings["engine"], {}))
        for axis in swept:  # a swept option is its engine's; other engines' cells hold None there
            engine, option = option_axis(axis)  # type: ignore[misc]
            if engine == settings["engine"]:
                options[option] = option_value(axis, settings[axis])[0]
                # the engine gets the real value; the cell's settings are stored (rows, status, ids)
                settings[axis] = redact(settings[axis], option)
            else:
                settings[axis] = None
        # ids hash what may be stored (a credential is never part of one), without options added
        # later that sit at their default (older results keep their ids)
        stored = options_model(settings["engine"]).identity(redact(options))
        group_key = {a: settings[a] for a in LOAD_AXES
                     if LATER_GROUP_DEFAULTS.get(a, object()) != settings[a]} | {"options": stored,
                                                           "prefix_caching": settings["prefix_cache"] != "off"}
        # axes added later enter the id only away from their default: older results keep their ids
        identity = {k: v for k, v in settings.items() if LATER_AXES_DEFAULTS.get(k, object()) != v}
        if settings["context_tokens"] > 0:
            identity["context"] = exp.context.model_dump()
        cell_id = digest(identity | common | {"options": stored})
        per_run = {k: v for k, v in common.items() if k not in ("prompts", "repeats")}
        cells.setdefault(
            cell_id,
            Cell(
                id=cell_id,
                group_id=digest(group_key, 8),
                settings=tuple((a, settings[a]) for a in names),
                engine_options=tuple(sorted(options.items())),
                settings_id=digest(identity | per_run | {"options": stored}),
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
        members = sorted(members, key=lambda c: (c["batch_size"], c["context_tokens"], c["seed"], c["temperature"]))
        groups.append(Group(group_id, members[0].load_spec(), tuple(members)))
    return groups


def refuse_ignored(loaded: LoadedExperiment, cells: list[Cell]) -> None:
    """Refuse a cell whose engine would run it without applying one of its settings (Engine.axes: Ignore):
    it would differ from its neighbours only in its label, and look like a measurement of that setting.
    Checked when an experiment file is planned, run or submitted (a folder's snapshot ran already)."""
    if loaded.path.suffix not in (".yaml", ".yml"):
        return
    seen: set[tuple[str, str, str]] = set()
    for cell in cells:
        engine = cell["engine"]
        for axis, value in cell.as_dict.items():
            if (engine, axis, str(value)) in seen:
                continue
            seen.add((engine, axis, str(value)))
            cls, axis_of = engine_class(engine), BY_NAME.get(axis)
            support = cls.axes.get(axis)
            options = loaded.engine_options.get(engine, {})
            if isinstance(support, Ignore) and support.ignores(value, options, axis_of.default if axis_of else value):
                why = support.why
                source = yamlsrc.load(loaded.path)  # read again only to name the line
                loc = ("matrix", axis) if axis in source.data.get("matrix", {}) else ("include",)
                raise ConfigError(f"{source.where(loc)}: {axis} {value} with engine {engine}: {why}; such cells "
                                  "would differ from the others only in their label (exclude them, or drop the value)")


def refused_setting(cell: Cell) -> str | None:
    """Why the cell's engine will not apply one of its settings, as the engine class declares it
    (`Engine.axes`: Refuse), or because it declares nothing for that axis: a new axis an engine has not
    been taught about refuses the cells that set it, instead of running them under a label only."""
    cls = engine_class(cell["engine"])
    for axis in AXES_DECLARED:
        value = cell[axis.name]
        if not axis.required and value == axis.default:
            continue
        support = cls.axes.get(axis.name)
        if support is None:
            return (f"engine {cls.name} does not declare what it does with {axis.name} ({cls.__name__}.axes), "
                    f"so its cells with {axis.name} {value} are not run")
        if isinstance(support, Refuse):
            return support.why
    return None
