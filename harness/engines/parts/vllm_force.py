"""Forced decoding for vLLM: a logits processor that makes a request emit given tokens, one per step.

vLLM loads it by its qualified name (`logits_processors=[FQCN]`) inside its engine process, so
this module is imported there, never by the harness itself. A request asks for it through
`SamplingParams(extra_args={FORCE_KEY: [token ids]}, temperature=0)`: at step i every logit but
that of the i-th token is set to -inf, so greedy sampling picks it. The log-probabilities vLLM
returns are its raw ones (`logprobs_mode` raw_logprobs, vLLM's default), computed before any
logits processor: what the model gave the forced token, and its own top-1 and top-2, at every
step of the decode path. Requests without the key are left as they are.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: the SamplingParams.extra_args key that carries a request's forced token ids
FORCE_KEY = "harness_force"
#: what `LLM(logits_processors=...)` is given
FQCN = f"{__name__}:ForceTokens"


class ForceTokens(AdapterLogitsProcessor):
    """Per request with FORCE_KEY: only the next forced token keeps its logit."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must apply it before greedy sampling

    def new_req_logits_processor(self, params: Any) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        forced = list((getattr(params, "extra_args", None) or {}).get(FORCE_KEY) or [])
        if not forced:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(forced):
                token = forced[step]
                kept = logits[token].clone()
                logits.fill_(float("-inf"))
                logits[token] = kept
            return logits

        return force
