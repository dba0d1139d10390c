"""Every matrix axis, declared once: its name, type, default, allowed values, whether it is fixed per
engine load, and how it is shown.

The experiment's matrix model (config.Matrix), cell ids and load groups (matrix), the row columns
of the settings (harness.results.schema), the summary keys, `--where` / `--reference` parsing, the tables'
short column names, and the report's series, filters and labels all derive from `AXES_DECLARED`.
Adding an axis is one `Axis` here, plus the engines that honour it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from harness.engines.registry import engine_names

#: dtype spellings an experiment may use, and the canonical name each stands for
DTYPE_ALIASES = {
    "auto": "auto", "f32": "f32", "float32": "f32", "fp32": "f32", "f16": "f16", "float16": "f16", "fp16": "f16",
    "half": "f16", "bf16": "bf16", "bfloat16": "bf16",
}
PREFIX_CACHE_MODES = ("off", "cold", "warm")
KV_CACHE_DTYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q4_0", "fp8")

REQUIRED = object()  # the default of an axis an experiment must give


def _engine(value: str) -> str:
    if value not in engine_names():
        raise ValueError(f"unknown engine '{value}'; allowed: {', '.join(engine_names())}")
    return value


def _dtype(value: str) -> str:
    canonical = DTYPE_ALIASES.get(str(value).lower())
    if canonical is None:
        raise ValueError(f"unknown dtype '{value}'; allowed: {', '.join(sorted(set(DTYPE_ALIASES.values())))}")
    return canonical


def _name(value: str) -> str:
    if not str(value).strip():
        raise ValueError("empty name; give a model name or path / a GPU type, 'any' or 'cpu'")
    return value


def _chunk(value: Any) -> str:
    text = str(value).strip().lower()
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise ValueError(f"prefill_chunk '{value}': allowed: auto (the engine's default) or tokens per "
                         "prefill step, a whole number >= 1")
    return text if text == "auto" else str(int(text))


@dataclass(frozen=True)
class Axis:
    """One axis of the matrix: what its values may be, and how it is stored and shown."""

    name: str
    type: type  # of one value: str, int, float or bool
    arrow: str  # its row column's type, as pyarrow names it ("string", "int32", ...): no pyarrow import here
    default: Any = REQUIRED
    #: fixed for an engine load (cells that differ in it cannot share a loaded engine)
    per_load: bool = False
    #: added after results existed: a cell at the default keeps the id it had before the axis
    later: bool = False
    #: a per-load axis added after load groups were named: at the default it stays out of the group
    #: id too, so that a group keeps the id its rows hold
    later_group: bool = False
    #: column name in tables and series labels ("" = the name itself)
    short: str = ""
    #: numbers: the test of a value, and what it allows in words
    within: Callable[[Any], bool] | None = None
    allowed: str = ""
    #: named choices: the values allowed (YAML's yes/no read as on/off)
    choices: tuple[str, ...] = ()
    #: any other check of one typed value; returns its canonical form or raises ValueError
    check: Callable[[Any], Any] | None = None
    #: canonical form of one raw value, before it is typed
    before: Callable[[Any], Any] | None = None
    #: series labels show the value alone, not "short=value"
    plain: bool = False
    #: series labels of a true/false axis: (false, true); default "short=off" / "short=on"
    flags: tuple[str, str] | None = None
    #: says only what else shared the target's batch (how many, how long): what a batch-invariant mode
    #: promises not to matter, so the only axes across which the mode is judged (analysis.guarantees)
    composition: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def numeric(self) -> bool:
        return self.type in (int, float)

    @property
    def shown(self) -> str:
        return self.short or self.name

    def raw(self, value: Any) -> Any:
        """One value as written, made ready to be typed; a true/false where a number belongs (YAML reads
        yes/no that way, and they are ints to Python) or an unknown choice raises ValueError."""
        if self.numeric and isinstance(value, bool):
            raise ValueError(f"{self.name} {str(value).lower()}: a true/false value where a number belongs; "
                             f"allowed: {self.allowed}")
        if self.choices:
            text = ("on" if value else "off") if isinstance(value, bool) else str(value).lower()
            if text not in self.choices:
                raise ValueError(f"{self.name} '{value}' is not known; allowed: {', '.join(self.choices)}")
            return text
        return self.before(value) if self.before else value

    def typed(self, value: Any) -> Any:
        """One typed value checked and in canonical form; raises ValueError naming what is allowed."""
        if self.within is not None and not self.within(value):
            raise ValueError(f"{self.name} {value} is out of range; allowed: {self.allowed}")
        return self.check(value) if self.check else value

    def describe(self, value: Any) -> str:
        """One value as a series label shows it."""
        if self.type is bool:
            off, on = self.flags or (f"{self.shown}=off", f"{self.shown}=on")
            return on if value else off
        return str(value) if self.plain else f"{self.shown}={value}"


AXES_DECLARED: tuple[Axis, ...] = (
    Axis("model", str, "string", per_load=True, check=_name, plain=True),
    Axis("engine", str, "string", "llamacpp", per_load=True, check=_engine, plain=True),
    Axis("dtype", str, "string", "auto", per_load=True, check=_dtype, plain=True),
    Axis("gpu", str, "string", "any", per_load=True, check=_name, plain=True),
    Axis("batch_invariant", bool, "bool_", False, per_load=True, short="b-inv", flags=("default", "batch-invariant")),
    Axis("batch_size", int, "int32", 1, short="batch", within=lambda v: 1 <= v <= 1024, allowed="1 to 1024",
         composition=True),
    Axis("seed", int, "int64", 0, within=lambda v: 0 <= v < 2**32, allowed="0 to 2**32-1"),
    Axis("temperature", float, "float64", 0.0, short="temp", within=lambda v: v >= 0, allowed="0 (greedy) or more"),
    Axis("top_p", float, "float64", 1.0, within=lambda v: 0 < v <= 1, allowed="0 < top_p <= 1"),
    Axis("top_k", int, "int32", 0, within=lambda v: v >= 0, allowed="0 (off) or more"),
    Axis("prefix_cache", str, "string", "off", later=True, short="pcache", choices=PREFIX_CACHE_MODES),
    Axis("context_tokens", int, "int32", 0, later=True, short="ctx", within=lambda v: 0 <= v <= 1_048_576,
         allowed="0 (no shared context) to 1048576"),
    Axis("prefill_chunk", str, "string", "auto", per_load=True, later=True, short="chunk", before=_chunk),
    Axis("kv_cache_dtype", str, "string", "auto", per_load=True, later=True, short="kv", choices=KV_CACHE_DTYPES),
    #: tokens of each batch-mate's prompt (harness.experiment.context.padded): kernels pick their tiling by the
    #: tokens of the whole batch, so the same target may split beside long requests and not short ones
    Axis("filler_tokens", int, "int32", 0, later=True, short="mates", within=lambda v: 0 <= v <= 1_048_576,
         allowed="0 (the fillers as written) to 1048576", composition=True),
    #: the Python interpreter a cell's worker runs under: 'current' (the harness's own) or one the
    #: experiment's `environments:` names (another venv, with another engine version)
    Axis("environment", str, "string", "current", per_load=True, later=True, later_group=True, short="env",
         check=_name, plain=True),
    #: KV cache of the whole load, in tokens (0: the engine's own size): a cache too small for the batch in
    #: flight makes a scheduler that can preempt (vLLM's) stop requests and recompute them later, in another
    #: batch shape, as a server under load does
    Axis("kv_cache_tokens", int, "int32", 0, per_load=True, later=True, later_group=True, short="kvcap",
         within=lambda v: v == 0 or 16 <= v <= 16_777_216, allowed="0 (the engine's own size) or 16 to 16777216 tokens"),
    #: speculative decoding: tokens drafted per step and verified by the model in one forward pass (0: off); the
    #: drafter is an engine option (llama-server's draft_model, vLLM's speculative_method)
    Axis("draft_tokens", int, "int32", 0, per_load=True, later=True, later_group=True, short="draft",
         within=lambda v: 0 <= v <= 64, allowed="0 (no speculative decoding) to 64 tokens drafted per step"),
)

BY_NAME: dict[str, Axis] = {a.name: a for a in AXES_DECLARED}
#: the axes in display order; row columns holding settings carry exactly these names
AXES: tuple[str, ...] = tuple(BY_NAME)
#: the axes fixed per engine load
LOAD_AXES: tuple[str, ...] = tuple(a.name for a in AXES_DECLARED if a.per_load)
#: axes added after results existed, with the default that keeps old cell ids
LATER_AXES_DEFAULTS: dict[str, Any] = {a.name: a.default for a in AXES_DECLARED if a.later}
#: per-load axes that, at these defaults, stay out of group ids
LATER_GROUP_DEFAULTS: dict[str, Any] = {a.name: a.default for a in AXES_DECLARED if a.later_group}
#: the axes that say only what shared the target's batch (Axis.composition)
COMPOSITION_AXES: tuple[str, ...] = tuple(a.name for a in AXES_DECLARED if a.composition)
#: short column names in tables
SHORT: dict[str, str] = {a.name: a.short for a in AXES_DECLARED if a.short}


def shown_name(column: str) -> str:
    """A setting column's name in a table or label: an axis's short name, an option column as it is."""
    axis = BY_NAME.get(column)
    return axis.shown if axis else column


def describe(column: str, value: Any) -> str:
    """One setting as a series label shows it ('f32', 'batch-invariant', 'pcache=warm', 'llamacpp.n_batch=64')."""
    axis = BY_NAME.get(column)
    return axis.describe(value) if axis else f"{column}={value}"
