"""A batch through vLLM: generation (through its step loop), forced decoding, prefill scoring and
the log-probabilities it exposes per step (a part of harness.engines.vllm)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from harness.engines.base import (
    BatchOutput,
    Sampling,
    SequenceOutput,
    StepObserver,
    Unsupported,
)
from harness.engines.parts import vllm_steps
from harness.engines.parts.end_of_generation import without_end


def _dense(step: dict[int, Any], size: int) -> np.ndarray:
    """One step's exposed log-probabilities as a vocabulary-sized vector, NaN where not exposed."""
    vector = np.full(size, np.nan, dtype=np.float32)
    for token, lp in step.items():
        if 0 <= token < size:
            vector[token] = lp.logprob
    return vector


def _step_stats(logprobs: list[dict[int, Any]], ids: list[int]) -> tuple[list[float], list[float]]:
    """Chosen-token logprob and top-1 minus top-2 margin per step (a logprob difference equals
    the logit difference, since both share one normalizer)."""
    chosen, margins = [], []
    for token, step in zip(ids, logprobs):
        ranked = {lp.rank: lp.logprob for lp in step.values() if lp.rank is not None}
        chosen.append(float(step[token].logprob) if token in step else math.nan)
        margins.append(float(ranked[1] - ranked[2]) if 1 in ranked and 2 in ranked else math.nan)
    return chosen, margins




class VllmGenerate:
    """generate and score, for an engine that holds `llm`, its tokenizer and options."""

    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False, force: list[int] | None = None,
    ) -> BatchOutput:
        """`force`: the target's tokens, emitted in place of its own picks (a recorded output replayed
        through the decode path: greedy over logits where only the forced token is left); its
        log-probabilities and margins are vLLM's raw ones, and `argmax` says what it would have
        picked at each step. The batch-mates decode as usual."""
        from vllm import SamplingParams

        if force is not None and (members or observe is not None):
            raise Unsupported("forced decoding replays the target alone: no members, no logit probe")
        if cache != "off" and not self.spec.prefix_caching:
            raise Unsupported(f"prefix_cache {cache} needs an engine loaded with prefix caching")
        params = self._params(prompts, target, sampling, observe, force)
        inputs = [{"prompt_token_ids": self.prompt_tokens(p)} for p in prompts]
        if cache != "off":
            self.llm.reset_prefix_cache()  # nothing of an earlier batch is reused
        if cache == "warm":  # the target prompt served just before: its blocks are in the cache
            self.llm.generate([inputs[target]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        if self.capacity:
            need = max(len(i["prompt_token_ids"]) for i in inputs) + sampling.max_tokens + self.spec.draft_tokens
            if need > self.capacity:
                raise Unsupported(f"kv_cache_tokens {self.spec.kv_cache_tokens} (in force: {self.capacity}) holds less "
                                  f"than one request needs alone ({need} tokens: prompt + max_tokens + draft_tokens): "
                                  "it could never finish; raise kv_cache_tokens")
        self._batches += 1
        outputs, arrivals, wall = vllm_steps.run_batch(self.llm.llm_engine, f"harness-{self._batches}", inputs,
                                                       params, target)
        result = outputs[target].outputs[0]
        if force is not None:
            return self._forced(outputs, target, result, list(force), wall, inputs)
        if observe is not None:
            self._observe(result.logprobs or [], list(result.token_ids), observe)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        every = [self._sequence(o.outputs[0]) for o in outputs] if members else []
        sequence = every[target] if members else self._sequence(result)
        preempted = vllm_steps.preemptions(outputs)
        proposed, accepted = vllm_steps.drafts(getattr(result, "spec_decode_metrics", None))
        unmeasured = {}  # what this vLLM release does not record, said in the row (vLLM 0.27 keeps no preemptions)
        if preempted[target] is None:
            unmeasured["preemptions"] = (f"vLLM {self._vllm.__version__} keeps no per-request preemption count "
                                         "(RequestOutput.metrics.num_preemptions)")
        if self.spec.draft_tokens and proposed is None:
            unmeasured["draft_accepted"] = (f"vLLM {self._vllm.__version__} returns no per-request speculative "
                                            "decoding record (spec_decode_metrics)")
        return BatchOutput(
            target=sequence,
            prompt_tokens=len(inputs[target]["prompt_token_ids"]),
            prefill_s=None,
            ttft_s=arrivals[0] if arrivals else None,
            # the request's own end: a batch-mate may finish later
            target_s=arrivals[-1] if arrivals else wall,
            wall_s=wall,
            batch_generated_tokens=generated,
            cached_tokens=getattr(outputs[target], "num_cached_tokens", None),
            members=every,
            token_times=arrivals[:len(sequence.token_ids)],
            preemptions=preempted[target],
            batch_preemptions=None if None in preempted else sum(preempted),
            draft_proposed=proposed,
            draft_accepted=accepted,
            detail={"not_measured": unmeasured} if unmeasured else {},
        )

    def _params(self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None,
                force: list[int] | None) -> list[Any]:
        """Each request's SamplingParams; the target's forcing its tokens where `force` is given."""
        from vllm import SamplingParams

        if force is not None and not self.opts.forced_decoding:
            raise Unsupported("forced decoding needs a load with forced_decoding: true (harness replay sets it)")
        limit = self.opts.max_num_seqs
        if limit is not None and len(prompts) > limit:
            raise Unsupported(f"batch of {len(prompts)} exceeds max_num_seqs={limit}")
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                seed=sampling.seed_for(i, target),
                max_tokens=sampling.max_tokens,
                logprobs=self.opts.probe_top_k if observe is not None and i == target else 2,
                ignore_eos=self.opts.ignore_eos,
            )
            for i in range(len(prompts))
        ]
        if force is not None:
            from harness.engines.parts.vllm_force import FORCE_KEY

            # greedy over the forced logits: the i-th step can only emit force[i]; ignore_eos, since a
            # recorded end-of-sequence token inside an output must not end the replay
            params[target] = SamplingParams(temperature=0.0, max_tokens=len(force), logprobs=2, ignore_eos=True,
                                            extra_args={FORCE_KEY: [int(t) for t in force]})
        return params

    def _forced(self, outputs: list[Any], target: int, result: Any, force: list[int], wall: float,
                inputs: list[dict[str, Any]]) -> BatchOutput:
        """A forced target's output, refused unless vLLM emitted exactly the forced tokens (a
        processor not applied would otherwise pass vLLM's own output off as the replay)."""
        ids = list(result.token_ids)
        if ids != force:
            split = next((i for i, (a, b) in enumerate(zip(ids, force)) if a != b), min(len(ids), len(force)))
            raise RuntimeError(f"vLLM did not emit the forced tokens ({len(ids)} tokens, the first other one at step "
                               f"{split} of {len(force)}: a context limit, or the forcing logits processor not "
                               "applied); this replay is not recorded")
        chosen, margins = _step_stats(result.logprobs or [], ids)
        argmax = [next((t for t, lp in step.items() if lp.rank == 1), -1) for step in (result.logprobs or [])]
        sequence = SequenceOutput(ids, self.tokenizer.decode(ids), str(result.finish_reason), chosen, margins,
                                  [self.tokenizer.decode([t]) for t in ids], argmax)
        return BatchOutput(target=sequence, prompt_tokens=len(inputs[target]["prompt_token_ids"]), prefill_s=None,
                           ttft_s=None, target_s=wall, wall_s=wall,
                           batch_generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                           cached_tokens=getattr(outputs[target], "num_cached_tokens", None), members=[])

    def score(self, prompt: str, tokens: list[int]) -> list[float]:
        """Each token's log-probability from vLLM's prompt_logprobs over prompt + tokens, one request."""
        from vllm import SamplingParams

        if not tokens:
            return []
        if self.spec.prefix_caching:  # cached positions would not be computed again
            raise Unsupported("re-scoring needs a load without prefix caching")
        head = self.prompt_tokens(prompt)
        out = self.llm.generate([{"prompt_token_ids": head + list(tokens)}],
                                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
        steps = out[0].prompt_logprobs or []
        return [float(steps[len(head) + i][t].logprob) for i, t in enumerate(tokens)]

    def _sequence(self, result: Any) -> SequenceOutput:
        """One request's completion as an output; its log-probabilities are the chosen token's and top-2."""
        ids = list(result.token_ids)
        steps = _step_stats(result.logprobs or [], ids)
        ids, _ = without_end(ids, [], None if self.opts.ignore_eos else self._eos, result.finish_reason == "stop")
        return SequenceOutput(ids, self.tokenizer.decode(ids), str(result.finish_reason), *steps,
                              [self.tokenizer.decode([t]) for t in ids])

    def _observe(self, logprobs: list[dict[int, Any]], ids: list[int], observe: StepObserver) -> None:
        """Replay the target's steps to a probe after the fact (vLLM returns them all at the end)."""
        for step, (token, exposed) in enumerate(zip(ids, logprobs)):
            observe(step, _dense(exposed, self._vocab_size), token)
