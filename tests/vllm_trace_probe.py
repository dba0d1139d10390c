"""The vLLM tracer on the real engine, in a process of its own (vLLM spawns its engine core and model
worker; a test process should not hold them): run by test_vllm_engine, prints one JSON object."""

from __future__ import annotations

import json
import os

if __name__ == "__main__":
    os.environ.update({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_BATCH_INVARIANT": "0"})
    from harness.engines.base import LoadSpec, Sampling, Unsupported
    from harness.engines.registry import engine_class
    from harness.run import trace_diff

    options = {"enforce_eager": True, "max_num_seqs": 8, "max_model_len": 512, "forced_decoding": True}
    batch = ["Write a two-sentence story about a fox.", "hello", "What is 2 + 2?"]
    said: dict = {"steps": []}
    with engine_class("vllm")(LoadSpec("vllm", "smollm2-135m", "f32", "any", False, options), lambda _: None) as engine:
        sampling = Sampling(0.0, 1.0, 0, 0, 4)
        run = engine.generate(batch, 1, sampling).target
        for step in (0, 2):
            first = trace_diff.Recording()
            logprobs = engine.trace(batch, 1, sampling, run.token_ids, step, first)
            again = trace_diff.Comparing(first)
            engine.trace(batch, 1, sampling, run.token_ids, step, again)
            found = trace_diff.finding(again)
            said["steps"].append({"step": step, "rebuilt": float(logprobs[run.token_ids[step]]), "row": run.logprobs[step],
                                  "names": [name for name, *_ in first.ops], "sizes": [n for *_, n in first.ops],
                                  "again_first": None if found.first is None else found.first["name"],
                                  "again_parted": found.parted is not None, "again_ops": found.ops})
        engine._trace_offset = 1  # read the next request's rows: the row check must refuse
        try:
            engine.trace(batch, 1, sampling, run.token_ids, 1, trace_diff.Recording())
            said["shifted"] = "traced"
        except Unsupported as exc:
            said["shifted"] = str(exc)
        said["n_vocab"] = engine._vocab_size
    print("TRACE-PROBE " + json.dumps(said))
