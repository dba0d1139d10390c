"""N sequences decoded together with llama.cpp, the way llama-server's slots do: one context with
n_seq_max = N, the prompts prefilled together, then one llama_decode per step for all live sequences
(a part of harness.engines.llamacpp)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from harness.engines.base import (
    BatchOutput,
    Sampling,
    SequenceOutput,
    StepObserver,
)


def _step_stats(logits: np.ndarray, token: int, scratch: np.ndarray) -> tuple[float, float]:
    """The chosen token's log-probability and the top-1 minus top-2 logit margin.

    Two max passes and one exp into a reused buffer: cheaper than a sort or a partition.
    """
    best = int(logits.argmax())
    top = float(logits[best])
    second = max(float(logits[:best].max(initial=-np.inf)), float(logits[best + 1 :].max(initial=-np.inf)))
    np.subtract(logits, top, out=scratch)
    np.exp(scratch, out=scratch)
    return float(logits[token]) - top - math.log(float(scratch.sum())), top - second



class LlamaDecode:
    """warm_up and generate, for an engine that holds `_ll`, its contexts and batch."""

    #: called with (context, tokens) before each llama_decode of generate: a tracer's (llamacpp_trace)
    _decode_watch: Callable[[Any, list[tuple[int, int, int, bool]]], None] | None = None

    def _ensure_batch(self, size: int) -> Any:
        if size > self._batch_cap:
            if self._batch is not None:
                self._ll.llama_batch_free(self._batch)
            self._batch = self._ll.llama_batch_init(size, 0, 1)
            self._batch_cap = size
        return self._batch

    def _per_seq(self, tokens: list[list[int]], max_tokens: int) -> int:
        """Context per sequence: the option, or the longest prompt + max_tokens rounded up."""
        need = max(len(t) for t in tokens) + max_tokens + 1
        per_seq = self.opts.n_ctx or max(512, -(-need // 256) * 256)
        if need > per_seq:
            raise RuntimeError(f"prompt + max_tokens = {need} tokens exceeds n_ctx {per_seq}")
        return per_seq

    def warm_up(self, prompts: list[str], target: int, sampling: Sampling) -> None:
        """This batch shape's one-time costs without a full prefill: the prompts templated and
        tokenized (cached), the context for n sequences that generate will use, and a first
        llama_decode of n sequences together (one token each, which starts the thread pool)."""
        ll = self._ll
        tokens = [self.prompt_tokens(p) for p in prompts]
        ctx = self._context(len(prompts), self._per_seq(tokens, sampling.max_tokens))
        memory = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(memory, True)
        batch = self._ensure_batch(max(self.prefill_step, len(prompts)))
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t[0], 0, 1
            batch.seq_id[i][0], batch.logits[i] = i, True
        batch.n_tokens = len(tokens)
        rc = ll.llama_decode(ctx, batch)
        ll.llama_memory_clear(memory, True)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _samplers(self, n: int, target: int, sampling: Sampling) -> list[Any]:
        """One llama.cpp sampler chain per sequence (None = greedy argmax), seeded per request.

        The target gets the cell's seed wherever it sits; fillers get seeds derived from it.
        """
        if sampling.temperature == 0:
            return [None] * n
        ll = self._ll
        chains = []
        for i in range(n):
            chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            if sampling.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(sampling.top_k))
            if sampling.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(sampling.top_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(sampling.temperature))
            seed = sampling.seed_for(i, target)  # None: an unseeded filler, llama.cpp draws a random seed
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(ll.LLAMA_DEFAULT_SEED if seed is None else seed))
            chains.append(chain)
        return chains

    # -- generation ---------------------------------------------------------------
    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False, force: list[int] | None = None,
    ) -> BatchOutput:
        """`force`: the target's tokens, fed in place of its own picks (a recorded output replayed
        through this decode loop); its statistics are then of the forced tokens, and `argmax` says
        what it would have picked at each step. The batch-mates decode as usual."""
        ll = self._ll
        n = len(prompts)
        tokens = [self.prompt_tokens(p) for p in prompts]
        ctx = self._context(n, self._per_seq(tokens, sampling.max_tokens))
        memory = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(memory, True)
        batch = self._ensure_batch(max(self.prefill_step, n))
        samplers = self._samplers(n, target, sampling)
        vocab = self._vocab
        n_vocab = self.n_vocab
        ignore_eos = self.opts.ignore_eos
        scratch = np.empty(n_vocab, dtype=np.float32)

        outs: list[list[int]] = [[] for _ in range(n)]
        # per-step statistics of the target (and, with members, of every sequence)
        logprobs: list[list[float]] = [[] for _ in range(n)]
        margins: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        live = [True] * n
        argmax: list[int] = []  # forced decoding: the target's own pick at each step
        pos = [len(t) for t in tokens]
        generated = 0

        def pick(seq: int, idx: int) -> None:
            nonlocal generated
            if force is not None and seq == target:
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
                argmax.append(int(logits.argmax()))
                tok = int(force[len(outs[seq])])
                lp, margin = _step_stats(logits, tok, scratch)
                logprobs[seq].append(lp)
                margins[seq].append(margin)
                generated += 1
                outs[seq].append(tok)
                if len(outs[seq]) >= len(force):
                    live[seq] = False
                return
            if samplers[seq] is None:
                ptr = ll.llama_get_logits_ith(ctx, idx)
                logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
                tok = int(logits.argmax())
            else:
                tok = int(ll.llama_sampler_sample(samplers[seq], ctx, idx))
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
            if seq == target or members:
                if observe is not None and seq == target:
                    observe(len(logprobs[seq]), logits, tok)
                lp, margin = _step_stats(logits, tok, scratch)
                logprobs[seq].append(lp)
                margins[seq].append(margin)
            generated += 1
            if not ignore_eos and ll.llama_vocab_is_eog(vocab, tok):
                finish[seq], live[seq] = "stop", False
                return
            outs[seq].append(tok)
            if len(outs[seq]) >= sampling.max_tokens:
                live[seq] = False

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:
            for i, (tok, p, seq, want) in enumerate(entries):
                batch.token[i] = tok
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
            batch.n_tokens = len(entries)
            if self._decode_watch is not None:
                self._decode_watch(ctx, entries)
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        reused = 0
        if cache == "warm":
            # The target prompt served just before on the target's sequence: its KV, all but the
            # last token (whose logits the batch needs), is kept and reused, as llama-server does.
            lone = [(tok, p, target, False) for p, tok in enumerate(tokens[target])]
            for start in range(0, len(lone), self.prefill_step):
                decode(lone[start : start + self.prefill_step])
            reused = len(tokens[target]) - 1
            ll.llama_memory_seq_rm(memory, target, reused, -1)
        try:
            t0 = time.perf_counter()
            # Prefill: all prompts together, split into prefill-step-sized calls like llama-server.
            flat = [(tok, p, s, p == len(t) - 1) for s, t in enumerate(tokens) for p, tok in enumerate(t)
                    if s != target or p >= reused]
            for start in range(0, len(flat), self.prefill_step):
                chunk = flat[start : start + self.prefill_step]
                decode(chunk)
                for i, (_, _, seq, last) in enumerate(chunk):
                    if last:
                        pick(seq, i)
            t_prefill = time.perf_counter()
            t_target = t_prefill
            # when each output token of the target was in hand (an end-of-generation pick is no token)
            arrivals = [t_prefill - t0] if outs[target] else []
            while live[target] or (members and any(live)):
                order = [s for s in range(n) if live[s]]
                had = len(outs[target])
                decode([(outs[s][-1], pos[s] + len(outs[s]) - 1, s, True) for s in order])
                for i, seq in enumerate(order):
                    pick(seq, i)
                if target in order:  # the target's time ends with its last step
                    t_target = time.perf_counter()
                    if len(outs[target]) > had:
                        arrivals.append(t_target - t0)
            t_end = time.perf_counter()
        finally:
            for chain in samplers:
                if chain is not None:
                    ll.llama_sampler_free(chain)

        def output(seq: int) -> SequenceOutput:
            ids = outs[seq]
            return SequenceOutput(ids, self.detokenize(ids), finish[seq], logprobs[seq], margins[seq],
                                  [self.detokenize([t]) for t in ids], argmax if seq == target else [])

        every = [output(s) for s in range(n)] if members else []
        return BatchOutput(
            target=every[target] if members else output(target),
            prompt_tokens=len(tokens[target]),
            prefill_s=t_prefill - t0,
            ttft_s=t_prefill - t0,
            target_s=t_target - t0,
            wall_s=t_end - t0,
            batch_generated_tokens=generated,
            cached_tokens=reused,
            members=every,
            token_times=arrivals,
        )
