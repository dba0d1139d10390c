"""Prefill scoring with llama.cpp: the logits of every step from one prefill of prompt + tokens
(the prefill probe, rescore), in a context of its own (a part of harness.engines.llamacpp)."""

from __future__ import annotations

import numpy as np


class LlamaScoring:
    """prefill_logits and score, for an engine that holds `_ll`, `_model` and its context parameters."""

    def prefill_logits(self, prompt: str, steps: list[int]) -> np.ndarray:
        """Logits of every generation step from one prefill of prompt + the generated tokens.

        `steps` are the tokens chosen at each decode step; row i holds the logits that chose
        steps[i], computed with all positions in one llama_decode call (a context of its own).
        """
        ll = self._ll
        prompt_ids = self.prompt_tokens(prompt)
        seq = prompt_ids + steps[:-1]
        size = -(-len(seq) // 256) * 256 + 256
        if self._probe_ctx is None or self._probe_ctx_size < size:
            if self._probe_ctx is not None:
                ll.llama_free(self._probe_ctx)
            params = ll.llama_context_default_params()
            params.n_ctx = size
            params.n_seq_max = 1
            self._set_params(params, size)
            if self.spec.prefill_chunk == "auto":
                params.n_ubatch = size  # one pass
            self._probe_ctx = ll.llama_init_from_model(self._model, params)
            self._probe_ctx_size = size
            if not self._probe_ctx:
                raise RuntimeError(f"llama.cpp could not create a prefill-probe context of {size} tokens")
        ctx = self._probe_ctx
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        batch = ll.llama_batch_init(len(seq), 0, 1)
        try:
            first = len(prompt_ids) - 1
            for i, tok in enumerate(seq):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i >= first
            batch.n_tokens = len(seq)
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} in the prefill probe")
            return np.stack([
                np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)).copy()
                for i in range(first, len(seq))
            ])
        finally:
            ll.llama_batch_free(batch)

    def score(self, prompt: str, tokens: list[int]) -> list[float]:
        """Each token's log-probability (log-softmax of the raw logits, as decode records it) from
        one prefill of prompt + tokens in a context of its own."""
        if not tokens:
            return []
        logits = self.prefill_logits(prompt, list(tokens)).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        return (logits[np.arange(len(tokens)), tokens] - norm).tolist()
