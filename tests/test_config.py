"""Bad experiment files: exit code 2, a message naming file, line and field; nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand, group

from .conftest import PROMPTS, run_harness

GOOD = """
name: t
prompts: prompts.yaml
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2]
"""


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        (GOOD.replace("repeats: 2", "repeats: 2\ncolour: red"), 4, "colour: unknown key"),
        (GOOD.replace("batch_size: [1, 2]", "batch_size: [1, two]"), 8, "matrix.batch_size[1]"),
        (GOOD.replace("batch_size: [1, 2]", "batch_size: []"), 8, "empty list"),
        (GOOD.replace("batch_size: [1, 2]", "batch_size: [0]"), 8, "allowed: 1 to 1024"),
        (GOOD.replace("engine: [llamacpp]", "engine: [llamacp]"), 7, "unknown engine 'llamacp'"),
        (GOOD.replace("engine: [llamacpp]", "engine: [llamacpp]\n  colour: [red]"), 8, "allowed axes"),
        (GOOD.replace("max_tokens: 8", "max_tokens: -1"), 4, "max_tokens"),
        (GOOD.replace("prompts: prompts.yaml", "prompts: missing.yaml"), 2, "file not found"),
        (GOOD + "engine_options:\n  llamacpp:\n    n_thread: 2\n", 11, "n_thread: unknown key"),
        (GOOD + "exclude:\n  - {batch_size: 2, colour: 1}\n", 10, "unknown axis"),
        (GOOD.replace("top_p", "x") + "  top_p: [1.5]\n", 9, "0 < top_p <= 1"),
        (GOOD.replace("repeats: 2", "repeats: 2\nrepeats: 3"), 4, "duplicate key"),
        (GOOD.replace("name: t", "name: [t"), None, "invalid YAML"),
        (GOOD.replace("batch_size: [1, 2]", "batch_size: [true]"), 8, "batch_size true: a true/false value"),
        (GOOD.replace("batch_size: [1, 2]", "batch_size: 1\n  seed: no"), 9, "seed false: a true/false value"),
        (GOOD + "include:\n  - {temperature: yes}\n", 10, "include[0].temperature: temperature true"),
        (GOOD.replace("model: [smollm2-135m]", "model: [smollm2-135m, models/none.gguf]"), 6,
         "model 'models/none.gguf': no such file"),
        (GOOD + "include:\n  - {model: gone.gguf}\n", 10, "model 'gone.gguf': no such file"),
    ],
)
def test_bad_config_names_file_line_field(write, tmp_path, text, line, needle):
    write("prompts.yaml", PROMPTS)
    path = write("exp.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    message = str(info.value)
    assert needle in message
    assert str(path) in message
    if line is not None:
        assert f"exp.yaml:{line}:" in message


def test_bad_prompt_file_names_its_line(write):
    write("prompts.yaml", PROMPTS.replace("    text: \"hello\"", "    txt: \"hello\""))
    path = write("exp.yaml", GOOD)
    with pytest.raises(ConfigError, match=r"prompts.yaml:3: prompts\[0\].txt: unknown key; allowed: id, text"):
        load_experiment(path)


def test_batch_needs_fillers(write):
    write("prompts.yaml", PROMPTS.split("fillers:")[0])
    with pytest.raises(ConfigError, match="needs fillers"):
        load_experiment(write("exp.yaml", GOOD))


def test_cli_exit_code_2_and_nothing_written(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", GOOD.replace("batch_size: [1, 2]", "batch_size: []"))
    out = tmp_path / "out"
    proc = run_harness("run", "exp.yaml", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert "matrix.batch_size" in proc.stderr and "exp.yaml:8" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_plan_counts_generations_and_groups(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", GOOD.replace("engine: [llamacpp]", "engine: [llamacpp]\n  dtype: [auto, f16]"))
    proc = run_harness("plan", "exp.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "4 cells in 2 engine load(s)" in proc.stdout
    assert "2 prompts x 2 repeats x 4 cells = 16 generations" in proc.stdout


def test_cell_ids_stable_across_key_order(write):
    write("prompts.yaml", PROMPTS)
    a = expand(load_experiment(write("a.yaml", GOOD)))
    reordered = GOOD.replace(
        "  model: [smollm2-135m]\n  engine: [llamacpp]\n  batch_size: [1, 2]",
        "  batch_size: [1, 2]\n  engine: llamacpp\n  model: [smollm2-135m]",
    ).replace("repeats: 2\nmax_tokens: 8", "max_tokens: 8\nrepeats: 2")
    b = expand(load_experiment(write("b.yaml", reordered)))
    assert [c.id for c in a] == [c.id for c in b]
    c = expand(load_experiment(write("c.yaml", GOOD.replace("max_tokens: 8", "max_tokens: 9"))))
    assert not {x.id for x in a} & {x.id for x in c}  # a changed setting never reuses old results


def test_include_exclude_and_grouping(write):
    write("prompts.yaml", PROMPTS)
    text = GOOD.replace("batch_size: [1, 2]", "batch_size: [1, 2]\n  dtype: [auto, f16]") + (
        "exclude:\n  - {dtype: f16, batch_size: 2}\ninclude:\n  - {dtype: f32, batch_size: 4}\n"
    )
    cells = expand(load_experiment(write("exp.yaml", text)))
    got = sorted((c["dtype"], c["batch_size"]) for c in cells)
    assert got == [("auto", 1), ("auto", 2), ("f16", 1), ("f32", 4)]
    groups = group(cells)
    assert len(groups) == 3 and [len(g.cells) for g in groups] == [2, 1, 1]
    assert [c["batch_size"] for c in groups[0].cells] == [1, 2]



def test_an_include_that_sets_an_engine_option_the_matrix_does_not_sweep_is_a_cell_of_its_own(write):
    """It was dropped: the included cell took the matrix's settings and merged with the batch-1 cell,
    so a measurement of the option was silently one of the default."""
    write("prompts.yaml", PROMPTS)
    text = GOOD + "engine_options:\n  llamacpp: {n_threads: 2}\ninclude:\n  - {batch_size: 1, llamacpp.flash_attn: on}\n"
    cells = expand(load_experiment(write("exp.yaml", text)))
    got = sorted((c["batch_size"], c["llamacpp.flash_attn"], dict(c.engine_options)["flash_attn"]) for c in cells)
    assert got == [(1, "auto", "auto"), (1, "on", "on"), (2, "auto", "auto")]
    assert all(dict(c.engine_options)["n_threads"] == 2 for c in cells)
    with pytest.raises(ConfigError, match=r"exp2.yaml:\d+: include\[0\]\.llamacpp\.n_threads"):
        load_experiment(write("exp2.yaml", GOOD + "include:\n  - {batch_size: 1,\n     llamacpp.n_threads: 0}\n"))


def test_an_include_with_a_list_valued_engine_option_loads_and_its_errors_print_no_value(write):
    """Issue 65: `llama-server.extra_args: [...]` in an include entry was refused ("Input should be a valid
    list": the list was checked again as its canonical text), and the error printed the values, an
    --api-key included."""
    write("prompts.yaml", PROMPTS)
    text = GOOD + "include:\n  - {engine: llama-server, batch_size: 2, llama-server.extra_args: [--no-warmup]}\n"
    cells = expand(load_experiment(write("exp.yaml", text)))
    mine = [c for c in cells if c["engine"] == "llama-server"]
    assert len(mine) == 1 and dict(mine[0].engine_options)["extra_args"] == ["--no-warmup"]
    bad = GOOD + "include:\n  - {engine: llama-server, llama-server.n_parallel_extra: 1}\n"
    secret = GOOD + "include:\n  - {engine: llama-server, llama-server.extra_args: {--api-key: sk-abcdef0123456789xyz}}\n"
    with pytest.raises(ConfigError) as refused:
        load_experiment(write("exp2.yaml", secret))
    assert "include[0].llama-server.extra_args" in str(refused.value) and "sk-abcdef" not in str(refused.value)
    with pytest.raises(ConfigError, match="not an option of engine"):
        load_experiment(write("exp3.yaml", bad))


def test_a_null_engine_option_stays_null_when_swept(write):
    """A swept null read back from its canonical text 'None' reached the engine as the string 'None'."""
    write("prompts.yaml", PROMPTS)
    text = GOOD.replace("batch_size: [1, 2]", "batch_size: [1]\n  llamacpp.n_threads: [null, 2]")
    cells = expand(load_experiment(write("exp.yaml", text)))
    assert sorted((dict(c.engine_options)["n_threads"] or 0) for c in cells) == [0, 2]

def test_dtype_aliases_and_scalars(write):
    write("prompts.yaml", PROMPTS)
    loaded = load_experiment(write("exp.yaml", GOOD.replace("batch_size: [1, 2]", "batch_size: 1\n  dtype: float16")))
    assert loaded.experiment.matrix.dtype == ["f16"]
    assert loaded.experiment.matrix.batch_size == [1]


def test_every_shipped_config_is_valid():
    root = Path(__file__).resolve().parent.parent / "configs"
    files = sorted(root.rglob("*.yaml"))
    assert len(files) >= 6
    for path in files:  # the cluster configs name model files that live on GPU nodes, not here
        if "ops" in path.parts:  # op-probe settings (harness doctor --ops-config), not experiments
            from harness.run.op_probe import read_config

            assert read_config(path)["k"], path
            continue
        assert expand(load_experiment(path, model_files="cluster" not in path.parts)), path


def test_usage_errors_are_one_message_not_a_traceback():
    from .conftest import run_harness

    for args, says in ((["report"], "Missing argument"), (["run", "--bogus", "x"], "No such option")):
        done = run_harness(*args)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--reference", "batchsize=1"], "--reference 'batchsize=1': expected AXIS=VALUE"),
    (["--reference", "batch_size=two"], "--reference 'batch_size=two'"),
    (["--cells", "nosuchcell"], "--cells: not cells of this experiment: nosuchcell"),
    (["--where", "gpu=A100"], "--where gpu=A100 selects no cell of this experiment; its values there: gpu: any"),
])
def test_run_refuses_bad_arguments_before_it_writes_or_loads_anything(write, tmp_path, args, says):
    write("prompts.yaml", PROMPTS)
    write("exp.yaml", GOOD)
    done = run_harness("run", "exp.yaml", "--out", "out", *args, cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr.replace("\n", " "), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
