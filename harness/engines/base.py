"""The small interface every engine implements: load once, generate batches, close."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

from harness.core.log import Log

if TYPE_CHECKING:
    import numpy as np


class EngineOptions(BaseModel):
    """Base for per-engine options: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: options added after results existed: at their default they stay out of cell ids, so the
    #: cells of existing folders keep their ids (as later axes do)
    added_later: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def identity(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The options as cell ids hash them: those added later left out while at their default."""
        fields = cls.model_fields
        return {k: v for k, v in options.items()
                if not (k in cls.added_later and k in fields and v == fields[k].default)}


@dataclass(frozen=True)
class Honour:
    """The engine applies this axis's values (it may still refuse some values in `refusal`)."""

    note: str = ""


@dataclass(frozen=True)
class Ignore:
    """The engine would run some values without applying them: its non-default ones or, with `when`,
    those for which `when(value, engine options)` holds (the rest it honours). Such cells are refused
    when the experiment loads, since they would differ from the others only in their label. The one
    way an engine says it ignores a setting."""

    why: str
    when: Callable[[Any, dict[str, Any]], bool] | None = None

    def ignores(self, value: Any, options: dict[str, Any], default: Any) -> bool:
        return self.when(value, options) if self.when is not None else value != default


@dataclass(frozen=True)
class Refuse:
    """The engine cannot apply a non-default value: such cells land `unsupported`, saying why."""

    why: str


AxisSupport = Honour | Ignore | Refuse
HONOUR = Honour()


@dataclass
class Finding:
    """One fact doctor reports, and whether it is a problem for what was asked (None: information)."""

    what: str
    detail: str
    ok: bool | None = None
    fix: str = ""


def _on_off(value: Any) -> Any:
    return ("on" if value else "off") if isinstance(value, bool) else value


#: an engine option of auto / on / off, where YAML's on / off (read as true / false) mean what they say
AutoOnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class Unsupported(Exception):
    """The engine refuses a setting; cells become rows with status 'unsupported'."""


@dataclass(frozen=True)
class LoadSpec:
    """Everything that needs a fresh engine load (one engine process serves a group)."""

    engine: str
    model: str
    dtype: str
    gpu: str
    batch_invariant: bool
    options: dict[str, Any]
    #: tokens per prefill step ('auto': the engine's default)
    prefill_chunk: str = "auto"
    kv_cache_dtype: str = "auto"
    #: the prefix_cache axis is cold or warm: KV reuse between requests is enabled
    prefix_caching: bool = False
    #: KV cache of the load in tokens (0: the engine's own size): the kv_cache_tokens axis
    kv_cache_tokens: int = 0
    #: tokens drafted per step, speculative decoding (0: off): the draft_tokens axis
    draft_tokens: int = 0

    def label(self, others: list[LoadSpec] | None = None) -> str:
        """How logs and messages name this load, the one definition: engine and model, then what tells it
        apart from `others` (every field and engine option whose value differs among them: 'llamacpp /
        smollm2-135m dtype=f32 flash_attn=on'), or, with no others, every field off its plain value."""
        from harness.core.redaction import redact

        fields = [f.name for f in dataclasses.fields(LoadSpec) if f.name not in ("engine", "model", "options")]
        if others is None:
            shown = [f for f in fields if getattr(self, f) != _PLAIN.get(f, getattr(LoadSpec, f, None))]
            options: list[str] = []
        else:
            shown = [f for f in fields if len({getattr(o, f) for o in others}) > 1]
            same = [o for o in others if o.engine == self.engine]  # options are told apart within one engine
            keys = sorted({k for o in same for k in o.options})
            options = [k for k in keys if len({repr(redact(o.options.get(k), k)) for o in same}) > 1]
        extra = [f"{f}={getattr(self, f)}" for f in shown] + [f"{k}={redact(self.options.get(k), k)}" for k in options]
        return " ".join([f"{self.engine} / {self.model}"] + extra)


#: the plain values of the LoadSpec fields without a default (a label without others leaves them out)
_PLAIN: dict[str, Any] = {"dtype": "auto", "gpu": "any", "batch_invariant": False}


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    #: fillers are sent without a seed (the engine picks one), as a mixed batch of clients does
    unseeded_fillers: bool = False
    #: the batch is copies of one prompt, each a run of its own: every copy gets the cell's seed
    copies: bool = False

    def seed_for(self, position: int, target: int) -> int | None:
        """The target uses the cell's seed wherever it sits; fillers get seeds derived from it, or none."""
        if position == target or self.copies:
            return self.seed
        return None if self.unseeded_fillers else (self.seed + 7919 * (position + 1)) % (2**32 - 1)


@dataclass
class SequenceOutput:
    """What one sequence of a batch produced. Per-step lists align with token_ids."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    #: each token decoded on its own, so a report can show exactly where two outputs split
    token_texts: list[str] = field(default_factory=list)
    #: forced decoding only: per step, the token the engine would have picked itself (its argmax)
    argmax: list[int] = field(default_factory=list)


@dataclass
class BatchOutput:
    """Outputs for the batch members that were asked for, plus timings in seconds."""

    target: SequenceOutput
    prompt_tokens: int
    prefill_s: float | None  # None where the engine does not expose it
    ttft_s: float | None
    target_s: float
    wall_s: float
    batch_generated_tokens: int
    #: engine-specific facts about this generation (e.g. the server slot), stored as JSON
    detail: dict[str, Any] = field(default_factory=dict)
    #: prompt tokens of the target whose KV was reused from an earlier request, as the engine counts
    #: them (None where it does not say)
    cached_tokens: int | None = None
    #: every member's output in batch order (the target's included), filled only when asked for
    #: (`members=True`); the timings above are the batch's
    members: list[SequenceOutput] = field(default_factory=list)
    #: when each of the target's output tokens reached the caller, in seconds since the batch was sent
    #: (a step that delivers several tokens, as speculative decoding does, gives them one time); empty
    #: where the engine hands the output over only at the end
    token_times: list[float] = field(default_factory=list)
    #: times the engine's scheduler preempted the target (stopped it, freed its KV, recomputed it
    #: later), as the engine counts them; None where it does not say
    preemptions: int | None = None
    #: the same count summed over every request of the batch: a preempted batch-mate recomputed beside
    #: the target changes the target's batch shape too
    batch_preemptions: int | None = None
    #: speculative decoding: tokens drafted for the target, and how many of them the model accepted,
    #: as the engine counts them; None without speculation or where the engine does not say
    draft_proposed: int | None = None
    draft_accepted: int | None = None


def template_sha256(template: str | bytes | None) -> str:
    """Hash of a chat template as the engine applies it ('' for none), recorded in engine_info
    so that results made with another template are not compared by accident."""
    if not template:
        return ""
    import hashlib

    return hashlib.sha256(template if isinstance(template, bytes) else str(template).encode()).hexdigest()


#: prefix_cache axis values: no KV reuse / reuse on but nothing of this prompt served before /
#: the target prompt served just before, so its KV is reused
CACHE_MODES = ("off", "cold", "warm")

#: called once per step of the target generation: (step, logit vector, chosen token); entries an
#: engine does not expose are NaN
StepObserver = Callable[[int, "np.ndarray", int], None]


class Engine(ABC):
    """An inference engine held open for one group of cells.

    A new engine is one new module defining a subclass and `ENGINE = Subclass` (see
    harness.engines.registry). Besides loading and generating, the class says what the rest of the
    harness must know before any load: its options, what it does with every axis, what doctor
    probes and how to install it.
    """

    name: ClassVar[str]
    Options: ClassVar[type[EngineOptions]]
    #: every matrix axis by name: Honour, Ignore(why[, when]) or Refuse(why) of its non-default values. An
    #: axis the engine does not name refuses the engine's cells that set it (tests require all named)
    axes: ClassVar[dict[str, AxisSupport]] = {}
    #: how to get this engine, shown by doctor when it is missing
    install: ClassVar[str] = ""
    #: nothing of a load outlives close() (no helper process, no file left open): the worker may end
    #: at once after it instead of through the interpreter's teardown (a fifth of a second and more)
    exits_fast: ClassVar[bool] = False
    #: the package whose native libraries this engine loads in the worker's process; its GPU backend
    #: is preloaded when the process starts (harness.core.native_preload). None: nothing preloaded
    native_package: ClassVar[str | None] = None
    #: doctor rehearses a load of each of the experiment's models in a process shaped like a run's
    #: worker (harness.run.rehearsal): for engines that load in seconds
    rehearsed: ClassVar[bool] = False
    #: why a logit probe cannot run on this engine; None where it can (probe_scope says what it sees). Read
    #: per instance: a load may set its own where it refuses the probe (transformers' continuous batching)
    logit_probe_unavailable: str | None = "this engine does not expose full logit vectors"
    #: why `score` (harness.run.rescore) cannot run on this engine; None where it can
    score_unavailable: ClassVar[str | None] = ("re-scoring needs the log-probability of every given token from "
                                               "one prefill, which this engine does not hand out here "
                                               "(llamacpp and vllm do)")

    #: why this engine cannot replay a recorded output through its decode loop (`generate(...,
    #: force=tokens)`, harness.run.replay); None where it can
    replay_unavailable: ClassVar[str | None] = ("forced decoding feeds recorded tokens into the decode loop, which "
                                                "this engine does not run in this process (llamacpp does)")

    #: why `trace` (harness.run.locate: each op's output of one rebuilt forward pass) cannot run on this
    #: engine; None where it can
    trace_unavailable: ClassVar[str | None] = ("tracing each operation's output needs the model's modules or "
                                               "compute graph in this process (transformers and llamacpp do)")

    #: whether `trace` goes one level further down, `inside` a module (transformers: the torch ops a module
    #: calls); False where the first trace is every op already (llama.cpp's graph)
    trace_inside: ClassVar[bool] = False

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        """A reason this engine will not run `spec`, known before loading; None if it may."""
        return None

    @classmethod
    def replay_spec(cls, spec: LoadSpec) -> LoadSpec:
        """The load that replays runs of `spec` (harness.run.replay): `spec` itself, unless the
        engine needs something loaded for forced decoding (vLLM: its forcing logits processor)."""
        return spec

    @classmethod
    def restart_refusal(cls, spec: LoadSpec) -> str | None:
        """Why a new load of `spec` would not restart what computes (so `boots` > 1 would measure
        nothing across restarts); None where each load starts afresh."""
        return None

    @classmethod
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Facts about this engine on this machine, for doctor (versions, GPU support), found without
        risking the caller: a library that may crash is probed in a child process. {'error': why}
        when it cannot run here."""
        return {}

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        """The probe's facts in one line."""
        return ", ".join(f"{k} {v}" for k, v in facts.items()) or "nothing to probe"

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        """What doctor finds missing (ok=False) or worth saying for an experiment's `cells` of this
        engine, given its probe's facts; `wants_gpu`: some cell of the experiment may use a GPU;
        `base`: the experiment's folder (for relative model paths). Engines that load in seconds
        are also rehearsed by doctor (`rehearsed`: a load, a batch and a Parquet write in a process
        shaped like a run's worker), so that a crash shows in doctor, not an hour into a run."""
        return []

    @classmethod
    def crash_hint(cls, spec: LoadSpec, signal_name: str, before: str = "") -> str:
        """What to say when this engine's process died of `signal_name` (SIGILL, SIGSEGV, ...) with
        `spec`: the build, what to try. `before`: what the worker's log says was in the process before
        the engine loaded (harness.core.native_preload.before_engine_line), '' if unknown. Default: nothing."""
        return ""

    @classmethod
    def environment(cls, spec: LoadSpec) -> dict[str, str]:
        """Environment variables the engine's process needs, set before the engine is imported."""
        return {}

    @abstractmethod
    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        """Load the model; `base` is the experiment's folder, for relative model paths."""

    @abstractmethod
    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False,
    ) -> BatchOutput:
        """Run one batch together; return the output of prompts[target] in detail.

        `cache` is the prefix_cache mode (CACHE_MODES); an engine that cannot do one raises Unsupported.
        `observe` is given only to engines whose logit_probe_unavailable is None. With `members`,
        every member runs to its end and BatchOutput.members holds each one's output.
        """

    def warm_up(self, prompts: list[str], target: int, sampling: Sampling) -> None:
        """Run before a cell's timed batches, so that what the first use of this batch shape costs
        (allocations, graph capture, compilation) is not in any row's timing. Default: the batch
        itself, two tokens long; an engine with cheaper means overrides it."""
        from dataclasses import replace

        self.generate(prompts, target, replace(sampling, max_tokens=2))

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` alone (no template, no BOS) in this engine's tokenizer; None: no tokenizer."""
        return None

    def score(self, prompt: str, tokens: list[int]) -> list[float]:
        """The log-probability of each of `tokens` after `prompt` (templated as `generate` templates
        it) and the tokens before it, from one prefill, alone, without a cache (harness.run.rescore).
        Default: refused with `score_unavailable`."""
        raise Unsupported(f"{self.name}: {self.score_unavailable}")

    def trace(self, prompts: list[str], target: int, sampling: Sampling, forced: list[int], step: int,
              record: Callable[[str, str, Any], None], inside: str | None = None) -> Any:
        """Rebuild this batch's forward pass at decode step `step` (0: the prefill) exactly as generate ran
        it, the target fed `forced` (its recorded tokens), calling `record(name, op, values)` with each
        op's output on the target's own elements in the order the pass runs them (`inside` a named part:
        the ops that part runs); return the target's log-probabilities at that step (a float32 vector).
        Default: refused with `trace_unavailable`."""
        raise Unsupported(f"{self.name}: {self.trace_unavailable}")

    def probe_scope(self) -> str:
        """What a logit probe sees on this engine, for the rows' probe_reference column."""
        return "full logit vectors"

    def generate_observed(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver, cache: str = "off"
    ) -> BatchOutput:
        """Like generate, calling `observe` with the target's logits at every step."""
        if self.logit_probe_unavailable is not None:
            raise Unsupported(self.logit_probe_unavailable)
        return self.generate(prompts, target, sampling, observe, cache)

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Versions and settings actually in force, recorded in every row."""

    def in_force(self) -> dict[str, Any]:
        """What this load really runs with, as the engine itself reports it (keys of
        harness.run.enforced.IN_FORCE; a key left out is unknown). A cell whose settings it
        contradicts fails. Default: nothing known."""
        return {}

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
