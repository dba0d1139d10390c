"""Forced-decode replay on real llama.cpp: recorded outputs fed back through the decode loop. A run
replayed in its own batch under its own setting must give back its recorded log-probabilities
bit for bit (the same arithmetic again), so the path is shown to force, not to generate; under
F32 weights the Q4_1 runs are compared over their whole length, and every figure is recomputed
here from the stored replay and the rows."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from harness.results.folder_rows import open_results
from harness.run import replay as replaying

from .conftest import needs_llama, run_experiment, run_harness

pytestmark = [needs_llama]

EXPERIMENT = """
name: replayed
prompts: prompts.yaml
max_tokens: 24
matrix:
  model: [smollm2-135m]
  batch_size: [1, 4]
engine_options:
  llamacpp: {n_threads: 2}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return run_experiment(tmp_path_factory.mktemp("replay"), EXPERIMENT).root


def test_a_run_replayed_in_its_own_batch_gives_back_its_log_probabilities_bitwise(folder):
    done = run_harness("replay", str(folder), "-f", "json", "--per-run")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)
    assert len(runs) == 4 and all(r["would_split_steps"] == 0 and r["max_abs_delta"] == 0.0 for r in runs)
    results = open_results(folder)
    stored = replaying.read_replays(folder).set_index(["cell_id", "prompt_id"])
    rows = results.read_rows().set_index(["cell_id", "prompt_id"])
    for key, rec in stored.iterrows():
        recorded = np.asarray(rows.loc[key, "logprobs"], dtype=np.float32)[:len(rows.loc[key, "token_ids"])]
        assert np.array_equal(np.asarray(rec.replay_logprobs, dtype=np.float32), recorded)
        assert list(rec.replay_argmax) == list(rows.loc[key, "token_ids"])  # greedy: its own picks again
    again = run_harness("replay", str(folder), "-f", "json")  # already replayed: nothing new is written
    assert "wrote" not in again.stderr and len(json.loads(again.stdout)) == 4


def test_q4_runs_replayed_alone_under_f32_are_compared_over_their_whole_length(folder):
    done = run_harness("replay", str(folder), "--dtype", "f32", "--batch-size", "1", "-f", "json", "--per-run")
    assert done.returncode == 0, done.stderr
    runs = [r for r in json.loads(done.stdout) if '"f32"' in r["replayer"]]
    assert len(runs) == 4 and all('"batch": "batches of 1"' in r["replayer"] for r in runs)
    results = open_results(folder)
    stored = replaying.read_replays(folder)
    stored = stored[stored.replayer.str.contains('"f32"')].set_index(["cell_id", "prompt_id"])
    rows = results.read_rows().set_index(["cell_id", "prompt_id"])
    for r in runs:
        rec, row = stored.loc[(r["cell_id"], r["prompt_id"])], rows.loc[(r["cell_id"], r["prompt_id"])]
        n = len(row.token_ids)
        delta = np.asarray(rec.replay_logprobs[:n], dtype=float) - np.asarray(row.logprobs[:n], dtype=float)
        assert r["steps"] == n and r["mean_abs_delta"] == pytest.approx(np.abs(delta).mean())
        apart = [i for i, (a, t) in enumerate(zip(rec.replay_argmax, row.token_ids)) if a != t]
        assert r["would_split_steps"] == len(apart)
        assert (r["first_would_split"] if apart else None) == (apart[0] if apart else None)
    assert all(r["mean_abs_delta"] > 0 for r in runs)  # other weights: other probabilities at every step
    shown = run_harness("replay", str(folder), "--stats-only")
    assert "replayed:" in shown.stdout and "batches of 1" in shown.stdout


def test_engines_that_cannot_force_tokens_are_refused_with_the_reason(folder):
    # (vLLM forces tokens through a logits processor: tests/test_vllm_engine.py replays with it)
    refused = run_harness("replay", str(folder), "--engine", "llama-server")
    assert "not replayed" in refused.stdout and "a server picks its own tokens" in refused.stdout


def test_a_batch_size_without_fillers_is_refused_with_the_reason_not_a_traceback(tmp_path):
    root = run_experiment(tmp_path, "name: lone\nprompts: [{id: a, text: hello}]\nrepeats: 1\nmax_tokens: 4\n"
                                    "matrix: {model: [smollm2-135m], engine: [llamacpp]}\n").root
    done = run_harness("replay", str(root), "--batch-size", "4")
    said = " ".join(done.stdout.split())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "not replayed" in said and "--batch-size 4 composes batches from the experiment's fillers" in said
    assert run_harness("replay", str(root), "--batch-size", "1").returncode == 0  # alone needs no filler


def test_a_replayer_sees_the_gpus_its_setting_may_use_and_the_probe_cache_names_them(monkeypatch, tmp_path):
    """`gpu: cpu` runs re-read on a GPU node see no GPU, as their worker did (a CUDA build would compute
    on one); and the kernel probe's cached answer is kept per set of visible GPUs."""
    from harness.engines.base import LoadSpec
    from harness.engines.llamacpp import LlamaCppEngine
    from harness.run.rescore import PlacedEngine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1")
    spec = LoadSpec("llamacpp", "smollm2-135m", "auto", "cpu", False, {"n_threads": 2})
    with PlacedEngine(spec, None, lambda _: None) as placed:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and placed.engine.n_gpu_layers == 0
    # and put back after: a `gpu: any` engine loaded next in this process sees the node's GPUs
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with PlacedEngine(spec, None, lambda _: None):
        pass
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    keys = set()
    for visible in ("", "GPU-1", "GPU-2"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        keys.add(LlamaCppEngine.kernel_choice("off", tmp_path / "m.gguf", "abc", "CPU : AVX2 = 1 |", 2,
                                              lambda _: None)[2])
    assert len(keys) == 3
