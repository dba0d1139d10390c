"""The small interface every engine implements: load once, generate batches, close."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import numpy as np


class EngineOptions(BaseModel):
    """Base for per-engine options: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int

    def seed_for(self, position: int, target: int) -> int:
        """The target uses the cell's seed wherever it sits; fillers get seeds derived from it."""
        return self.seed if position == target else (self.seed + 7919 * (position + 1)) % (2**32 - 1)


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


def template_sha256(template: str | bytes | None) -> str:
    """Hash of a chat template as the engine applies it ('' for none), recorded in engine_info
    so that results made with another template are not compared by accident."""
    if not template:
        return ""
    import hashlib

    return hashlib.sha256(template if isinstance(template, bytes) else str(template).encode()).hexdigest()


Log = Callable[[str], None]
#: called once per step of the target generation: (step, logit vector, chosen token); entries an
#: engine does not expose are NaN
StepObserver = Callable[[int, "np.ndarray", int], None]


class Engine(ABC):
    """An inference engine held open for one group of cells.

    A new engine is one new module defining a subclass and `ENGINE = Subclass`.
    """

    name: ClassVar[str]
    Options: ClassVar[type[EngineOptions]]
    #: why a logit probe cannot run on this engine; None where it can (probe_scope says what it sees)
    logit_probe_unavailable: ClassVar[str | None] = "this engine does not expose full logit vectors"

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        """A reason this engine will not run `spec`, known before loading; None if it may."""
        return None

    @classmethod
    def environment(cls, spec: LoadSpec) -> dict[str, str]:
        """Environment variables the engine's process needs, set before the engine is imported."""
        return {}

    @abstractmethod
    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        """Load the model; `base` is the experiment's folder, for relative model paths."""

    @abstractmethod
    def generate(self, prompts: list[str], target: int, sampling: Sampling) -> BatchOutput:
        """Run one batch together; return the output of prompts[target] in detail."""

    def probe_scope(self) -> str:
        """What a logit probe sees on this engine, for the rows' probe_reference column."""
        return "full logit vectors"

    def generate_observed(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver
    ) -> BatchOutput:
        """Like generate, calling `observe` with the target's logits at every step.

        Engines that can (logit_probe_unavailable is None) take `observe` as generate's fourth argument.
        """
        if self.logit_probe_unavailable is not None:
            raise Unsupported(self.logit_probe_unavailable)
        return self.generate(prompts, target, sampling, observe)  # type: ignore[call-arg]

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Versions and settings actually in force, recorded in every row."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
