"""Engine environments as an axis: a cell's worker runs under the interpreter its `environment`
names. The second environment here is a real venv of its own (its own interpreter and site
folder) that reaches this one's packages through a .pth file: cheap to make, and enough to show
that the worker runs there, that rows record what that interpreter reports, that statistics keep
environments apart unless asked, and that compare and compare --score set one against the other."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.experiment.config import load_experiment

from .conftest import PROMPTS, needs_llama, run_experiment, run_harness


def _venv(root: Path, linked: bool) -> Path:
    """A venv at root (no pip); `linked`: it sees this interpreter's packages through a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    if linked:
        inner = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
        dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
        Path(inner, "outer.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    return python


def _reported_versions(python: Path) -> dict:
    code = "import json; from harness.results.provenance import library_versions; print(json.dumps(library_versions()))"
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env={"PYTHONPATH": root},
                          check=True)
    return json.loads(done.stdout)


def test_an_environment_must_be_named_and_current_is_reserved(write):
    write("prompts.yaml", PROMPTS)
    path = write("exp.yaml", "name: e\nprompts: prompts.yaml\nmatrix: {model: [smollm2-135m], environment: [old]}\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:3.*environment 'old' is not named under environments:.*current"):
        load_experiment(path)
    path.write_text(path.read_text() + "environments: {current: {python: /usr/bin/python3}}\n")
    with pytest.raises(ConfigError, match="'current' is the harness's own interpreter"):
        load_experiment(path)


def test_an_environment_that_cannot_run_the_harness_fails_its_cells_and_says_why(tmp_path):
    bare = _venv(tmp_path / "bare", linked=False)
    text = ("name: envs\nprompts: prompts.yaml\nmax_tokens: 4\n"
            "matrix: {model: [m], engine: [openai], gpu: [any], environment: [bare, gone]}\n"
            f"environments: {{bare: {{python: '{bare}'}}, gone: {{python: '{tmp_path / 'nowhere' / 'python'}'}}}}\n"
            "engine_options: {openai: {base_url: 'http://127.0.0.1:9/v1'}}\n")
    rows = run_experiment(tmp_path, text).read_rows()
    assert set(rows.status) == {"failed"}
    why = dict(zip(rows.environment, rows.error))
    assert "cannot import the harness: ModuleNotFoundError" in why["bare"] and "pip install" in why["bare"]
    assert "no such interpreter here" in why["gone"]


@needs_llama
def test_two_environments_run_apart_and_are_compared_when_asked(tmp_path):
    other = _venv(tmp_path / "venv-b", linked=True)
    text = ("name: envs\nprompts: prompts.yaml\nrepeats: 2\nmax_tokens: 8\n"
            "matrix: {model: [smollm2-135m], batch_size: [1, 2], environment: [current, b]}\n"
            f"environments: {{b: {{python: '{other}'}}}}\n"
            "engine_options: {llamacpp: {n_threads: 2}}\n")
    # through the command line, as users run it: its spare worker (this interpreter) must not serve b
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(text)
    done = run_harness("run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    from harness.results.store import Store

    store = Store(tmp_path / "out")
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    by_env = {env: part for env, part in rows.groupby("environment")}
    assert set(by_env["b"].python_executable) == {str(other)}
    assert set(by_env["current"].python_executable) == {sys.executable}
    assert json.loads(by_env["b"].library_versions.iloc[0]) == _reported_versions(other)
    assert rows.groupby("environment").load_id.nunique().eq(1).all()  # one load each
    assert by_env["b"].cell_id.isin(by_env["current"].cell_id).sum() == 0

    default = json.loads(run_harness("summarize", str(store.root), "--what", "settings", "-f", "json").stdout)
    assert sorted((r["environment"], r["batch_size"], r["compared"]) for r in default) == [
        ("b", 1, 2), ("b", 2, 4), ("current", 1, 2), ("current", 2, 4)]  # each against its own batch 1
    across = json.loads(run_harness("summarize", str(store.root), "-r", "environment=current", "--what", "settings",
                                    "-f", "json").stdout)
    paired = {(r["environment"], r["batch_size"]): (r["compared"], r["diverged"]) for r in across}
    assert paired[("b", 1)] == (4, 0) and paired[("b", 2)] == (4, 0)  # the same libraries: the same tokens

    sides = ["--a-where", "environment=current", "--b-where", "environment=b", "--ignore", "environment"]
    shown = run_harness("compare", str(store.root), str(store.root), *sides, "-f", "json")
    assert shown.returncode == 0, shown.stderr
    pairs = json.loads(shown.stdout)
    assert len(pairs) == 8 and all(p["environment_a"] == "current" and p["environment_b"] == "b" for p in pairs)
    scored = run_harness("compare", str(store.root), str(store.root), *sides, "--score", "-f", "json")
    assert scored.returncode == 0, scored.stderr
    verdicts = json.loads(scored.stdout)
    assert verdicts and all(v["verdict"] == "within A's noise" for v in verdicts)
    # runs of environment b are re-read by b's own engine, or refused: this interpreter's would stand in
    replayed = run_harness("replay", str(store.root), "--where", "environment=b")
    said = " ".join(replayed.stdout.split())
    assert replayed.returncode == 0 and "not replayed" in said and f"the runs ran under {other}" in said, said
    flipped = ["--a-where", "environment=b", "--b-where", "environment=current", "--ignore", "environment"]
    refused = json.loads(run_harness("compare", str(store.root), str(store.root), *flipped, "--score", "-f",
                                     "json").stdout)
    assert refused and all("not scored" in v["verdict"] and "another environment" in v["verdict"] for v in refused)


def test_a_venv_of_this_very_python_is_another_environment(tmp_path):
    """A venv's bin/python links to its base interpreter, so two venvs of one Python resolve to one file:
    judged by that file, `harness run`'s spare worker (this environment's) served the other venv's
    cells, and rows labelled with its environment ran with this one's libraries."""
    from harness.run.environments import is_foreign

    other = _venv(tmp_path / "same-python", linked=False)
    assert is_foreign(str(other))
    assert not is_foreign(sys.executable) and not is_foreign("")
