"""Engine registry: a name maps to a module that defines `ENGINE`; imported only when used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.engines.base import Engine, EngineOptions

_MODULES = {
    "llamacpp": "harness.engines.llamacpp",
    "vllm": "harness.engines.vllm",
    "llama-server": "harness.engines.llama_server",
    "openai": "harness.engines.openai",
}
ENGINE_NAMES: tuple[str, ...] = tuple(_MODULES)


def engine_class(name: str) -> type[Engine]:
    """The engine class; the module must not import its heavy library at import time."""
    return importlib.import_module(_MODULES[name]).ENGINE


def options_model(name: str) -> type[EngineOptions]:
    return engine_class(name).Options
