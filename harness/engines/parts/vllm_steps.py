"""A batch through vLLM's own step loop, as a server runs it: when each token of the target came out,
how often each request was preempted, and what speculative decoding drafted and accepted.

`LLM.generate` hands over the outputs only at the end. The same loop run here (requests added at once
and in order, then `LLMEngine.step` until none is left) sees each step's new tokens as they come, as
a streaming client does, without rebuilding any request's whole output at each step.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any


class Gathered:
    """One request's output gathered from vLLM's per-step deltas, shaped as the RequestOutput that
    LLM.generate returns (`outputs[0]` with token_ids, logprobs, finish_reason; metrics)."""

    def __init__(self) -> None:
        self.outputs = [SimpleNamespace(token_ids=[], logprobs=[], finish_reason=None, spec_decode_metrics=None)]
        self.metrics: Any = None
        self.num_cached_tokens: int | None = None
        self.finished = False

    def add(self, out: Any) -> None:
        seq, part = self.outputs[0], out.outputs[0]
        seq.token_ids += list(part.token_ids)
        seq.logprobs += list(part.logprobs or [])
        seq.finish_reason = part.finish_reason or seq.finish_reason
        seq.spec_decode_metrics = getattr(part, "spec_decode_metrics", None) or seq.spec_decode_metrics
        self.metrics = getattr(out, "metrics", None) or self.metrics
        cached = getattr(out, "num_cached_tokens", None)
        self.num_cached_tokens = cached if cached is not None else self.num_cached_tokens
        self.finished = self.finished or bool(out.finished)


def run_batch(engine: Any, tag: str, inputs: list[dict[str, Any]], params: list[Any],
              target: int) -> tuple[list[Gathered], list[float], float]:
    """The batch through `engine` (an LLMEngine), its requests named `tag`-i. Returns the outputs in
    batch order, when each of the target's tokens came out (a step that gives several, as speculative
    decoding does, gives them one time) and the batch's wall time, in seconds since the first request
    was added."""
    from vllm.sampling_params import RequestOutputKind

    ids = [f"{tag}-{i}" for i in range(len(inputs))]  # LLM.generate's own are 0, 1, ...
    where = {rid: i for i, rid in enumerate(ids)}
    gathered = [Gathered() for _ in ids]
    arrivals: list[float] = []
    t0 = time.perf_counter()
    added: list[str] = []
    try:
        for rid, prompt, param in zip(ids, inputs, params):
            param.output_kind = RequestOutputKind.DELTA  # each step: what is new, not the whole output again
            engine.add_request(rid, prompt, param)
            added.append(rid)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = where.get(str(out.request_id))
                if i is None:
                    continue
                if i == target and out.outputs[0].token_ids:
                    arrivals += [time.perf_counter() - t0] * len(out.outputs[0].token_ids)
                gathered[i].add(out)
    except BaseException:
        # a failed batch leaves nothing behind: requests kept in the engine would be decoded with the next
        # batch, which would then hold more sequences than its rows say
        if added:
            with contextlib.suppress(Exception):  # an engine that cannot abort is broken: its own error is the news
                engine.abort_request(added)
        raise
    wall = time.perf_counter() - t0
    done = sum(g.finished for g in gathered)
    if done != len(ids):
        raise RuntimeError(f"vLLM finished {done} of the batch's {len(ids)} requests")
    return gathered, arrivals, wall


def preemptions(outputs: list[Any]) -> list[int | None]:
    """Each request's preemptions, from vLLM's own per-request record (None where it kept none)."""
    return [getattr(getattr(o, "metrics", None), "num_preemptions", None) for o in outputs]


def drafts(metrics: Any) -> tuple[int | None, int | None]:
    """Tokens drafted for one request and accepted by the model, from vLLM's per-request speculative
    decoding record (a histogram of accepted drafts per verify step); (None, None) without one."""
    if metrics is None:
        return None, None
    histogram = list(getattr(metrics, "histogram", []) or [])
    return int(metrics.num_draft_tokens), sum(j * int(count) for j, count in enumerate(histogram))
