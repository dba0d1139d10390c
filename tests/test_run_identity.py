"""Identity at the level that changes (harness.run.reuse): an edit of an experiment reruns only the runs it
changes. Real llama.cpp runs; generations are counted by the run id a row carries."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import yaml

from tests.conftest import needs_llama, run_harness

pytestmark = needs_llama

PROMPTS = {
    "prompts": [{"id": "hello", "text": "hello"}, {"id": "fox", "text": "Write a two-sentence story about a fox."}],
    "fillers": ["What is 2 + 2?", "Name a color.", "Write a haiku about rain.", "What is the capital of Italy?"],
}
EXPERIMENT = """
name: identity
prompts: prompts.yaml
repeats: {repeats}
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 3]
"""


def _run(root: Path, prompts: dict, repeats: int = 2) -> tuple[str, pd.DataFrame]:
    """Write the prompts and the experiment, run it for real into root/out: the run's id and the
    current experiment's rows."""
    from harness.experiment.config import load_experiment
    from harness.results.folder import ResultsFolder
    from harness.results.folder_rows import open_results
    from harness.run.runner import Runner

    (root / "prompts.yaml").write_text(yaml.safe_dump(prompts))
    (root / "exp.yaml").write_text(EXPERIMENT.format(repeats=repeats))
    runner = Runner(load_experiment(root / "exp.yaml"), ResultsFolder(root / "out"))
    result = runner.run()
    assert not result.failed
    return runner.run_id, open_results(root / "out").read_rows()


def _values(frame: pd.DataFrame, column: str) -> list:
    return [list(v) if column == "filler_ids" else v for v in frame[column]]


def _new(rows: pd.DataFrame, run_id: str) -> pd.DataFrame:
    return rows[rows["run_id"] == run_id]


def test_adding_a_prompt_runs_only_its_rows_and_matches_a_run_from_scratch(tmp_path):
    first_id, first = _run(tmp_path, PROMPTS)
    assert len(first) == 2 * 2 * 2 and set(first["status"]) == {"ok"}
    more = {**PROMPTS, "prompts": PROMPTS["prompts"] + [{"id": "sky", "text": "Why is the sky blue?"}]}
    second_id, second = _run(tmp_path, more)
    made = _new(second, second_id)
    assert len(made) == 2 * 2 and set(made["prompt_id"]) == {"sky"}  # 2 batch sizes x 2 repeats, nothing else
    assert len(second) == 3 * 2 * 2 and set(second["cell_id"]).isdisjoint(first["cell_id"])
    key = ["batch_size", "prompt_id", "repeat"]
    kept = second[second["prompt_id"] != "sky"].set_index(key).sort_index()
    before = first.set_index(key).sort_index()
    for column in ("run_id", "output_hash", "filler_ids", "batch_position", "run_key", "started_at"):
        assert _values(kept, column) == _values(before, column), column

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _, fresh = _run(scratch, more)
    fresh = fresh.set_index(key).sort_index()
    merged = second.set_index(key).sort_index()
    for column in ("output_hash", "filler_ids", "batch_position", "run_key"):
        assert _values(merged, column) == _values(fresh, column), column
    # the statistics of both folders agree (timing aside)
    stats = [json.loads(run_harness("summarize", str(d / "out"), "--format", "json").stdout) for d in (tmp_path, scratch)]
    for records in stats:  # the same cell ids in both (one experiment); speed is the one thing that may differ
        for record in records:
            del record["tokens_per_s_median"]
    assert stats[0] == stats[1] and stats[0]


def test_a_filler_edit_reruns_only_the_batches_that_used_it(tmp_path):
    _, first = _run(tmp_path, PROMPTS)
    used = first[first["filler_ids"].map(lambda ids: "filler-01" in list(ids))]
    assert 0 < len(used) < len(first[first["batch_size"] == 3])  # the draw uses it in some batches, not all
    edited = {**PROMPTS, "fillers": [f if i != 1 else "Name a colour of the rainbow." for i, f in enumerate(PROMPTS["fillers"])]}
    second_id, second = _run(tmp_path, edited)
    made = _new(second, second_id)
    assert sorted(zip(made["prompt_id"], made["repeat"])) == sorted(zip(used["prompt_id"], used["repeat"]))
    assert set(made["batch_size"]) == {3}


def test_parse_rules_and_answers_are_read_again_and_more_repeats_run_only_the_new_ones(tmp_path):
    _run(tmp_path, PROMPTS)
    rule = {"kind": "regex", "pattern": "([A-Za-z]+)"}  # the first word of the output
    answered = {**PROMPTS, "prompts": [{**PROMPTS["prompts"][0], "answer": "Hello", "parse": rule}]
                + PROMPTS["prompts"][1:]}
    second_id, second = _run(tmp_path, answered)
    assert _new(second, second_id).empty  # nothing generated: the answers are read from the stored text
    hello = second[second["prompt_id"] == "hello"]
    assert hello["answer_expected"].notna().all() and second[second["prompt_id"] == "fox"]["answer_expected"].isna().all()
    # the stored text read here without the harness: its first word, and whether it is "Hello"
    words = hello["text"].map(lambda t: (re.findall(r"[A-Za-z]+", t) or [None])[0])
    assert hello["answer_parsed"].tolist() == words.tolist()
    assert hello["answer_correct"].tolist() == [w == "Hello" for w in words]

    third_id, third = _run(tmp_path, answered, repeats=3)
    made = _new(third, third_id)
    assert sorted(set(made["repeat"])) == [2] and len(made) == 2 * 2


#: a field of the load that made a row, and a value another load (node, driver, build, harness) would give it
OTHER_LOAD = {
    "host": "another-node", "gpu_driver": "550.54.15", "cuda_version": "12.4",
    "engine_info": '{"system_info": "CUDA : ARCHS = 890"}', "library_versions": '{"llama-cpp-python": "0.0.1"}',
    "git_commit": "0123abcd", "schema_version": 8, "env": '{"OMP_NUM_THREADS": "1"}',
}


def test_runs_of_another_load_are_not_reused_and_kept_runs_keep_what_they_ran_on(tmp_path):
    """Reuse is pairing: a stored run that differs from the load about to run in any field of
    SAME_LOAD is generated again; one that matches is kept with its own "what ran"."""
    from harness.results import provenance_fields
    from harness.results.store import Store

    assert set(OTHER_LOAD) <= set(provenance_fields.SAME_LOAD)
    _run(tmp_path, PROMPTS, repeats=3)
    store = Store(tmp_path / "out")
    changed: dict[tuple, str] = {}
    fields = iter(OTHER_LOAD.items())
    for path in store.cell_files():  # one stored run per field, each as if another load had made it
        rows = pq.read_table(path).to_pylist()
        for row in rows:
            field, value = next(fields, ("device", "stored-device"))
            row[field] = value
            changed[(row["batch_size"], row["prompt_id"], row["repeat"])] = field
        store.write_cell(path.stem, rows)
    more = {**PROMPTS, "prompts": PROMPTS["prompts"] + [{"id": "sky", "text": "Why is the sky blue?"}]}
    second_id, second = _run(tmp_path, more, repeats=3)
    assert len(second) == 3 * 3 * 2
    for _, row in second[second["prompt_id"] != "sky"].iterrows():
        field = changed[(row["batch_size"], row["prompt_id"], row["repeat"])]
        if field == "device":  # the same load: kept, with the device it was generated on
            assert row["run_id"] != second_id and row["device"] == "stored-device"
        else:
            assert row["run_id"] == second_id, field
    assert (second[second["run_id"] == second_id]["device"] != "stored-device").all()
    assert sum(f == "device" for f in changed.values()) == 12 - len(OTHER_LOAD)
