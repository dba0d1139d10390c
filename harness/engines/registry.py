"""Which engines exist: the modules of this package that define `ENGINE`, and the modules other
installed packages name in the `harness.engines` entry-point group (a plugin is one file plus its
package metadata). Engine modules import their heavy libraries only when an engine loads, so finding
them all is cheap.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from importlib import metadata

from harness.engines.base import Engine, EngineOptions

ENTRY_POINT_GROUP = "harness.engines"
#: modules of this package that are not engines
_NOT_ENGINES = {"base", "registry"}


class EngineNotFound(KeyError):
    """An engine name no module declares."""

    def __str__(self) -> str:
        return f"unknown engine '{self.args[0]}'; allowed: {', '.join(engine_names())}"


def _engine_of(module_name: str, where: str) -> type[Engine]:
    module = importlib.import_module(module_name)
    cls = getattr(module, "ENGINE", None)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"{where}: module {module_name} defines no ENGINE = <an Engine subclass>")
    return cls


def builtin_modules() -> list[str]:
    """The modules of this package that may define an engine (plugins come from entry points)."""
    package = importlib.import_module(__package__)
    return [f"{__package__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
            if not (info.ispkg or info.name.startswith("_") or info.name in _NOT_ENGINES)]


@cache
def _engines() -> dict[str, type[Engine]]:
    """Every engine by name: built-in ones, then plugins (which may not take a built-in's name)."""
    found: dict[str, type[Engine]] = {}
    for name in builtin_modules():
        module = importlib.import_module(name)
        cls = getattr(module, "ENGINE", None)
        if isinstance(cls, type) and issubclass(cls, Engine):
            found[cls.name] = cls
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name} = {point.value} ({ENTRY_POINT_GROUP})"
        cls = _engine_of(point.value.partition(":")[0], where)
        if cls.name in found and found[cls.name] is not cls:
            raise TypeError(f"{where}: engine name '{cls.name}' is taken by {found[cls.name].__module__}")
        found[cls.name] = cls
    return dict(sorted(found.items()))


def engine_names() -> tuple[str, ...]:
    """Every engine's name, in a stable order."""
    return tuple(_engines())


def engine_class(name: str) -> type[Engine]:
    try:
        return _engines()[name]
    except KeyError:
        raise EngineNotFound(name) from None


def options_model(name: str) -> type[EngineOptions]:
    return engine_class(name).Options
