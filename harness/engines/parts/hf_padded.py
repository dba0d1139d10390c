"""A batch through a Hugging Face model the way `generate` runs one: the prompts left-padded into one
tensor with an attention mask and position ids, one forward pass over the whole batch per step with
its KV cache, finished rows fed padding so that the batch keeps its shape (a part of
harness.engines.hf_transformers).

The loop is the harness's own rather than `generate` itself because a determinism measurement needs
what `generate` keeps to itself: a seeded generator per request (so a run's draw does not depend on
its batch-mates), the float32 logits of every step (log-probabilities, top-2 margins, the logit
probe) and the moment each token is in hand (TTFT, inter-token gaps). With greedy decoding it
computes exactly what `generate` computes (tested: batch 1 against `model.generate`).
"""

from __future__ import annotations

import time
from typing import Any

from harness.engines.base import BatchOutput, Sampling, SequenceOutput, StepObserver


def _generators(torch: Any, device: Any, n: int, target: int, sampling: Sampling) -> list[Any]:
    """One torch.Generator per request on the model's device, seeded as the other engines seed them:
    the target with the cell's seed wherever it sits, fillers with seeds derived from it (or, for
    unseeded fillers, a fresh random seed)."""
    out = []
    for i in range(n):
        generator = torch.Generator(device=device)
        seed = sampling.seed_for(i, target)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        out.append(generator)
    return out


def _draw(torch: Any, logits: Any, sampling: Sampling, generator: Any) -> int:
    """One token from one row's float32 logits: temperature, then top-k, then top-p (the order of
    transformers' own warpers), then a draw with the request's own generator."""
    scores = logits / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, index = torch.sort(scores, descending=False)
        tail = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        tail[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(tail.scatter(0, index, tail), float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator).item())


class HfPadded:
    """`generate` for padded batching, for an engine that holds `model`, `torch`, `device`, `pad_id`,
    its end-of-generation set `_eos`, `opts` and `prompt_tokens` / `decode_tokens`."""

    #: the forward argument (and output field) that carries the KV cache: `cache` from transformers
    #: 5.2x, `past_key_values` before
    cache_arg = "past_key_values"
    #: more arguments of the prefill's forward: logits of the last position only, where the model takes it
    forward_extra: dict = {}

    def _forward_arguments(self) -> None:
        """What this transformers' forward takes, read from its signature once per load."""
        import inspect

        taken = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in taken else "past_key_values"
        self.forward_extra = {"logits_to_keep": 1} if "logits_to_keep" in taken else {}

    def _padded_inputs(self, prompts: list[str]) -> tuple[list[list[int]], Any, Any, Any]:
        """The batch as `generate` feeds it: (each prompt's ids, the left-padded ids, the attention mask,
        the position ids counted from each prompt's first real token)."""
        torch = self.torch
        ids = [self.prompt_tokens(p) for p in prompts]
        n, width = len(ids), max(len(t) for t in ids)
        tokens = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, t in enumerate(ids):  # left padding: every prompt ends at the last column
            tokens[row, width - len(t):] = torch.tensor(t, dtype=torch.long)
            mask[row, width - len(t):] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        return ids, tokens, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _next_feed(self, outs: list[list[int]], live: list[bool], mask: Any, positions: Any) -> tuple[Any, Any, Any]:
        """The next decode step's inputs: each live row's last token (padding for a finished row), the mask
        one column wider, the positions one on."""
        torch, n = self.torch, len(outs)
        feed = torch.tensor([[outs[s][-1] if live[s] and outs[s] else self.pad_id] for s in range(n)],
                            dtype=torch.long, device=self.device)
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], dim=-1)
        return feed, mask, positions[:, -1:] + 1

    def _padded(self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None,
                members: bool) -> BatchOutput:
        torch = self.torch
        ids, tokens, mask, positions = self._padded_inputs(prompts)
        n = len(ids)
        generators = _generators(torch, self.device, n, target, sampling) if sampling.temperature > 0 else []
        outs: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        margins: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        live = [True] * n
        watched = [s for s in range(n) if s == target or members]
        arrivals: list[float] = []
        generated = 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                             **self.forward_extra)
            t_prefill = t_target = 0.0
            step = 0
            while live[target] or (members and any(live)):
                logits = out.logits[:, -1, :].float()
                picks = self._picks(logits, live, generators, sampling)
                stats = self._stats(logits, picks, watched)
                if step == 0:
                    t_prefill = time.perf_counter() - t0
                if observe is not None and live[target]:
                    observe(len(logprobs[target]), logits[target].cpu().numpy(), picks[target])
                had, was_live = len(outs[target]), live[target]
                for seq in range(n):
                    if not live[seq]:
                        continue
                    generated += 1
                    if seq in stats:
                        logprobs[seq].append(stats[seq][0])
                        margins[seq].append(stats[seq][1])
                    if not self.opts.ignore_eos and picks[seq] in self._eos:
                        finish[seq], live[seq] = "stop", False
                        continue
                    outs[seq].append(picks[seq])
                    if len(outs[seq]) >= sampling.max_tokens:
                        live[seq] = False
                if was_live:  # the target's time ends with its last step
                    t_target = time.perf_counter() - t0
                    if len(outs[target]) > had:
                        arrivals.append(t_target)
                step += 1
                if not (live[target] or (members and any(live))):
                    break
                feed, mask, positions = self._next_feed(outs, live, mask, positions)
                out = self.model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                                 **{self.cache_arg: getattr(out, self.cache_arg)})
            wall = time.perf_counter() - t0

        def output(seq: int) -> SequenceOutput:
            return SequenceOutput(outs[seq], self.decode_tokens(outs[seq]), finish[seq], logprobs[seq], margins[seq],
                                  [self.decode_tokens([t]) for t in outs[seq]])

        every = [output(s) for s in range(n)] if members else []
        return BatchOutput(
            target=every[target] if members else output(target),
            prompt_tokens=len(ids[target]),
            prefill_s=t_prefill,
            ttft_s=arrivals[0] if arrivals else None,
            target_s=t_target or wall,
            wall_s=wall,
            batch_generated_tokens=generated,
            members=every,
            token_times=arrivals,
        )

    def _picks(self, logits: Any, live: list[bool], generators: list[Any], sampling: Sampling) -> list[int]:
        """Each live row's next token: the argmax of its float32 logits, or a draw with its own generator."""
        if sampling.temperature <= 0:
            return [int(t) for t in logits.argmax(-1).tolist()]
        return [_draw(self.torch, logits[s], sampling, generators[s]) if live[s] else self.pad_id
                for s in range(len(live))]

    def _stats(self, logits: Any, picks: list[int], rows: list[int]) -> dict[int, tuple[float, float]]:
        """For `rows`: the chosen token's log-probability and the top-1 minus top-2 logit margin, from the
        float32 logits (as the other engines compute them), in one transfer."""
        torch = self.torch
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        chosen = torch.tensor([picks[r] for r in rows], dtype=torch.long, device=logits.device)
        part = logits.index_select(0, index)
        lp = part.log_softmax(-1).gather(1, chosen[:, None])[:, 0]
        top = part.topk(2, dim=-1).values
        both = torch.stack([lp, top[:, 0] - top[:, 1]], dim=1).tolist()
        return {r: (float(a), float(b)) for r, (a, b) in zip(rows, both)}
