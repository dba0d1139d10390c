"""The filler_tokens axis: every batch-mate's prompt made N tokens long with seeded words, the target as
written. The tokens are counted by the real llama.cpp tokenizer of the shipped model."""

from __future__ import annotations

import pytest

from harness.core.errors import ConfigError
from harness.experiment.config import load_experiment
from harness.experiment.context import padded
from harness.experiment.matrix import expand

from .conftest import PROMPTS, needs_llama, run_experiment

EXPERIMENT = """
name: mates
prompts: prompts.yaml
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 3]
{extra}
"""


@pytest.fixture(scope="module")
def engine():
    from harness.engines.base import LoadSpec
    from harness.engines.registry import engine_class

    spec = LoadSpec(engine="llamacpp", model="smollm2-135m", dtype="auto", gpu="cpu", batch_invariant=False,
                    options={})
    with engine_class("llamacpp")(spec, lambda _: None) as loaded:
        yield loaded


@needs_llama
@pytest.mark.parametrize("tokens", [16, 200])
def test_each_mate_is_padded_to_the_wanted_tokens_before_its_own_text(engine, tokens):
    fillers = ["What is 2 + 2?", "Name a color.", "Write a haiku about rain."]
    made = [padded(f, tokens, f"0|filler-{i:02d}", engine.count_tokens) for i, f in enumerate(fillers)]
    for filler, text in zip(fillers, made):
        assert text.endswith("\n\n" + filler)
        # as many tokens as fit: one more word would pass the wanted length
        assert tokens - 3 <= engine.count_tokens(text) <= tokens
    assert len({t.split()[0] for t in made}) > 1  # seeded per filler: mates share no common prefix
    assert padded(fillers[0], tokens, "0|filler-00", engine.count_tokens) == made[0]
    assert padded(fillers[0], 2, "0|filler-00", engine.count_tokens) == fillers[0]  # already that long


def test_the_axis_enters_ids_only_away_from_its_default_and_refuses_bad_values(write):
    write("prompts.yaml", PROMPTS)
    plain = {c.id for c in expand(load_experiment(write("a.yaml", EXPERIMENT.format(extra=""))))}
    spelled = {c.id for c in expand(load_experiment(write("b.yaml", EXPERIMENT.format(extra="  filler_tokens: [0]"))))}
    both = expand(load_experiment(write("c.yaml", EXPERIMENT.format(extra="  filler_tokens: [0, 256]"))))
    assert plain == spelled and len(both) == 4 and plain < {c.id for c in both}
    with pytest.raises(ConfigError, match=r"c.yaml:9: matrix.filler_tokens: filler_tokens -1 is out of range; "
                                          r"allowed: 0 \(the fillers as written\) to 1048576"):
        load_experiment(write("c.yaml", EXPERIMENT.format(extra="  filler_tokens: [-1]")))
    copies = EXPERIMENT.format(extra="  filler_tokens: [0, 64]") + "batch_fill: copies\n"
    with pytest.raises(ConfigError, match="batch_fill: copies has no single target or fillers; it cannot be "
                                          "combined with filler_tokens > 0"):
        load_experiment(write("d.yaml", copies))


@needs_llama
def test_runs_beside_long_mates_land_with_the_target_as_written(tmp_path):
    store = run_experiment(tmp_path, EXPERIMENT.format(extra="  filler_tokens: [0, 96]"))
    rows = store.read_rows()
    assert len(rows) == 2 * 2 * 2 * 2 and set(rows["status"]) == {"ok"}
    # the target's own prompt is the same length whatever its mates are
    assert rows.groupby("prompt_id")["prompt_tokens"].nunique().eq(1).all()
    assert set(rows["filler_tokens"]) == {0, 96} and rows["cell_id"].nunique() == 4
