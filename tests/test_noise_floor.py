"""Re-scoring and the noise floor on the real llama.cpp: each run's tokens prefilled by a scorer, the
figures recomputed here from the stored scores and rows, and `compare --score` finding Q4_1 weights
and a q8_0 KV cache beyond F32/f16's own noise while a rerun of the same setting stays within it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest

from harness.analysis.noise_floor import permutation_p
from harness.results.folder_rows import open_results
from harness.run.rescore import read_scores

from .conftest import needs_llama, run_experiment, run_harness

pytestmark = [needs_llama, pytest.mark.engine]

EXPERIMENT = """
name: floor-{name}
prompts: prompts.yaml
repeats: 2
max_tokens: 32
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  dtype: [{dtype}]
  kv_cache_dtype: [{kv}]
  batch_size: [1, 2]
engine_options:
  llamacpp: {{ignore_eos: true, n_threads: 2}}
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A: F32 weights, f16 KV cache; A2: the same again; B: Q4_1 weights; K: F32 with a q8_0 KV cache."""
    plan = {"A": ("f32", "auto"), "A2": ("f32", "auto"), "B": ("auto", "auto"), "K": ("f32", "q8_0")}
    return {name: run_experiment(tmp_path_factory.mktemp(name), EXPERIMENT.format(name=name, dtype=d, kv=kv)).root
            for name, (d, kv) in plan.items()}


def test_rescore_figures_equal_a_recomputation_from_the_stored_scores(folders):
    done = run_harness("rescore", str(folders["A"]), "-f", "json")
    assert done.returncode == 0, done.stderr
    figures = pd.DataFrame(json.loads(done.stdout))
    scores = read_scores(folders["A"])
    rows = open_results(folders["A"]).read_rows()
    joined = scores.merge(rows[["cell_id", "prompt_id", "repeat", "output_hash", "logprobs", "token_ids"]],
                          on=["cell_id", "prompt_id", "repeat", "output_hash"])
    assert len(joined) == len(rows) == 8  # every run scored, matched on its output
    for (cell, prompt), part in joined.groupby(["cell_id", "prompt_id"]):
        delta = np.concatenate([np.asarray(s, float) - np.asarray(d, float)
                                for s, d in zip(part.score_logprobs, part.logprobs)])
        assert all(len(s) == len(t) for s, t in zip(part.score_logprobs, part.token_ids))
        got = figures[(figures.cell_id == cell) & (figures.prompt_id == prompt)].iloc[0]
        assert got.tokens == len(delta)
        assert got.mean_abs_delta == pytest.approx(np.abs(delta).mean())
        assert got.max_abs_delta == pytest.approx(np.abs(delta).max())
        assert got.k3_kl == pytest.approx(np.mean(np.exp(delta) - 1 - delta))
        assert got.share_above == pytest.approx(np.mean(np.abs(delta) > 0.18))
        # F32 scored by F32: the same tokens' probabilities from one prefill stay close to decoding's
        # (a position off by one would put them nats apart)
        assert np.abs(delta).max() < 0.05


def test_an_engine_that_cannot_score_says_why(folders):
    done = run_harness("rescore", str(folders["A"]), "--engine", "llama-server")
    assert done.returncode == 0, done.stderr
    assert "not scored: llama-server" in done.stdout and "one prefill" in done.stdout


def test_noise_floor_flags_q4_1_weights_and_a_q8_0_kv_cache_and_not_a_rerun(folders):
    verdicts = {}
    for other in ("B", "K", "A2"):
        done = run_harness("compare", str(folders["A"]), str(folders[other]), "--score", "--ignore", "dtype",
                           "--ignore", "kv_cache_dtype", "-f", "json")
        assert done.returncode == 0, done.stderr
        (record,) = json.loads(done.stdout)
        verdicts[other] = record
    assert verdicts["B"]["verdict"] == "beyond A's noise" and verdicts["B"]["p_value"] < 0.01
    # a q8_0 KV cache moves every probability by a little, on any CPU; whether that clears A's own
    # decode-vs-prefill noise depends on the CPU's kernels (measured here: beyond, README numbers)
    assert verdicts["K"]["b_value"] > verdicts["K"]["a_floor"] and verdicts["K"]["difference"] > 0
    assert verdicts["A2"]["verdict"] == "within A's noise" and verdicts["A2"]["difference"] == pytest.approx(0, abs=1e-12)
    # A's floor is its own runs re-scored by its own setting: the stored rescore of A says the same
    assert run_harness("rescore", str(folders["A"])).returncode == 0  # scored here unless done already
    scores = read_scores(folders["A"]).merge(open_results(folders["A"]).read_rows()[
        ["cell_id", "prompt_id", "repeat", "logprobs"]], on=["cell_id", "prompt_id", "repeat"])
    per_run = [np.abs(np.asarray(s, float) - np.asarray(d, float)).mean()
               for s, d in zip(scores.score_logprobs, scores.logprobs)]
    # (the stored scores are float32, as the rows' log-probabilities are: ~6e-8 nats of rounding)
    assert verdicts["B"]["a_floor"] == pytest.approx(np.mean(per_run), rel=1e-3)
    gate = run_harness("compare", str(folders["A"]), str(folders["B"]), "--score", "--gate", "--ignore", "dtype")
    assert gate.returncode == 1 and "beyond A's noise" in gate.stdout
    gate = run_harness("compare", str(folders["A"]), str(folders["A2"]), "--score", "--gate")
    assert gate.returncode == 0 and "within A's noise" in gate.stdout


def test_permutation_p_value_equals_an_exact_enumeration():
    a = pd.DataFrame({"prompt_id": ["p", "p", "p", "q", "q"], "value": [0.1, 0.2, 0.15, 0.3, 0.1]})
    b = pd.DataFrame({"prompt_id": ["p", "p", "q", "q"], "value": [0.3, 0.25, 0.2, 0.5]})
    observed, p = permutation_p(a, b, draws=20000)
    # every relabelling within each prompt, counted by hand
    strata = [(a[a.prompt_id == k].value.to_numpy(), b[b.prompt_id == k].value.to_numpy()) for k in ("p", "q")]
    weight = sum(len(vb) for _, vb in strata)

    def stat(pairs):
        return sum(len(vb) * (vb.mean() - va.mean()) for va, vb in pairs) / weight

    splits = []
    for va, vb in strata:
        values = np.concatenate([va, vb])
        splits.append([(values[[i for i in range(len(values)) if i not in chosen]], values[list(chosen)])
                       for chosen in itertools.combinations(range(len(values)), len(vb))])
    every = [stat(combo) for combo in itertools.product(*splits)]
    exact = np.mean([s >= stat(strata) - 1e-15 for s in every])
    assert observed == pytest.approx(stat(strata))
    assert p == pytest.approx(exact, abs=0.01)


def test_rescore_option_scores_the_cells_a_run_ran_and_rescore_resumes(tmp_path):
    from .conftest import PROMPTS

    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text("name: scored\nprompts: prompts.yaml\nmax_tokens: 8\nrescore: true\n"
                                       "matrix: {model: [smollm2-135m], batch_size: [1, 2]}\n"
                                       "engine_options: {llamacpp: {n_threads: 2}}\n")
    out = tmp_path / "out"
    done = run_harness("run", "exp.yaml", "--out", str(out), "--no-summary", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rescored 2 cell(s)" in done.stdout
    files = sorted((out / "rescored").glob("*/*.parquet"))
    assert len(files) == 2 and len(read_scores(out)) == 4  # 2 cells x 2 prompts x 1 repeat
    again = run_harness("rescore", str(out))
    assert again.returncode == 0 and "scoring" not in again.stdout  # nothing left to score
    forced = run_harness("rescore", str(out), "--force")
    assert forced.returncode == 0 and "scoring 4 run(s) of 2 cell(s)" in forced.stdout


def test_the_scorer_is_placed_like_a_run(folders, tmp_path):
    """Runs that ran on a GPU are not scored on a machine without it unless asked, and the scorer's machine
    is in its id and its description, so two machines' scores never pool. The 'GPU' machine is a stand-in
    nvidia-smi (named so: there is no GPU here); the scorer still computes on this CPU."""
    import shutil
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from harness.results.store import Store

    from .conftest import fake_nvidia_smi

    root = tmp_path / "A"
    shutil.copytree(folders["A"], root)
    shutil.rmtree(root / "rescored", ignore_errors=True)
    store = Store(root)
    first, second = sorted(store.cell_files())[:2]
    store.write_cell(first.stem, [r | {"device": "NVIDIA A100-SXM4-80GB"} for r in pq.read_table(first).to_pylist()])
    here = run_harness("rescore", str(root))
    assert here.returncode == 0, here.stderr
    assert f"cell {first.stem}: the runs ran on NVIDIA A100-SXM4-80GB" in " ".join(here.stdout.split())
    scores = read_scores(root)
    assert set(scores.cell_id) == {second.stem}
    described = json.loads(scores.scorer.iloc[0])
    assert described["device"] == "cpu" and described["host"] and "engine_info" in described

    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-80GB")
    there = subprocess.run([sys.executable, "-m", "harness", "rescore", str(root)], capture_output=True, text=True,
                           env=env)
    assert there.returncode == 0 and "not scored" not in there.stdout, there.stdout + there.stderr
    scores = read_scores(root)
    assert set(scores.cell_id) == {first.stem, second.stem}
    assert scores.groupby("scorer_id").scorer.nunique().max() == 1 and scores.scorer_id.nunique() == 2
    forced = run_harness("rescore", str(root), "--any-device", "--force")
    assert forced.returncode == 0 and "not scored" not in forced.stdout


def test_runs_of_another_engine_version_are_not_re_read_by_this_one(folders, tmp_path):
    """An engine upgraded in place keeps the interpreter's folder: the rows' recorded engine version
    tells its runs from this engine's, and rescore and replay refuse, naming both versions."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "upgraded"
    shutil.copytree(folders["A"], root)
    for path in root.rglob("*.parquet"):
        table = pq.read_table(path)
        if "engine_version" in table.column_names:
            at = table.column_names.index("engine_version")
            table = table.set_column(at, table.schema.field(at), pa.array(["llama-cpp-python 0.0.1"] * len(table)))
            pq.write_table(table, path)
    for command in ("rescore", "replay"):
        done = run_harness(command, str(root), "--force")  # the copy holds A's scores: asked again
        said = " ".join(done.stdout.split())
        assert done.returncode == 0 and "made by llama-cpp-python 0.0.1" in said and "upgraded in place" in said, said
