"""`python -m harness.engines.parts.kernel_probe MODEL on|off THREADS`: load a GGUF with llama.cpp's
extra buffer types on or off and decode a batch of 2 sequences whose prefills are over 128 tokens
(the shape that reaches the AMX and repacked matrix kernels), in this process. Exit code 0 when it
ran; a kernel that does not suit the CPU kills the process by a signal, which the caller reads."""

from __future__ import annotations

import sys

from harness.engines.parts.cpu_kernels import PREFILL_TEXT


def main(model: str, extra: str, threads: int) -> int:
    import llama_cpp as ll

    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = extra == "on"
    handle = ll.llama_model_load_from_file(model.encode(), params)
    if not handle:
        return 3
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_seq_max = 1024, 512, 2
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = ll.llama_init_from_model(handle, cparams)
    vocab = ll.llama_model_get_vocab(handle)
    text = PREFILL_TEXT.encode()
    tokens = (ll.llama_token * 512)()
    n = ll.llama_tokenize(vocab, text, len(text), tokens, 512, True, True)
    batch = ll.llama_batch_init(2 * n, 0, 2)
    for seq in range(2):
        for i in range(n):
            j = seq * n + i
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = tokens[i], i, 1
            batch.seq_id[j][0], batch.logits[j] = seq, i == n - 1
    batch.n_tokens = 2 * n
    if ll.llama_decode(ctx, batch) != 0:
        return 4
    for step in range(4):  # a few decode steps of both sequences together
        for seq in range(2):
            batch.token[seq], batch.pos[seq], batch.n_seq_id[seq] = tokens[step], n + step, 1
            batch.seq_id[seq][0], batch.logits[seq] = seq, True
        batch.n_tokens = 2
        if ll.llama_decode(ctx, batch) != 0:
            return 4
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(handle)
    return 0


if __name__ == "__main__":
    from harness.core.native_preload import ensure

    ensure()  # as a run's worker loads llama.cpp: its GPU backend preloaded, where the build has one
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
