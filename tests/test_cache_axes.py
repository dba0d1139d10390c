"""Prefix cache, shared context, prefill chunk, KV-cache type and engine options as axes; log-probability
comparison; the negative-control rule; the decode-vs-prefill probe. Engine parts run the real llama.cpp."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from harness.analysis import divergence, gate, metrics
from harness.core.errors import ConfigError
from harness.engines.base import Sampling
from harness.experiment import reference_rules
from harness.experiment.config import load_experiment
from harness.experiment.context import fit, shared_context, with_context
from harness.experiment.matrix import expand, group
from harness.experiment.schema import Expectation
from harness.results.folder_rows import open_results

from .conftest import PROMPTS, needs_llama, run_experiment

BASE = """
name: axes
prompts: prompts.yaml
matrix:
  model: [m.gguf]
{extra}
"""


def _load(write, extra: str, more: str = ""):
    write("prompts.yaml", PROMPTS)
    write("m.gguf", "not a model: these tests expand cells, they load no engine\n")
    return load_experiment(write("exp.yaml", BASE.format(extra=extra) + more))


# -- the experiment file ----------------------------------------------------------------

def test_new_axes_parse_and_enter_cells(write):
    loaded = _load(write, "  prefix_cache: [off, cold, warm]\n  prefill_chunk: [auto, 64]\n"
                          "  kv_cache_dtype: [auto, Q8_0]\n  context_tokens: [0, 512]")
    cells = expand(loaded)
    assert len(cells) == 3 * 2 * 2 * 2
    assert {c["prefill_chunk"] for c in cells} == {"auto", "64"}
    assert {c["kv_cache_dtype"] for c in cells} == {"auto", "q8_0"}
    # a cold and a warm cell share one engine load (prefix caching on); off needs its own
    loads = {(c["prefix_cache"], c["prefill_chunk"], c["kv_cache_dtype"]): c.group_id for c in cells}
    assert loads[("cold", "64", "auto")] == loads[("warm", "64", "auto")] != loads[("off", "64", "auto")]
    assert len(group(cells)) == 2 * 2 * 2


def test_cells_at_the_new_axes_defaults_keep_their_ids(write):
    plain = {c.id for c in expand(_load(write, "  batch_size: [1, 2]", "fillers: [a, b]\n"))}
    spelled = {c.id for c in expand(_load(write, "  batch_size: [1, 2]\n  prefix_cache: [off]\n  prefill_chunk: [auto]\n"
                                                 "  kv_cache_dtype: [auto]\n  context_tokens: [0]", "fillers: [a, b]\n"))}
    moved = {c.id for c in expand(_load(write, "  batch_size: [1, 2]\n  prefix_cache: [warm]", "fillers: [a, b]\n"))}
    assert plain == spelled and not plain & moved


@pytest.mark.parametrize("extra, wanted", [
    ("  prefix_cache: [off, hot]", "exp.yaml:5: matrix.prefix_cache: prefix_cache 'hot' is not known; allowed: off, cold, warm"),
    ("  prefill_chunk: [0]", "exp.yaml:5: matrix.prefill_chunk: prefill_chunk '0': allowed: auto"),
    ("  kv_cache_dtype: [int4]", "exp.yaml:5: matrix.kv_cache_dtype: kv_cache_dtype 'int4' is not known; allowed: auto"),
    ("  context_tokens: [-1]", "exp.yaml:5: matrix.context_tokens: context_tokens -1 is out of range"),
    ("  llamacpp.n_ubatch: [16, 0]",
     "exp.yaml:5: matrix.llamacpp.n_ubatch[1]: llamacpp.n_ubatch 0: Input should be greater than or equal to 1"),
    ("  llamacpp.flash: [on]",
     "exp.yaml:5: matrix.llamacpp.flash[0]: 'llamacpp.flash' is not an option of engine 'llamacpp'; "
     "allowed: llamacpp.n_gpu_layers"),
    ("  nosuch.flash_attn: [on]", "exp.yaml:5: matrix.nosuch.flash_attn: not an engine option; write ENGINE.OPTION"),
])
def test_bad_axis_values_name_file_line_and_what_is_allowed(write, extra, wanted):
    with pytest.raises(ConfigError) as err:
        _load(write, extra)
    assert wanted in str(err.value)


def test_engine_options_as_axes(write):
    loaded = _load(write, "  engine: [llamacpp, llama-server]\n  llamacpp.flash_attn: [on, off]\n  llamacpp.n_ubatch: [16, 512]",
                   "exclude:\n  - {llamacpp.flash_attn: off, llamacpp.n_ubatch: 16}\n"
                   "expect:\n  - where: {llamacpp.n_ubatch: 16, llamacpp.flash_attn: off, dtype: float32}\n"
                   "    match_rate_min: 1.0\n")
    cells = expand(loaded)
    llama = [c for c in cells if c["engine"] == "llamacpp"]
    server = [c for c in cells if c["engine"] == "llama-server"]
    # YAML reads bare on/off as booleans: the option gets its words back; excluded combination gone
    assert sorted((c["llamacpp.flash_attn"], c["llamacpp.n_ubatch"]) for c in llama) == [
        ("off", "512"), ("on", "16"), ("on", "512")]
    assert {dict(c.engine_options)["n_ubatch"] for c in llama} == {16, 512}
    # the option is llama.cpp's: one llama-server cell, holding None there, not one per value
    assert len(server) == 1 and server[0]["llamacpp.flash_attn"] is None
    assert dict(server[0].engine_options)["flash_attn"] == "auto"  # its own option, at its default
    assert len({c.group_id for c in llama}) == 3  # each option value is a new engine load
    # rules select with the values rows hold (text for options, canonical names for axes)
    assert loaded.experiment.expect[0].where == {"llamacpp.n_ubatch": "16", "llamacpp.flash_attn": "off", "dtype": "f32"}
    assert reference_rules.parse_reference(["llamacpp.n_ubatch=512"]) == {"llamacpp.n_ubatch": "512"}
    with pytest.raises(Exception, match="llamacpp.n_ubatch 'x'"):
        reference_rules.parse_reference(["llamacpp.n_ubatch=x"])


def test_context_fits_the_wanted_token_count():
    count = lambda text: len(text.split()) + text.count("e")  # noqa: E731 - a stand-in tokenizer, monotone in words
    text, used = shared_context(None, 3, 100, count)
    assert used == count(text) <= 100 and used >= 95
    assert shared_context(None, 3, 100, count) == (text, used)  # seeded
    assert shared_context(None, 4, 100, count)[0] != text
    given, n = shared_context("alpha beta", 0, 7, lambda t: len(t.split()))
    assert given == "alpha beta alpha beta alpha beta alpha" and n == 7
    assert fit(["a"] * 10, 0, lambda t: len(t.split())) == ("", 0)
    assert with_context("", "q") == "q" and with_context("ctx", "q") == "ctx\n\nq"


def test_unseeded_fillers_keep_the_target_seed():
    s = Sampling(0.7, 1.0, 0, 5, 8, unseeded_fillers=True)
    assert s.seed_for(2, 2) == 5 and s.seed_for(0, 2) is None
    assert Sampling(0.7, 1.0, 0, 5, 8).seed_for(0, 2) is not None


# -- the statistics and the gate --------------------------------------------------------------

def _summary(diverged: list[int], compared: list[int], lp: list[float] | None = None) -> pd.DataFrame:
    n = len(diverged)
    return pd.DataFrame({
        "cell_id": [f"c{i}" for i in range(n)], "prompt_id": ["p"] * n, "batch_size": [8] * n, "runs": compared,
        "status": ["ok"] * n, "compared": compared, "diverged": diverged, "n_failed": [0] * n, "error": [""] * n,
        "match_rate": [1 - d / c for d, c in zip(diverged, compared)], "unique_outputs": [1] * n,
        "logprobs_identical": lp or [math.nan] * n, "logprobs_compared": compared if lp else [0] * n,
    })


def test_negative_control_fails_without_divergence_and_passes_with_it():
    rule = Expectation(divergence_rate_min=0.0)
    none = gate.evaluate([rule], _summary([0, 0], [10, 10]), pd.DataFrame())[0]
    assert not none.passed and "0/20 compared runs diverged" in none.detail
    some = gate.evaluate([rule], _summary([0, 1], [10, 10]), pd.DataFrame())[0]
    assert some.passed
    strict = gate.evaluate([Expectation(divergence_rate_min=0.25)], _summary([0, 3], [10, 10]), pd.DataFrame())[0]
    assert not strict.passed and "3/20" in strict.detail
    assert gate.evaluate([Expectation(divergence_rate_min=0.1)], _summary([0, 3], [10, 10]), pd.DataFrame())[0].passed


def test_logprob_rule_judges_only_compared_logprobs():
    rule = Expectation(logprobs_identical_min=1.0)
    assert gate.evaluate([rule], _summary([0], [4], [1.0]), pd.DataFrame())[0].passed
    failed = gate.evaluate([rule], _summary([0], [4], [0.5]), pd.DataFrame())[0]
    assert not failed.passed and "0.500 of runs with bitwise-equal" in failed.detail
    nothing = gate.evaluate([rule], _summary([0], [4]), pd.DataFrame())[0]
    assert not nothing.passed and "judged nothing" in nothing.detail


def test_logprob_difference_is_bitwise():
    assert divergence.logprob_difference([-1.0, -0.5], [-1.0, -0.5], 9) == (None, 0.0)
    step, gap = divergence.logprob_difference([-1.0, -0.5, -2.0], [-1.0, -0.5000001, -3.0], 9)
    assert step == 1 and gap == pytest.approx(1.0)
    assert divergence.logprob_difference([-1.0, -0.5, -2.0], [-1.0, -0.5, -3.0], 2) == (None, 0.0)  # only shared steps
    assert divergence.logprob_difference([0.0], [-0.0], 1)[0] == 0  # not bitwise equal, though ==


# -- the real llama.cpp engine --------------------------------------------------------------

EXPERIMENT = """
name: cache-axes-test
prompts: prompts.yaml
repeats: 1
max_tokens: 12
probe_prefill: true
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  dtype: [f32]
  batch_size: [1, 3]
  prefix_cache: [off, cold, warm]
  context_tokens: [0, 40]
  llamacpp.n_ubatch: [16, 512]
include:
  - {kv_cache_dtype: fp8, batch_size: 1, prefix_cache: off, context_tokens: 0, llamacpp.n_ubatch: 512}
  - {kv_cache_dtype: q8_0, batch_size: 3, prefix_cache: off, context_tokens: 40, llamacpp.n_ubatch: 512}
  - {prefill_chunk: 8, batch_size: 3, prefix_cache: warm, context_tokens: 40, llamacpp.n_ubatch: 512}
engine_options:
  llamacpp: {n_threads: 2}
"""


@pytest.fixture(scope="module")
def cache_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    run_experiment(root, EXPERIMENT)
    results = open_results(root / "out")
    return results, results.read_rows()


@needs_llama
def test_warm_reuses_the_prompt_and_cold_does_not(cache_rows):
    _, rows = cache_rows
    ok = rows[rows.status == "ok"]
    warm, other = ok[ok.prefix_cache == "warm"], ok[ok.prefix_cache != "warm"]
    assert len(warm) and len(other)
    assert (warm.cached_tokens == warm.prompt_tokens - 1).all() and (warm.cached_tokens > 0).all()
    assert (other.cached_tokens == 0).all()


@needs_llama
def test_context_tokens_lengthen_every_prompt_by_the_fitted_context(cache_rows):
    _, rows = cache_rows
    ok = rows[(rows.status == "ok") & (rows.prefix_cache == "off") & (rows.batch_size == 1)]
    by = ok.groupby(["context_tokens", "prompt_id"]).prompt_tokens.first().unstack(0)
    assert (ok[ok.context_tokens == 40].context_tokens_used.between(36, 40)).all()
    assert ((by[40] - by[0]).between(36, 44)).all()  # the context plus its separator


@needs_llama
def test_swept_options_and_axes_reach_the_engine(cache_rows):
    _, rows = cache_rows
    ok = rows[rows.status == "ok"]
    info = ok.engine_info.map(json.loads)
    assert (info.map(lambda i: i["n_ubatch"]).astype(str) == ok["llamacpp.n_ubatch"].where(
        ok.prefill_chunk == "auto", ok.prefill_chunk)).all()
    assert set(ok["llamacpp.n_ubatch"]) == {"16", "512"}
    assert set(info[ok.kv_cache_dtype == "q8_0"].map(lambda i: i["kv_cache_type"])) == {"q8_0"}
    assert set(info[ok.prefill_chunk == "8"].map(lambda i: i["prefill_step"])) == {8}
    refused = rows[rows.kv_cache_dtype == "fp8"]
    assert set(refused.status) == {"unsupported"} and "no KV cache of type 'fp8'" in refused.error.iloc[0]


@needs_llama
def test_bitwise_logprobs_agree_with_the_stored_arrays(cache_rows):
    """Whatever this machine makes differ (batching an F32 model usually moves log-probabilities,
    but that is the hardware's business), the verdicts must be what the stored arrays say."""
    results, rows = cache_rows
    ok = divergence.against_reference(rows, results.tokens_for, {"batch_size": 1}, (), results.logprobs_for)
    compared = ok[ok.logprobs_identical.notna()]
    assert len(compared) == len(ok[ok.ref_hash.notna()]) > 0
    lp = rows.set_index("logprobs_hash")["logprobs"].to_dict()
    for row in compared.itertuples():
        mine, ref = np.asarray(lp[row.logprobs_hash], np.float32), np.asarray(lp[row.ref_logprobs_hash], np.float32)
        same = len(mine) == len(ref) and (mine.view(np.uint32) == ref.view(np.uint32)).all()
        assert bool(row.logprobs_identical) == (row.matched == 1 and same)
        if row.logprobs_identical:
            assert row.logprob_max_abs_diff == 0 and math.isnan(row.logprob_first_diff)


@needs_llama
def test_tokens_agree_but_one_log_probability_moved(cache_rows):
    """Real rows where tokens and log-probabilities agree bit for bit (cold against off: the same
    computation), then one step's log-probability moved by one float32 ulp: only the bitwise
    comparison sees it."""
    results, rows = cache_rows
    summary = metrics.summarize(rows, results.tokens_for, {"prefix_cache": "off"}, (), results.logprobs_for)
    rule = [Expectation(where={"prefix_cache": "cold"}, logprobs_identical_min=1.0)]
    assert gate.evaluate(rule, summary, pd.DataFrame())[0].passed
    cold = rows[(rows.prefix_cache == "cold") & (rows.status == "ok")].index[0]
    moved = np.array(rows.at[cold, "logprobs"], dtype=np.float32)
    moved[2] = np.nextafter(moved[2], np.float32(0))
    edited = rows.copy()
    edited.at[cold, "logprobs_hash"] = "moved"
    stored = results.logprobs_for

    def logprobs_for(hashes):
        return stored(hashes - {"moved"}) | ({"moved": list(moved)} if "moved" in hashes else {})

    ok = divergence.against_reference(edited, results.tokens_for, {"prefix_cache": "off"}, (), logprobs_for)
    row = ok.loc[cold]
    assert row.matched == 1 and not row.logprobs_identical
    assert row.logprob_first_diff == 2 and 0 < row.logprob_max_abs_diff < 1e-5
    summary = metrics.summarize(edited, results.tokens_for, {"prefix_cache": "off"}, (), logprobs_for)
    verdict = gate.evaluate(rule, summary, pd.DataFrame())[0]
    assert not verdict.passed and "bitwise-equal" in verdict.detail


@needs_llama
def test_prefill_probe_compares_decode_with_one_prefill(cache_rows):
    _, rows = cache_rows
    ok = rows[rows.status == "ok"]
    assert (ok.prefill_probe_steps == ok.n_tokens + (ok.finish_reason == "stop")).all()
    assert ok.prefill_probe_steps_differed.between(0, ok.prefill_probe_steps).all()
    # whether decoding and prefilling agree bit for bit is the hardware's business (README numbers)
    assert (ok.prefill_probe_max_abs_diff >= 0).all()
    assert ((ok.prefill_probe_steps_differed > 0) == ok.prefill_probe_first_diff_step.notna()).all()
    # the exact per-step KL: zero where no logit moved, never negative, max >= mean
    assert (ok[ok.prefill_probe_steps_differed == 0].prefill_probe_kl_max == 0).all()
    assert (ok.prefill_probe_kl_max >= ok.prefill_probe_kl_mean).all() and (ok.prefill_probe_kl_mean >= 0).all()


@needs_llama
def test_negative_control_on_real_rows(cache_rows):
    results, rows = cache_rows
    rule = [Expectation(where={"prefix_cache": "cold"}, divergence_rate_min=0.0)]
    # in process, cold computes what off computes: a control comparing them finds nothing, and fails
    against_off = metrics.summarize(rows, results.tokens_for, {"prefix_cache": "off"}, (), results.logprobs_for)
    verdict = gate.evaluate(rule, against_off, pd.DataFrame())[0]
    assert not verdict.passed and " 0/" in verdict.detail
    assert (against_off[against_off.prefix_cache == "cold"].logprobs_identical == 1).all()
    # a 40-token context in front of each prompt does change the outputs: the control passes
    rule = [Expectation(where={"context_tokens": 40}, divergence_rate_min=0.0)]
    against_none = metrics.summarize(rows, results.tokens_for, {"context_tokens": 0}, (), results.logprobs_for)
    assert gate.evaluate(rule, against_none, pd.DataFrame())[0].passed
