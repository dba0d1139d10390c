"""How much does the harness's llama.cpp engine cost over a bare llama-cpp-python decode loop?

Both decode the same batch (N chat-formatted prompts, greedy, ignore EOS, same token budget)
on the same loaded model with the same context settings, alternating run by run so drift
hits both alike. Prints aggregate tokens/s of each and the ratio harness / bare (goal >= 0.95).

    python scripts/bench_llamacpp_overhead.py [--tokens 64] [--rounds 5] [--sizes 1,8] [--model NAME_OR_GGUF]

`--model` takes a registry name or a .gguf path; a large-vocabulary one (the harness computes a
log-softmax and top-2 margin over the whole vocabulary at every step) is made by
`scripts/make_large_vocab_gguf.py` (200,064 tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from harness.engines.base import LoadSpec, Sampling
from harness.engines.llamacpp import LlamaCppEngine
from harness.experiment.prompts import compose_batch, load_prompt_set

from benchlib import HEADER, alternate, row  # scripts/ is on sys.path when run as a script


def bare_generate(engine: LlamaCppEngine, tokens: list[list[int]], max_tokens: int) -> int:
    """The baseline: prefill all (pre-tokenized) sequences, one llama_decode per step, argmax."""
    ll = engine._ll
    n = len(tokens)
    ctx = engine._context(n, 512)
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    batch = engine._ensure_batch(2048)
    n_vocab = engine.n_vocab

    def decode(entries):
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(entries)
        assert ll.llama_decode(ctx, batch) == 0

    decode([(tok, p, s, p == len(t) - 1) for s, t in enumerate(tokens) for p, tok in enumerate(t)])
    last_index = np.cumsum([len(t) for t in tokens]) - 1
    nxt = [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, int(i)), shape=(n_vocab,)).argmax())
           for i in last_index]
    produced = n
    for step in range(1, max_tokens):
        decode([(nxt[s], len(tokens[s]) + step - 1, s, True) for s in range(n)])
        nxt = [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, s), shape=(n_vocab,)).argmax())
               for s in range(n)]
        produced += n
    return produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="smollm2-135m", help="registry name or .gguf path")
    args = parser.parse_args()

    root = Path(__file__).resolve().parent.parent
    prompts = load_prompt_set("prompts/default.yaml", root, where="bench")
    options = {"ignore_eos": True, "n_ctx": 512} | ({"n_threads": args.threads} if args.threads else {})
    engine = LlamaCppEngine(LoadSpec("llamacpp", args.model, "auto", "cpu", False, options), print, Path.cwd())
    sampling = Sampling(0.0, 1.0, 0, 0, args.tokens)
    print(f"model {engine.model_path.name} ({engine.n_vocab} tokens of vocabulary), {engine.n_threads} threads, "
          f"{args.tokens} tokens per sequence")
    print(HEADER + f"  (medians of {args.rounds} alternating rounds)")
    for n in [int(x) for x in args.sizes.split(",")]:
        batch = compose_batch(prompts, prompts.prompts[1], n, 0, 0)
        texts = [p.text for p in batch.prompts]
        chat = [engine.tokenize(engine.chat(t)) for t in texts]
        bare_generate(engine, chat, 4)  # warm-up, both paths share the context
        engine.generate(texts, batch.target_position, Sampling(0.0, 1.0, 0, 0, 4))
        def mine() -> int:
            out = engine.generate(texts, batch.target_position, sampling)
            assert out.batch_generated_tokens == n * args.tokens, out.batch_generated_tokens  # same work
            return out.batch_generated_tokens

        bare, ours = alternate(lambda: bare_generate(engine, chat, args.tokens), mine, args.rounds)
        print(row(n, bare, ours))
    engine.close()


if __name__ == "__main__":
    main()
