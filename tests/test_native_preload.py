"""harness.core.native_preload on a package made here: a Python package whose `lib/` holds a real
shared library named as ggml's CUDA backend (a STAND-IN: it computes nothing, there is no GPU here).
Fast: no engine loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")),
                                reason="needs Linux and a C compiler")

CHILD = """
import json, os, sys
from harness.core import native_preload as n
n.ensure("fakeggml")
print(json.dumps({"state": n.state("fakeggml"), "ld": os.environ.get("LD_PRELOAD"), "argv": sys.argv[1:],
                  "stdin": sys.stdin.read(), "backends": n.backends("fakeggml"),
                  "marker": any(k.startswith("HARNESS_NATIVE_PRELOAD_") for k in os.environ)}))
"""


def _package(root: Path, gpu: bool) -> dict[str, str]:
    lib = root / "fakeggml" / "lib"
    lib.mkdir(parents=True)
    (root / "fakeggml" / "__init__.py").write_text("")
    source = root / "stub.c"
    source.write_text("int fake_backend(void) { return 0; }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    names = ["libggml-base.so", "libggml-cpu.so"] + (["libggml-cuda.so.0.9.1", "libggml-cuda.so.0", "libggml-cuda.so"]
                                                     if gpu else [])  # copies, as a wheel holds them
    for name in names:
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib / name), str(source)], check=True)
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _child(env: dict[str, str], *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, *args], input="order on stdin", capture_output=True,
                          text=True, env={**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **env},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_gpu_build_is_preloaded_by_one_re_execution_that_keeps_argv_stdin_and_the_old_variable(tmp_path):
    env = _package(tmp_path, gpu=True)
    got = _child(env, "--flag", "value")
    assert got["backends"] == ["cuda"]
    assert got["state"] == "on: libggml-cuda.so"
    assert got["argv"] == ["--flag", "value"] and got["stdin"] == "order on stdin"
    assert got["ld"] is None and not got["marker"], "LD_PRELOAD is put back for the processes it starts"
    other = tmp_path / "other.so"
    shutil.copy(tmp_path / "fakeggml" / "lib" / "libggml-base.so", other)
    kept = _child(env | {"LD_PRELOAD": str(other)})
    assert kept["state"] == "on: libggml-cuda.so" and kept["ld"] == str(other)


def test_the_switch_turns_it_off_or_names_the_libraries(tmp_path):
    env = _package(tmp_path, gpu=True)
    off = _child(env | {"HARNESS_NATIVE_PRELOAD": "off"})
    assert off["state"] == "off (HARNESS_NATIVE_PRELOAD=off; the build has cuda)"
    named = str(tmp_path / "fakeggml" / "lib" / "libggml-base.so")
    given = _child(env | {"HARNESS_NATIVE_PRELOAD": named})
    assert given["state"] == "on: libggml-base.so (HARNESS_NATIVE_PRELOAD)"
    missing = _child(env | {"HARNESS_NATIVE_PRELOAD": str(tmp_path / "nowhere.so")})
    assert missing["state"].startswith("off (HARNESS_NATIVE_PRELOAD names no existing file")


def test_a_cpu_only_build_preloads_nothing(tmp_path):
    got = _child(_package(tmp_path, gpu=False))
    assert got["backends"] == [] and got["state"] == "not needed (no GPU backend in this build)"


def test_the_line_a_worker_logs_before_the_engine_is_read_back():
    import numpy  # noqa: F401 - a native library in this process

    from harness.core import native_preload

    line = native_preload.before_engine_line("no_such_package")
    assert line.startswith(native_preload.BEFORE_ENGINE)
    said = native_preload.last_before_engine(f"noise\n{line}\nmore noise\n")
    assert "numpy" in said and said.endswith("native preload not needed (no GPU backend in this build)")
    assert native_preload.last_before_engine("nothing here") == ""


def test_processes_that_load_llama_cpp_ask_for_the_preload():
    """Every entry that loads llama.cpp calls ensure before its imports (read from the source)."""
    root = Path(__file__).resolve().parent.parent / "harness"
    for path in ("run/worker.py", "run/rehearsal.py", "engines/parts/kernel_probe.py",
                 "engines/parts/child_probe.py", "cli/__init__.py"):
        assert "ensure" in (root / path).read_text(), path
    from harness.cli import _loads_engines_here

    assert _loads_engines_here(["replay", "out"]) and _loads_engines_here(["compare", "a", "b", "--score"])
    assert not _loads_engines_here(["summarize", "out"]) and not _loads_engines_here(["compare", "a", "b"])
