"""Serving latency from rows whose answers are known: TTFT, ITL, TPOT and E2EL percentiles, the
batch-invariant slowdown's latency columns, the per-setting latency table and the gate rule on it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.analysis import latency, metrics
from harness.experiment.axes import LATER_AXES_DEFAULTS
from harness.experiment.schema import Expectation
from harness.report.table import preemption_lines, serving_table
from harness.results import columns

SETTINGS = dict(model="m", engine="vllm", dtype="auto", gpu="any", batch_invariant=False, seed=0,
                temperature=0.0, top_p=1.0, top_k=0, max_tokens=8, **LATER_AXES_DEFAULTS)


def _run(repeat: int, ttft: float, gaps: list[float] | None, batch_invariant: bool = False, **over) -> dict:
    """One ok row of a request whose tokens came at ttft, then after each of `gaps`."""
    n = 1 + len(gaps or [])
    e2el = ttft + sum(gaps or [])
    return SETTINGS | {"batch_size": 4, "batch_invariant": batch_invariant, "prompt_id": "p", "repeat": repeat,
                       "cell_id": f"c-{batch_invariant}-{over}", "status": "ok", "n_tokens": n,
                       "target_tokens_per_s": n / e2el, "batch_tokens_per_s": 4 * n / e2el, "ttft_s": ttft,
                       "itl_s": gaps} | over


def test_definitions_on_known_requests():
    rows = pd.DataFrame([_run(0, 0.1, [0.01, 0.03]), _run(1, 0.3, [0.02, 0.02, 0.05]), _run(2, 0.2, None)])
    # TTFT per request; TPOT = (E2EL - TTFT) / (n - 1): 0.02 and 0.03, none for a one-token request
    assert latency.samples(rows, "ttft").tolist() == pytest.approx([0.1, 0.3, 0.2])
    assert latency.samples(rows, "tpot").tolist() == pytest.approx([0.02, 0.03])
    assert latency.samples(rows, "e2el").tolist() == pytest.approx([0.14, 0.39, 0.2])
    # ITL pools every gap of every request
    assert sorted(latency.samples(rows, "itl").tolist()) == pytest.approx([0.01, 0.02, 0.02, 0.03, 0.05])
    p = latency.percentiles(rows)
    assert p["itl_p50"] == pytest.approx(0.02)
    assert p["ttft_p90"] == pytest.approx(np.percentile([0.1, 0.3, 0.2], 90))
    assert p["tpot_p99"] == pytest.approx(np.percentile([0.02, 0.03], 99))


def test_a_metric_not_recorded_is_nan_never_zero():
    rows = pd.DataFrame([_run(0, 0.1, None) | {"ttft_s": None, "itl_s": None}])
    p = latency.percentiles(rows)
    assert math.isnan(p["ttft_p50"]) and math.isnan(p["itl_p99"]) and math.isnan(p["tpot_p50"])
    assert p["e2el_p50"] == pytest.approx(0.1)


def _paired(slow: float) -> pd.DataFrame:
    """Batch-invariant off and on over the same prompt and repeats; `slow`: how much slower on is."""
    rows = []
    for repeat in range(5):
        ttft, gaps = 0.1 + 0.01 * repeat, [0.02 + 0.001 * repeat] * 9
        rows.append(_run(repeat, ttft, gaps))
        rows.append(_run(repeat, ttft * slow, [g * slow for g in gaps], batch_invariant=True))
    return pd.DataFrame(rows)


def test_slowdown_reports_each_percentile_on_both_sides_and_the_ratio():
    cost = metrics.slowdown(_paired(1.5))
    rec = cost.iloc[0]
    assert rec.pairs == 5
    for metric in latency.METRICS:
        for p in latency.PERCENTILES:
            name = latency.columns(metric, p)
            assert rec[f"{name}_ratio"] == pytest.approx(1.5), name
            assert rec[f"{name}_on"] == pytest.approx(1.5 * rec[f"{name}_off"])
    assert rec["ttft_p50_off"] == pytest.approx(0.12)
    assert rec.throughput_ratio == pytest.approx(1.5) and rec.latency_ratio == pytest.approx(1.5)
    table = serving_table(cost, "t")
    assert table is not None and table.row_count == len(latency.METRICS)


def test_slowdown_without_latency_columns_keeps_its_old_figures():
    rows = _paired(2.0).drop(columns=["ttft_s", "itl_s"])
    rec = metrics.slowdown(rows).iloc[0]
    assert rec.throughput_ratio == pytest.approx(2.0)
    assert math.isnan(rec["ttft_p50_ratio"]) and rec["e2el_p50_ratio"] == pytest.approx(2.0)


def test_the_slowdown_shows_each_side_s_start_up_beside_the_cost():
    """Issue 56: the mode changes start-up too (kernel variants, compile, graph capture); shown beside it."""
    rows = _paired(1.5)
    on = rows["batch_invariant"].astype(bool)
    rows["load_s"] = np.where(on, 40.0, 25.0)
    rows["warmup_s"] = np.where(on, 3.0, 1.0)
    rec = metrics.slowdown(rows).iloc[0]
    assert (rec.load_s_off, rec.load_s_on, rec.warmup_s_off, rec.warmup_s_on) == (25.0, 40.0, 1.0, 3.0)
    from harness.report.table import _start_up

    assert _start_up(rec.to_dict()) == "26.0 / 43.0"
    assert _start_up(metrics.slowdown(_paired(1.5)).iloc[0].to_dict()) == "- / -"  # rows before schema 12


def test_latency_by_setting_divides_by_the_reference_setting():
    rows = pd.DataFrame([_run(r, 0.1, [0.02] * 4, batch_size=1) for r in range(3)]
                        + [_run(r, 0.3, [0.05] * 4, batch_size=8) for r in range(3)])
    table = latency.by_setting(rows, columns.keys_of(rows), {"batch_size": 1}).set_index("batch_size")
    assert table.loc[1, "ttft_p50_ratio"] == pytest.approx(1.0)
    assert table.loc[8, "ttft_p50_ratio"] == pytest.approx(3.0)
    assert table.loc[8, "itl_p99_ratio"] == pytest.approx(2.5)
    assert table.loc[8, "runs"] == 3


@pytest.mark.parametrize(("slow", "limit", "passes"), [(1.2, 1.6, True), (2.0, 1.6, False)])
def test_gate_rule_on_a_latency_ratio(slow, limit, passes):
    cost = metrics.slowdown(_paired(slow))
    rule = Expectation(name="p99 tpot", latency_ratio_max=limit, latency_metric="tpot", latency_percentile=99)
    problems, judged = evaluate_one(rule, cost)
    assert judged == {"latency_ratio_max": 1}
    assert (problems == []) is passes
    if not passes:
        assert "TPOT p99 on / off 2.00x" in problems[0]


def test_gate_rule_fails_where_the_metric_was_not_recorded():
    cost = metrics.slowdown(_paired(1.0).drop(columns=["itl_s"]))
    problems, _ = evaluate_one(Expectation(latency_ratio_max=5.0, latency_metric="itl", latency_percentile=50), cost)
    assert len(problems) == 1 and "no ITL p50 recorded" in problems[0]


def evaluate_one(rule: Expectation, cost: pd.DataFrame) -> tuple[list[str], dict[str, int]]:
    from harness.analysis.gate import _judge

    no_cells = pd.DataFrame(columns=["cell_id", "prompt_id", "runs", "compared", "status"])
    return _judge(rule, no_cells, cost)


def test_cells_asking_for_a_small_cache_without_preemption_are_named():
    summary = pd.DataFrame([
        {"cell_id": "a", "kv_cache_tokens": 512, "status": "ok", "preempted_batches": 3.0},
        {"cell_id": "b", "kv_cache_tokens": 512, "status": "ok", "preempted_batches": 0.0},
        {"cell_id": "c", "kv_cache_tokens": 512, "status": "ok", "preempted_batches": float("nan")},
        {"cell_id": "d", "kv_cache_tokens": 0, "status": "ok", "preempted_batches": 0.0},
    ]).assign(batch_size=4)
    lines = preemption_lines(summary)
    assert len(lines) == 2
    assert "cell b" in lines[0] and "not preemption evidence" in lines[0]
    assert "cell c" in lines[1] and "does not count" in lines[1]


def test_summary_counts_preempted_runs_and_draft_acceptance():
    from harness.results.rows import output_hash

    rows = []
    for repeat, (pre, batch, proposed, accepted) in enumerate([(0, 1, 10, 8), (2, 3, 10, 6), (1, 1, 20, 10),
                                                                 (0, 0, 0, 0)]):
        rows.append(SETTINGS | {"batch_size": 1, "cell_id": "c", "prompt_id": "p", "repeat": repeat, "status": "ok",
                                "error": "", "output_hash": output_hash([1, 2]), "n_tokens": 2,
                                "target_tokens_per_s": 1.0, "preemptions": pre, "batch_preemptions": batch,
                                "draft_proposed": proposed, "draft_accepted": accepted})
    out = metrics.summarize(pd.DataFrame(rows), lambda hashes: {h: [1, 2] for h in hashes}).iloc[0]
    assert out.preempted_runs == 2 and out.preempted_batches == 3 and out.preemptions == 3
    assert out.draft_acceptance == pytest.approx(24 / 40)


def test_summarize_and_check_show_the_batch_invariant_latency_cost(tmp_path):
    """A stand-in folder (no CPU runs batch-invariant mode: these rows are written by hand, as a GPU node's
    would be): the slowdown table gains the latency table, csv gains the columns, and check judges them."""
    import json

    from .conftest import row_for, run_harness, synthetic_folder

    root = tmp_path / "out"
    folder, cells = synthetic_folder(root, ["p", "q"], {"batch_size": [4], "batch_invariant": [False, True]},
                                     repeats=3)
    for cell in cells:
        slow = 1.8 if cell["batch_invariant"] else 1.0
        rows = []
        for prompt in ("p", "q"):
            for repeat in range(3):
                ttft, gaps = (0.05 + 0.01 * repeat) * slow, [0.01 * slow] * 7
                e2el = ttft + sum(gaps)
                rows.append(row_for(cell, prompt, repeat, [1, 2, 3, 4, 5, 6, 7, 8], ttft_s=ttft, itl_s=gaps,
                                    target_tokens_per_s=8 / e2el, batch_tokens_per_s=32 / e2el))
        folder.write_cell(cell.id, rows, "x")
    shown = run_harness("summarize", str(root))
    assert shown.returncode == 0, shown.stderr
    assert "serving latency" in shown.stdout and "TTFT" in shown.stdout and "TPOT" in shown.stdout
    assert "1.80/1.80/1.80" in shown.stdout  # on / off at p50/p90/p99
    done = run_harness("summarize", str(root), "--what", "slowdown", "-f", "json")
    rec = json.loads(done.stdout)[0]
    assert rec["ttft_p99_ratio"] == pytest.approx(1.8) and rec["itl_p50_off"] == pytest.approx(0.01)
    gate = tmp_path / "gate.yaml"
    gate.write_text("expect:\n  - {name: tpot, latency_ratio_max: 1.5, latency_metric: tpot, latency_percentile: 90}\n")
    checked = run_harness("check", str(root), "--expect", str(gate))
    assert checked.returncode == 1 and "TPOT p90 on / off 1.80x" in checked.stdout + checked.stderr
    table = run_harness("summarize", str(root), "--what", "latency", "--reference", "batch_invariant=false")
    assert table.returncode == 0, table.stderr
    assert "ratio to the reference setting (batch_invariant=False)" in table.stdout
    assert "1.80/1.80/1.80" in table.stdout and "1.00/1.00/1.00" in table.stdout
    assert not (root / "latency.parquet").exists()  # read when asked, never saved on the way
