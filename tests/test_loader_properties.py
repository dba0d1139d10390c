"""Property tests: whatever bytes or YAML land in an experiment or prompt file, loading it ends in a
valid experiment or one clear error (HarnessError: file, line, what), never another exception."""

from __future__ import annotations

import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.core.errors import HarnessError
from harness.experiment.config import load_experiment
from harness.experiment.prompts import load_prompt_set

from .conftest import PROMPTS

KEYS = ["name", "prompts", "matrix", "repeats", "max_tokens", "fillers", "include", "exclude", "engine_options",
        "context", "expect", "seed_control", "probe_logits", "model", "engine", "batch_size", "dtype", "gpu",
        "temperature", "seed", "id", "text", "answer", "parse", "llamacpp", "n_threads", "kind", "where"]
scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.sampled_from(KEYS + ["prompts.yaml", "smollm2-135m", "llamacpp", "f32"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5), max_leaves=25)
GOOD = {"name": "t", "prompts": "prompts.yaml", "repeats": 2, "max_tokens": 8,
        "matrix": {"model": ["smollm2-135m"], "batch_size": [1, 2], "temperature": [0.0]}}


def _loads_or_says_why(load, path) -> None:
    try:
        load(path)
    except HarnessError as exc:
        assert str(exc).strip(), "an error without a message"


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.binary(max_size=400))
def test_random_bytes_as_an_experiment(tmp_path, data):
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_bytes(data)
    _loads_or_says_why(load_experiment, tmp_path / "exp.yaml")


@SETTINGS
@given(doc=values)
def test_random_yaml_as_an_experiment(tmp_path, doc):
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    _loads_or_says_why(load_experiment, tmp_path / "exp.yaml")


@SETTINGS
@given(path=st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=3), value=values)
def test_a_valid_experiment_with_one_value_replaced(tmp_path, path, value):
    """Near misses are what people write: a good experiment with one key set to something random."""
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else node
    node[path[-1]] = value
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(doc))
    _loads_or_says_why(load_experiment, tmp_path / "exp.yaml")


@SETTINGS
@given(text=st.text(alphabet=string.printable + "&*!|>{}[]:-#'\"\u00e9\u2028", max_size=300))
def test_random_text_as_a_prompt_file(tmp_path, text):
    (tmp_path / "prompts.yaml").write_text(text, encoding="utf-8")
    _loads_or_says_why(lambda p: load_prompt_set("prompts.yaml", tmp_path, "exp.yaml:2"), tmp_path / "prompts.yaml")


@SETTINGS
@given(doc=values)
def test_random_yaml_as_a_prompt_file(tmp_path, doc):
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump(doc))
    _loads_or_says_why(lambda p: load_prompt_set("prompts.yaml", tmp_path, "exp.yaml:2"), tmp_path / "prompts.yaml")
