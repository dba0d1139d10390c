"""The first engine load of a `harness run`, started ahead in the spare worker (harness.run.spare),
while the parent still imports pyarrow, adopts the experiment into the folder and collects provenance.

A load is started ahead only where the run is sure to launch it first: a fresh folder (no cell of the
group landed yet, so none is done), this interpreter, a group the engine does not refuse as a whole,
one boot (`boots` > 1 starts a fresh worker per boot anyway), an engine the spare serves (on a GPU build
of llama.cpp it preloaded that build's backend: harness.run.spare.serves), and no GPU to choose (`gpu: cpu` or
`any`: which GPU a named type gets needs the node's GPU list, and no GPU memory is held on a guess).
The runner still compares the launch it makes with the one started ahead (`Ahead.key`,
SpareWorker.take) and ends the spare where they differ, so a wrong guess costs time, never a result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engines.base import LoadSpec
from harness.engines.parts.server_process import LOG_DIR_ENV
from harness.engines.registry import engine_class
from harness.experiment.matrix import Cell, Group, refused_setting
from harness.experiment.schema import CURRENT_ENVIRONMENT, LoadedExperiment
from harness.results import layout
from harness.run.enforced import device_environment
from harness.run.spare import serves


@dataclass(frozen=True)
class Ahead:
    """A load to start before the work order: what the worker sets (env, log) and loads (spec, from base)."""

    env: dict[str, str]
    spec: LoadSpec
    log: str
    base: Path
    #: how the log names the load (harness.engines.base.LoadSpec.label)
    label: str

    @property
    def key(self) -> tuple[Any, ...]:
        return launch_key(self.env, self.spec, self.log, self.base)


def launch_key(env: dict[str, str], spec: LoadSpec, log: str, base: Path) -> tuple[Any, ...]:
    """What a launch must share with the load started ahead for the spare to serve it."""
    return (sorted(env.items()), spec, log, str(base))


def group_environment(spec: LoadSpec, gpus: list[dict[str, str]], log: Path) -> dict[str, str]:
    """The environment a group's worker runs under: the engine's variables, the GPUs it may see, and
    where the servers it starts write their logs."""
    pinned = device_environment(spec.gpu, gpus, int(spec.options.get("tensor_parallel_size") or 1))
    return engine_class(spec.engine).environment(spec) | pinned | {LOG_DIR_ENV: str(log.parent.resolve())}


def first_load(loaded: LoadedExperiment, chosen: list[tuple[Group, list[Cell]]], out: Path) -> Ahead | None:
    """The load this run will surely launch first, or None where that is not sure (see the module's doc)."""
    if not chosen:
        return None
    grp, cells = chosen[0]
    spec = grp.spec
    if spec.gpu not in ("cpu", "any") or any(layout.cell_file(out, c.id).exists() for c in cells):
        return None
    if any(c["environment"] != CURRENT_ENVIRONMENT for c in cells) or all(refused_setting(c) for c in cells):
        return None
    cls = engine_class(spec.engine)
    if loaded.experiment.boots > 1 or cls.refusal(spec) is not None or not serves(cls.native_package):
        return None
    log = layout.group_log(out, grp.id)
    return Ahead(group_environment(spec, [], log), spec, str(log), loaded.base,
                 spec.label([g.spec for g, _ in chosen]))
