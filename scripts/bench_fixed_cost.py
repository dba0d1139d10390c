"""The fixed cost of `harness run`, whole-process: one batch of N x T greedy tokens through the
harness's command line against a bare llama-cpp-python script doing the same decode.

    python scripts/bench_fixed_cost.py [--batch 8] [--tokens 256] [--rounds 5]

Both are fresh processes, timed from start to exit, alternating round by round. The bare script
loads the shipped model, prefills the same chat-templated prompts (tokenized beforehand, so it
does no templating) with the same context settings, and decodes greedily with one `llama_decode`
per step. The harness run is `harness run` of a one-cell experiment (one prompt, one repeat,
the target among the fillers it draws, ignore_eos) into a fresh folder, summary table included,
as a user runs it; the bare script decodes the same N prompts.
Prints each side's median wall time, the fixed cost (the difference of the medians, and the median
of the per-round differences), the ratio harness / bare and the throughput bare / harness
(issue 28's goals: fixed cost <= 1 s, throughput >= 0.95); and the measured batch alone, prefill to
last token: the bare loop's tokens/s against the row's `batch_tokens_per_s` (the same span, timed
by the engine), their ratio (issue 67's goal: >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BARE = r"""
import json, sys, time
import numpy as np
import llama_cpp as ll
spec = json.load(open(sys.argv[1]))
ll.llama_backend_init()
mparams = ll.llama_model_default_params()
mparams.n_gpu_layers = 0
mparams.use_extra_bufts = spec["extra"]  # the kernels the harness chose (extra_bufts auto), so both run alike
model = ll.llama_model_load_from_file(spec["model"].encode(), mparams)
vocab = ll.llama_model_get_vocab(model)
n_vocab = ll.llama_vocab_n_tokens(vocab)
tokens = spec["tokens"]
n = len(tokens)
params = ll.llama_context_default_params()
params.n_ctx = n * spec["per_seq"]
params.n_seq_max = n
params.n_batch = spec["n_batch"]
params.n_ubatch = spec["n_ubatch"]
params.n_threads = params.n_threads_batch = spec["threads"]
ctx = ll.llama_init_from_model(model, params)
batch = ll.llama_batch_init(max(spec["n_batch"], n), 0, 1)
def decode(entries):
    for i, (tok, pos, seq, want) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, want
    batch.n_tokens = len(entries)
    assert ll.llama_decode(ctx, batch) == 0
flat = [(tok, p, s, p == len(t) - 1) for s, t in enumerate(tokens) for p, tok in enumerate(t)]
t0 = time.perf_counter()
nxt, out = {}, 0
for start in range(0, len(flat), spec["n_batch"]):
    chunk = flat[start:start + spec["n_batch"]]
    decode(chunk)
    for i, (_, _, s, last) in enumerate(chunk):
        if last:
            nxt[s] = int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
out = n
for step in range(1, spec["max_tokens"]):
    decode([(nxt[s], len(tokens[s]) + step - 1, s, True) for s in range(n)])
    nxt = {s: int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, s), shape=(n_vocab,)).argmax()) for s in range(n)}
    out += n
json.dump({"tokens": out, "batch_s": time.perf_counter() - t0}, open(sys.argv[2], "w"))
"""

EXPERIMENT = """name: fixed-cost
prompts:
  - id: story
    text: {target}
fillers: {fillers}
repeats: 1
max_tokens: {tokens}
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [{batch}]
engine_options:
  llamacpp: {{ignore_eos: true, n_ctx: {per_seq}, extra_bufts: "{extra}"}}
"""


def timed(args: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(args, check=True, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from harness.engines.base import LoadSpec
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.experiment.prompts import compose_batch, load_prompt_set

    per_seq = 512
    prompts = load_prompt_set("prompts/default.yaml", ROOT, where="bench")
    target = prompts.get("story")
    one = prompts.__class__((target,), prompts.fillers)
    batch = compose_batch(one, target, args.batch, 0, 0)  # what `harness run` composes: filler_seed 0, repeat 0
    with tempfile.TemporaryDirectory(prefix="bench-fixed-") as tmp:
        work = Path(tmp)
        engine = LlamaCppEngine(LoadSpec("llamacpp", "smollm2-135m", "auto", "cpu", False,
                                         {"ignore_eos": True, "n_ctx": per_seq}), lambda m: None)
        chat = [engine.tokenize(engine.chat(p.text)) for p in batch.prompts]
        spec = {"model": str(engine.model_path), "tokens": chat, "per_seq": per_seq,
                "max_tokens": args.tokens, "threads": engine.n_threads, "n_batch": engine.opts.n_batch,
                "n_ubatch": engine.opts.n_ubatch, "extra": engine.extra.use_extra}
        engine.close()
        (work / "spec.json").write_text(json.dumps(spec))
        (work / "bare.py").write_text(BARE)
        (work / "exp.yaml").write_text(EXPERIMENT.format(
            batch=args.batch, tokens=args.tokens, per_seq=per_seq, extra="on" if spec["extra"] else "off",
            target=json.dumps(target.text),
            fillers=json.dumps([f.text for f in prompts.fillers])))
        bare, mine, bare_tps, mine_tps = [], [], [], []
        for r in range(args.rounds):
            bare.append(timed([sys.executable, str(work / "bare.py"), str(work / "spec.json"), str(work / "bare.json")],
                              work))
            mine.append(timed([sys.executable, "-m", "harness", "run", str(work / "exp.yaml"), "--out",
                               str(work / f"out-{r}")], ROOT))
            done = json.loads((work / "bare.json").read_text())
            bare_tps.append(done["tokens"] / done["batch_s"])
            mine_tps.append(_batch_tokens_per_s(work / f"out-{r}"))
            print(f"round {r + 1}: bare {bare[-1]:.2f} s, harness run {mine[-1]:.2f} s; measured batch "
                  f"{bare_tps[-1]:.1f} vs {mine_tps[-1]:.1f} tokens/s", flush=True)
    b, m = statistics.median(bare), statistics.median(mine)
    # rounds alternate, so a round's two runs share the machine's state of the moment: the median of
    # the per-round differences drifts less than the difference of the medians (both are printed)
    paired = statistics.median(h - x for h, x in zip(mine, bare))
    print(f"batch {args.batch} x {args.tokens} tokens, {spec['threads']} threads: bare {b:.2f} s, harness run {m:.2f} s, "
          f"fixed cost {m - b:.2f} s, ratio {m / b:.3f} (medians of {args.rounds}); "
          f"per round: fixed cost {paired:.2f} s (median of the differences), "
          f"throughput {b / m:.3f} of the bare loop's")
    bt, mt = statistics.median(bare_tps), statistics.median(mine_tps)
    print(f"measured batch (prefill to last token): bare {bt:.1f} tokens/s, harness {mt:.1f} tokens/s, "
          f"throughput {mt / bt:.3f} of the bare loop's (medians of {args.rounds})")


def _batch_tokens_per_s(out: Path) -> float:
    """The batch's tokens/s as the row of `harness run` records it (one cell, one row)."""
    import pandas as pd

    rows = pd.concat(pd.read_parquet(f, columns=["batch_tokens_per_s"]) for f in (out / "cells").glob("*.parquet"))
    return float(rows["batch_tokens_per_s"].iloc[0])


if __name__ == "__main__":
    main()
