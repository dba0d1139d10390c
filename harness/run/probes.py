"""Logit probes: how far a generation's full logit vectors moved from a lone run of the same prompt.

The reference is the same prompt with the same sampling, decoded as a batch of one in the same
engine load (cached per prompt). At each step the two logit vectors are compared while the two
generations still share their prefix (after they split, the inputs differ and a comparison says
nothing about the batch). Only counts and the largest difference are kept, never the vectors.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.engines.base import BatchOutput, Engine, Sampling

#: a top-1 minus top-2 logit margin below this counts as a near tie
LOW_MARGIN = 0.1
REFERENCE = "same prompt decoded alone (batch of 1) in the same engine load"
#: reference traces kept in memory; one is steps x vocabulary float32 values
CACHE_BYTES = 1 << 30

@dataclass
class Trace:
    """What a reference generation chose and saw: one token and one logit vector per step."""

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)

    def __call__(self, step: int, logits: np.ndarray, token: int) -> None:
        self.tokens.append(token)
        self.logits.append(np.array(logits, dtype=np.float32, copy=True))

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.logits)


@dataclass
class Comparer:
    """Compares each step's logits with the reference's while the prefixes are shared."""

    reference: Trace
    steps: int = 0
    steps_differed: int = 0
    first_diff_step: int | None = None
    compared: int = 0
    differed: int = 0
    max_abs_diff: float = 0.0
    shared: bool = True

    def __call__(self, step: int, logits: np.ndarray, token: int) -> None:
        ref = self.reference
        if self.shared and step < len(ref.logits):
            expected = ref.logits[step]
            # NaN marks a value the engine did not expose (vLLM: outside its top-k). A value
            # exposed on one side only moved into or out of the top-k: it counts as moved.
            seen, seen_ref = ~np.isnan(logits), ~np.isnan(expected)
            both = seen & seen_ref
            unequal = both & (logits != expected)
            moved = int(np.count_nonzero(unequal)) + int(np.count_nonzero(seen ^ seen_ref))
            self.steps += 1
            self.compared += int(np.count_nonzero(seen | seen_ref))
            self.differed += moved
            if moved:
                self.steps_differed += 1
                if self.first_diff_step is None:
                    self.first_diff_step = step
                if unequal.any():
                    self.max_abs_diff = max(self.max_abs_diff, float(np.abs(logits - expected)[unequal].max()))
        # The next step's input is this step's token: the prefix stays shared only if it matches.
        if step >= len(ref.tokens) or token != ref.tokens[step]:
            self.shared = False

    def columns(self, scope: str) -> dict[str, Any]:
        return {
            "probe_reference": f"{REFERENCE}; {scope}",
            "probe_steps": self.steps,
            "probe_steps_differed": self.steps_differed,
            "probe_first_diff_step": self.first_diff_step,
            "probe_logits_compared": self.compared,
            "probe_logits_differed": self.differed,
            "probe_max_abs_diff": self.max_abs_diff,
        }


def low_margin_fraction(margins: list[float]) -> float | None:
    """Share of steps whose top-1 minus top-2 margin was below LOW_MARGIN (near ties)."""
    known = [m for m in margins if m is not None and not math.isnan(m)]
    return sum(m < LOW_MARGIN for m in known) / len(known) if known else None


def prefill_columns(decoded: Trace, prefilled: np.ndarray) -> dict[str, Any]:
    """Each decode step's logits against the same position's logits from one prefill pass.

    Both see the same tokens (the generation's own), so any difference is the computation's:
    one token per step against all positions at once.
    """
    steps = min(len(decoded.logits), len(prefilled))
    differed, first, largest = 0, None, 0.0
    kl = []
    for step in range(steps):
        a, b = decoded.logits[step], prefilled[step]
        unequal = a != b
        kl.append(step_kl(a, b) if unequal.any() else 0.0)
        if unequal.any():
            differed += 1
            first = step if first is None else first
            largest = max(largest, float(np.abs(a - b)[unequal].max()))
    return {"prefill_probe_steps": steps, "prefill_probe_steps_differed": differed,
            "prefill_probe_first_diff_step": first, "prefill_probe_max_abs_diff": largest,
            "prefill_probe_kl_mean": float(np.mean(kl)) if kl else None,
            "prefill_probe_kl_max": float(np.max(kl)) if kl else None}


def step_kl(decode: np.ndarray, prefill: np.ndarray) -> float:
    """KL(decode || prefill) of one step's two full distributions (softmax of each logit vector), in
    nats: the exact figure that re-scoring from stored rows can only estimate (harness.run.rescore)."""
    p = decode.astype(np.float64) - decode.max()
    q = prefill.astype(np.float64) - prefill.max()
    log_p = p - np.log(np.exp(p).sum())
    log_q = q - np.log(np.exp(q).sum())
    return max(float(np.sum(np.exp(log_p) * (log_p - log_q))), 0.0)


class _Both:
    """Two step observers as one."""

    def __init__(self, *observers: Any) -> None:
        self.observers = [o for o in observers if o is not None]

    def __call__(self, step: int, logits: np.ndarray, token: int) -> None:
        for observer in self.observers:
            observer(step, logits, token)


class LogitProbes:
    """Runs generations with a probe attached, keeping reference traces for one engine load."""

    def __init__(self, engine: Engine, cache_bytes: int = CACHE_BYTES, logits: bool = True,
                 prefill: bool = False) -> None:
        self.engine = engine
        self.logits = logits
        #: decode vs prefill needs the engine's prefill_logits (the in-process llama.cpp engine)
        self.prefill = prefill
        self.unavailable = engine.logit_probe_unavailable  # a load may refuse it (transformers' continuous batching)
        self.cache_bytes = cache_bytes
        self._traces: OrderedDict[tuple[str, Sampling], Trace] = OrderedDict()

    def _reference(self, prompt: str, sampling: Sampling) -> Trace:
        key = (prompt, sampling)
        trace = self._traces.get(key)
        if trace is not None:
            self._traces.move_to_end(key)
            return trace
        trace = Trace()
        self.engine.generate_observed([prompt], 0, sampling, trace)
        self._traces[key] = trace
        while sum(t.nbytes for t in self._traces.values()) > self.cache_bytes and len(self._traces) > 1:
            self._traces.popitem(last=False)
        return trace

    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, cache: str = "off"
    ) -> tuple[BatchOutput, dict[str, Any]]:
        """The batch's output plus the probe columns for its target generation."""
        if self.unavailable is not None:
            out = self.engine.generate(prompts, target, sampling, cache=cache)
            cols: dict[str, Any] = {"probe_reference": f"unavailable: {self.unavailable}"} if self.logits else {}
            return out, cols | {"probe_low_margin_frac": low_margin_fraction(out.target.margins)}
        comparer = Comparer(self._reference(prompts[target], sampling)) if self.logits else None
        decoded = Trace() if self.prefill and hasattr(self.engine, "prefill_logits") else None
        out = self.engine.generate_observed(prompts, target, sampling, _Both(comparer, decoded), cache)
        cols = comparer.columns(self.engine.probe_scope()) if comparer else {}
        if decoded is not None:
            prefilled = self.engine.prefill_logits(prompts[target], decoded.tokens)  # type: ignore[attr-defined]
            cols |= prefill_columns(decoded, prefilled)
        return out, cols | {"probe_low_margin_frac": low_margin_fraction(out.target.margins)}
