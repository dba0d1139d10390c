"""The per-node op probe on this CPU: `doctor --ops` writes a map whose cells a hand computation with
the same seeded inputs reproduces, and `compare` puts two maps side by side. The GPU dtypes (tf32,
f16) run only where torch sees a CUDA GPU (scripts/gpu_acceptance.sh)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from harness.run import op_probe

from .conftest import run_harness

SMALL = ["--ops-k", "64", "--ops-k", "256", "--ops-k", "1000", "--ops-m", "1", "--ops-m", "2", "--ops-m", "7",
         "--ops-m", "64", "--ops-repeats", "2"]


def _by_hand(k: int, m: int) -> tuple[bool, float]:
    """Row 0 of X[:m] @ W against X[:1] @ W with the probe's documented inputs, in NumPy f32."""
    rng = np.random.default_rng([op_probe.SEED, k])
    w = (rng.standard_normal((k, op_probe.COLUMNS)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((64, k)).astype(np.float32)
    alone, inside = np.matmul(x[:1], w)[0], np.matmul(np.ascontiguousarray(x[:m]), w)[0]
    return bool((alone.view(np.uint32) == inside.view(np.uint32)).all()), float(np.abs(alone - inside).max())


def test_op_map_is_written_with_provenance_and_agrees_with_a_hand_computation(tmp_path):
    out = tmp_path / "node-a.parquet"
    done = run_harness("doctor", "--ops", str(out), *SMALL)
    assert done.returncode == 0, done.stderr
    assert "numpy cpu f32:" in done.stdout and "K \\ M" in done.stdout
    frame = pd.read_parquet(out)
    kernels = frame.groupby(["library", "device", "dtype"]).ngroups
    assert len(frame) == kernels * 3 * 4
    assert frame["host"].nunique() == 1 and frame["host"].iloc[0] and frame["cpu"].iloc[0]
    assert set(frame["dtype"]) <= {"f32", "bf16"}  # no GPU here: no tf32, no f16
    numpy_f32 = frame[(frame["library"] == "numpy")].set_index(["k", "m"])
    for k in (64, 256, 1000):
        for m in (1, 2, 7, 64):
            same, gap = _by_hand(k, m)
            assert bool(numpy_f32.loc[(k, m), "row_invariant"]) == same, (k, m)
            assert numpy_f32.loc[(k, m), "max_abs_diff"] == pytest.approx(gap, rel=1e-6)
    assert frame[frame["m"] == 1]["row_invariant"].all()  # one row is the product alone

    # a second node: the same map with one cell turned, as another CPU would show it
    other = frame.copy()
    turned = other.index[(other["library"] == "numpy") & (other["k"] == 256) & (other["m"] == 1)][0]
    other.loc[turned, "row_invariant"] = False
    other["host"] = "node-b"
    other.to_parquet(tmp_path / "node-b.parquet", index=False)
    shown = run_harness("compare", str(out), str(tmp_path / "node-b.parquet"))
    assert shown.returncode == 0, shown.stderr
    assert "B = " in shown.stdout and "node-b" in shown.stdout
    assert "the nodes agree on 11/12" in shown.stdout and "differ at K=256 M=1" in shown.stdout
    pairs = json.loads(run_harness("compare", str(out), str(tmp_path / "node-b.parquet"), "-f", "json").stdout)
    assert sum(not p["same_verdict"] for p in pairs) == 1


def test_op_map_bad_input_is_named(tmp_path):
    frame = pd.DataFrame({"a": [1]})
    frame.to_parquet(tmp_path / "not-a-map.parquet")
    refused = run_harness("compare", str(tmp_path / "not-a-map.parquet"), str(tmp_path / "not-a-map.parquet"))
    assert refused.returncode == 1 and "not an op map" in refused.stderr and "row_invariant" in refused.stderr
    mixed = run_harness("compare", str(tmp_path / "not-a-map.parquet"), str(tmp_path))
    assert mixed.returncode == 2 and "two op maps" in mixed.stderr
    dtype = run_harness("doctor", "--ops", str(tmp_path / "m.parquet"), "--ops-dtype", "f8")
    assert dtype.returncode == 2 and "f32" in dtype.stderr
    assert not (tmp_path / "m.parquet").exists()


def test_op_probe_settings_file_is_checked(tmp_path):
    (tmp_path / "ops.yaml").write_text("k: [64]\nm: [1, 2]\nrepeats: 2\nbogus: 1\n")
    done = run_harness("doctor", "--ops", str(tmp_path / "m.parquet"), "--ops-config", str(tmp_path / "ops.yaml"))
    assert done.returncode == 2 and "ops.yaml:4" in done.stderr and "unknown key 'bogus'" in done.stderr
    (tmp_path / "ops.yaml").write_text("k: [64]\nm: [1, 3]\nrepeats: 1\n")
    done = run_harness("doctor", "--ops", str(tmp_path / "m.parquet"), "--ops-config", str(tmp_path / "ops.yaml"))
    assert done.returncode == 0, done.stderr
    frame = pd.read_parquet(tmp_path / "m.parquet")
    assert set(frame["k"]) == {64} and set(frame["m"]) == {1, 3} and set(frame["repeats"]) == {1}
