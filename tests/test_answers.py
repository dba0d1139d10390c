"""Answers: parse rules, hand-computed TARr/TARa/accuracy/best/worst, the bootstrap, gate rules, bad rules."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.analysis import answer_metrics
from harness.core.errors import ConfigError
from harness.experiment import answers
from harness.experiment.answers import ParseRule
from harness.experiment.axes import LATER_AXES_DEFAULTS
from harness.experiment.config import load_experiment
from harness.results.schema import SCHEMA_VERSION

from .conftest import needs_llama, row_for, run_experiment, run_harness, synthetic_folder


@pytest.mark.parametrize(("rule", "text", "expected"), [
    ("number", "There are 12 apples, so the answer is 1,234.50.", "1234.5"),
    ("number", "She has -3 left", "-3"),
    ("number", "42.0", "42"),
    ("number", "no digits here", None),
    ({"kind": "choice"}, "The answer is (C).", "C"),
    ({"kind": "choice"}, "Answer: b", "B"),
    ({"kind": "choice"}, "B) Dolphin", "B"),
    ({"kind": "choice", "options": ["A", "B"]}, "I think D, no wait, A.", "A"),
    ({"kind": "choice"}, "I am not sure", None),
    ({"kind": "regex", "pattern": r"city: (\w+)"}, "The city: Paris, yes", "Paris"),
    ({"kind": "regex", "pattern": r"\d+ km"}, "about 40 km away", "40 km"),
    ("exact", "  Paris. ", "paris"),
    ({"kind": "json", "field": "result.value"}, 'Sure: {"result": {"value": 7}} done', "7"),
    ({"kind": "json", "field": "name"}, 'x {"name": "Ada"}', "Ada"),
    ({"kind": "json", "field": "name"}, "not json {at all", None),
])
def test_parse_rules(rule, text, expected):
    assert answers.parse(text, ParseRule.model_validate(rule)) == expected


def test_expected_answers_compare_in_the_parsed_form():
    number, choice = ParseRule.model_validate("number"), ParseRule.model_validate({"kind": "choice"})
    assert answers.columns("so 1,000 in all", "1000", number) == {
        "answer_parsed": "1000", "answer_expected": "1000", "answer_correct": True}
    assert answers.columns("It is B", " b ", choice)["answer_correct"] is True  # lowercase a/b alone are words
    assert answers.columns("no idea", "7", number)["answer_correct"] is False
    assert answers.columns("7", None, number)["answer_correct"] is None  # a rule without an answer
    assert answers.columns("7", None, None) == {}


@pytest.mark.parametrize(("rule", "message"), [
    ({"kind": "regex"}, "a regex rule needs 'pattern'"),
    ({"kind": "regex", "pattern": "("}, "pattern does not compile"),
    ({"kind": "json"}, "a json rule needs 'field'"),
    ({"kind": "choice", "options": ["AB"]}, "options are single letters"),
    ("numbr", "number"),
])
def test_bad_rules_are_refused_at_load_with_file_and_line(write, rule, message):
    import yaml

    prompts = {"prompts": [{"id": "q", "text": "2+2?", "answer": 4, "parse": rule}]}
    write("p.yaml", yaml.safe_dump(prompts))
    path = write("exp.yaml", "name: e\nprompts: p.yaml\nmatrix: {model: [m]}\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_experiment(path)
    assert "p.yaml:" in str(info.value) and "parse" in str(info.value)


def test_an_answer_without_a_rule_is_refused(write):
    write("p.yaml", "prompts:\n  - {id: q, text: '2+2?'}\n  - {id: r, text: '3+3?', answer: 6}\n")
    path = write("exp.yaml", "name: e\nprompts: p.yaml\nmatrix: {model: [m]}\n")
    with pytest.raises(ConfigError, match=r"p.yaml:3: prompts\[1\]: an answer needs a parse rule"):
        load_experiment(path)


def test_answers_change_cell_ids_only_where_given(write):
    write("a.yaml", "prompts:\n  - {id: q, text: '2+2?'}\n")
    write("b.yaml", "prompts:\n  - {id: q, text: '2+2?', answer: 4, parse: number}\n")
    write("c.yaml", "prompts:\n  - {id: q, text: '2+2?', answer: 5, parse: number}\n")
    fps = [load_experiment(write(f"e{n}.yaml", f"name: e\nprompts: {n}.yaml\nmatrix: {{model: [m]}}\n"))
           .prompt_set.fingerprint() for n in "abc"]
    assert len(set(fps)) == 3  # another answer key is another experiment: results do not mix
    plain = load_experiment(write("ei.yaml", "name: e\nprompts: [{id: q, text: '2+2?'}]\nmatrix: {model: [m]}\n"))
    assert plain.prompt_set.fingerprint() == fps[0]


# Hand-made rows: 3 prompts x 3 repeats at batch 1 and batch 4 (answers known, tokens = a hash of the text)
#   batch 1: q1 5,5,5 (right: 5)   q2 7,7,7 (right: 8)        q3 A,A,A (right: A)
#   batch 4: q1 5,6,5              q2 8,7,8                   q3 A,A,A, but raw outputs differ
ANSWERS = {
    1: {"q1": ["5", "5", "5"], "q2": ["7", "7", "7"], "q3": ["A", "A", "A"]},
    4: {"q1": ["5", "6", "5"], "q2": ["8", "7", "8"], "q3": ["A", "A", "A"]},
}
RIGHT = {"q1": "5", "q2": "8", "q3": "A"}


def _rows() -> pd.DataFrame:
    base = dict(model="m", engine="llamacpp", dtype="auto", gpu="any", batch_invariant=False, seed=0,
                temperature=0.0, top_p=1.0, top_k=0, max_tokens=8, status="ok", **LATER_AXES_DEFAULTS)
    out = []
    for batch, per_prompt in ANSWERS.items():
        for prompt, answers_ in per_prompt.items():
            for repeat, given in enumerate(answers_):
                raw = f"{given}-{repeat}" if (batch == 4 and prompt == "q3") else given
                out.append(base | {"batch_size": batch, "cell_id": f"b{batch}", "prompt_id": prompt, "repeat": repeat,
                                   "output_hash": raw, "n_tokens": 3 + (repeat if batch == 4 else 0),
                                   "answer_parsed": given, "answer_expected": RIGHT[prompt],
                                   "answer_correct": given == RIGHT[prompt]})
    return pd.DataFrame(out)


def test_answer_statistics_by_hand():
    table = answer_metrics.answer_summary(_rows(), {"q1", "q2", "q3"}, {"batch_size": 1}).set_index("batch_size")
    b1, b4 = table.loc[1], table.loc[4]
    # batch 1: every prompt's 3 runs identical (raw and answer); right: q1 3/3, q2 0/3, q3 3/3
    assert (b1.tar_r, b1.tar_a) == (1.0, 1.0)
    assert b1.accuracy == pytest.approx(2 / 3) and (b1.best, b1.worst, b1.spread) == (2 / 3, 2 / 3, 0.0)
    # against its own first repeat: repeats 1 and 2 agree on every prompt
    assert (b1.answer_agreement, b1.prompts_changed) == (1.0, 0.0) and np.isnan(b1.accuracy_diff)
    # batch 4: raw outputs identical for no prompt (q1, q2 answers vary; q3 answers same, texts differ)
    assert b4.tar_r == 0.0 and b4.tar_a == pytest.approx(1 / 3)
    # accuracy: q1 2/3, q2 2/3, q3 3/3 -> 7/9; best: all three prompts right once; worst: only q3
    assert b4.accuracy == pytest.approx(7 / 9) and b4.best == 1.0 and b4.worst == pytest.approx(1 / 3)
    assert b4.spread == pytest.approx(2 / 3)
    # against batch 1's first answers (5, 7, A): q1 2/3 agree, q2 1/3, q3 3/3 -> 6/9; q1 and q2 changed
    assert b4.answer_agreement == pytest.approx(6 / 9) and b4.prompts_changed == pytest.approx(2 / 3)
    assert b4.accuracy_diff == pytest.approx(7 / 9 - 2 / 3)
    assert b4.diff_low <= b4.accuracy_diff <= b4.diff_high and b4.accuracy_low <= b4.accuracy <= b4.accuracy_high
    assert (b4.length_spread_median, b4.length_spread_max) == (2.0, 2)


def test_bootstrap_is_seeded():
    values = np.random.default_rng(1).random(50)
    assert answer_metrics.bootstrap(values, 7) == answer_metrics.bootstrap(values, 7)
    assert answer_metrics.bootstrap(values, 7) != answer_metrics.bootstrap(values, 8)  # the seed is used
    low, high = answer_metrics.bootstrap(values, 0)
    assert 0 <= low < values.mean() < high <= 1
    assert answer_metrics.bootstrap(np.array([0.5, 0.5]), 0) == (0.5, 0.5)
    first = answer_metrics.answer_summary(_rows(), {"q1", "q2", "q3"}, {"batch_size": 1})
    again = answer_metrics.answer_summary(_rows(), {"q1", "q2", "q3"}, {"batch_size": 1})
    pd.testing.assert_frame_equal(first, again)


def _answer_folder(root):
    """A folder of the hand-made answers, through a real manifest, for the CLI and the gate."""
    import yaml

    prompts = [{"id": p, "text": f"question {p}", "answer": RIGHT[p], "parse": "exact"} for p in RIGHT]
    folder, cells = synthetic_folder(root, list(RIGHT), {"batch_size": [1, 4]}, repeats=3)
    spec = yaml.safe_load((root.parent / f"{root.name}.yaml").read_text())
    spec["prompts"] = prompts
    (root.parent / f"{root.name}.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_experiment(root.parent / f"{root.name}.yaml")
    folder.adopt(loaded)
    from harness.experiment.matrix import expand

    for cell in expand(loaded):
        batch = cell["batch_size"]
        rows = []
        for prompt, given in ANSWERS[batch].items():
            for repeat, answer in enumerate(given):
                tokens = [ord(c) for c in (f"{answer}{repeat}" if batch == 4 and prompt == "q3" else answer)]
                rows.append(row_for(cell, prompt, repeat, tokens, answer_parsed=answer, answer_expected=RIGHT[prompt],
                                    answer_correct=answer == RIGHT[prompt], text=answer, schema_version=3))
        folder.write_cell(cell.id, rows, "t")
    return folder


def test_summarize_answers_and_the_gate(tmp_path):
    import json

    folder = _answer_folder(tmp_path / "out")
    done = run_harness("summarize", str(folder.root), "--what", "answers", "--format", "json")
    assert done.returncode == 0, done.stderr
    recs = {r["batch_size"]: r for r in json.loads(done.stdout)}
    assert recs[4]["tar_a"] == pytest.approx(1 / 3) and recs[4]["accuracy"] == pytest.approx(7 / 9)
    table = run_harness("summarize", str(folder.root))
    assert "answers:" in table.stdout and "TARa" in table.stdout
    (tmp_path / "rules.yaml").write_text(
        "expect:\n  - where: {batch_size: 4}\n    answer_agreement_min: 0.9\n"
        "  - where: {batch_size: 4}\n    accuracy_drop_max: 0.0\n")
    junit = tmp_path / "j.xml"
    gate = run_harness("check", str(folder.root), "--expect", str(tmp_path / "rules.yaml"), "--junit", str(junit))
    assert gate.returncode == 1
    assert "66.7% of answers equal the reference" in junit.read_text()  # agreement 6/9 < 0.9
    assert 'failures="1"' in junit.read_text()  # accuracy went up (+11.1 points): no drop
    (tmp_path / "drop.yaml").write_text("expect:\n  - where: {batch_size: 1}\n    accuracy_drop_max: 0.1\n")
    drop = run_harness("check", str(folder.root), "--expect", str(tmp_path / "drop.yaml"), "-r", "batch_size=4",
                       "--junit", str(junit))
    assert drop.returncode == 1  # against batch 4, batch 1 is 11.1 points lower
    assert "accuracy -11.1 points" in junit.read_text()


def test_plot_and_report_show_answers(tmp_path):
    folder = _answer_folder(tmp_path / "out")
    plotted = run_harness("plot", str(folder.root), "-o", str(tmp_path / "plots"), "-f", "png")
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "plots" / "answers.png").read_bytes()[:4] == b"\x89PNG"
    lines = (tmp_path / "plots" / "answers.csv").read_text().splitlines()
    assert lines[0].startswith("series,model,engine") and len(lines) == 3  # batch 1 and batch 4
    reported = run_harness("report", str(folder.root), "-o", str(tmp_path / "r.html"))
    assert reported.returncode == 0, reported.stderr
    page = (tmp_path / "r.html").read_text()
    assert '"answers":[{' in page and '"tar_a":' in page and "answerTable" in page


@needs_llama
def test_real_rows_carry_the_parsed_answer(tmp_path):
    experiment = """
name: answers-real
prompts:
  - {id: sum, text: "What is 2 + 3? Answer with the number only.", answer: 5}
  - {id: pick, text: "Which is a color? A) Blue B) Table. Answer with the letter.", answer: A,
     parse: {kind: choice, options: [A, B]}}
  - {id: free, text: "hello"}
parse: number
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
engine_options:
  llamacpp: {n_threads: 2}
"""
    store = run_experiment(tmp_path, experiment)
    rows = store.read_rows().set_index(["prompt_id", "repeat"])
    assert (rows.status == "ok").all() and (rows.schema_version == SCHEMA_VERSION).all()
    number, choice = ParseRule.model_validate("number"), ParseRule.model_validate({"kind": "choice", "options": ["A", "B"]})
    for repeat in (0, 1):
        summed, picked = rows.loc[("sum", repeat)], rows.loc[("pick", repeat)]
        assert summed.answer_expected == "5" and summed.answer_parsed == answers.parse(summed.text, number)
        assert summed.answer_correct == (summed.answer_parsed == "5")
        assert picked.answer_expected == "A" and picked.answer_parsed == answers.parse(picked.text, choice)
    free = rows.loc[("free", 0)]
    assert pd.isna(free.answer_expected) and pd.isna(free.answer_parsed) and pd.isna(free.answer_correct)


def test_prompts_with_one_run_are_left_out_of_tar_and_one_prompt_gives_no_interval():
    rows = _rows()
    # q2 at batch 4 keeps one ok run: it agrees with itself, which says nothing about repeatability
    rows = rows[~((rows["batch_size"] == 4) & (rows["prompt_id"] == "q2") & (rows["repeat"] > 0))]
    b4 = answer_metrics.answer_summary(rows, {"q1", "q2", "q3"}, {"batch_size": 1}).set_index("batch_size").loc[4]
    # of q1 (answers vary) and q3 (answers same, texts differ), computed here by hand
    assert b4.single_run_prompts == 1 and b4.prompts == 3
    assert b4.tar_r == 0.0 and b4.tar_a == 0.5
    one = answer_metrics.answer_summary(rows[rows["prompt_id"] == "q1"], {"q1"}, {"batch_size": 1})
    assert one[["accuracy_low", "accuracy_high", "diff_low", "diff_high"]].isna().all().all()
    assert not one["accuracy"].isna().any()


def test_answer_agreement_for_an_engine_without_the_swept_option():
    # a swept llamacpp option: the same answers from llama.cpp (n_batch 64) and from vLLM, whose
    # cells have no value for that option
    ours = _rows().assign(engine="llamacpp", **{"llamacpp.n_batch": "64"})
    theirs = _rows().assign(engine="vllm", **{"llamacpp.n_batch": None})
    theirs["cell_id"] = "v" + theirs["cell_id"]
    table = answer_metrics.answer_summary(pd.concat([ours, theirs], ignore_index=True), {"q1", "q2", "q3"},
                                          {"batch_size": 1})
    assert len(table) == 4
    for engine in ("llamacpp", "vllm"):
        b4 = table[(table["engine"] == engine) & (table["batch_size"] == 4)].iloc[0]
        assert b4.answer_agreement == pytest.approx(6 / 9) and b4.prompts_changed == pytest.approx(2 / 3)
