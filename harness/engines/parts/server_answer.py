"""One llama-server /completion answer read: its tokens, text, per-step log-probabilities and
top-2 margins, and the prompt tokens it took from the slot's cache (a part of harness.engines.llama_server)."""

from __future__ import annotations

import math
from typing import Any

from harness.engines.base import (
    SequenceOutput,
)
from harness.engines.parts.end_of_generation import without_end


def sequence(answer: dict[str, Any], end_ids: frozenset[int] | None = None) -> SequenceOutput:
    """One /completion answer as an output: token ids, text, per-step log-probability and top-2 margin."""
    ids = [int(t) for t in answer.get("tokens", [])]
    chosen, margins, pieces = [], [], []
    for step in answer.get("completion_probabilities", []):
        pieces.append(str(step.get("token", "")))
        chosen.append(float(step.get("logprob", math.nan)))
        top = step.get("top_logprobs", [])
        margins.append(float(top[0]["logprob"] - top[1]["logprob"]) if len(top) >= 2 else math.nan)
    finish = "length" if answer.get("stop_type") == "limit" else "stop"
    # The server lists the token that ended the generation: removed by the one rule, checked against
    # the model's end-of-generation set (where that is unknown, the server's stop_type says it)
    ids, pieces = without_end(ids, pieces, end_ids if end_ids is not None else ids[-1:],
                              answer.get("stop_type") == "eos")
    return SequenceOutput(ids, answer.get("content", ""), finish, chosen, margins,
                          pieces if len(pieces) == len(ids) else [])


def int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def cached(answer: dict[str, Any]) -> int | None:
    """Prompt tokens the server took from the slot's cache, as it reports them."""
    timings = answer.get("timings") or {}
    for value in (timings.get("cache_n"), answer.get("tokens_cached_prompt")):
        if value is not None:
            return int(value)
    return None
