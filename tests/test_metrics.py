"""Statistics on hand-made token sequences whose answers are known."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.analysis import bounds, divergence, metrics
from harness.core.errors import HarnessError
from harness.experiment import reference_rules
from harness.experiment.axes import AXES, LATER_AXES_DEFAULTS
from harness.results.rows import output_hash


@pytest.mark.parametrize(
    ("tokens", "reference", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),  # identical
        ([9, 2, 3], [1, 2, 3], 0),  # at the first token
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),  # in the middle
        ([1, 2, 3, 9], [1, 2, 3, 4], 3),  # at the last token
        ([1, 2], [1, 2, 3, 4], 2),  # shorter output that is a prefix: diverges at its end
        ([1, 2, 3, 4, 5], [1, 2, 3], 3),  # longer output that extends the reference
        ([], [1], 0),
        ([], [], None),
    ],
)
def test_first_divergence(tokens, reference, expected):
    assert divergence.first_divergence(tokens, reference) == expected


def test_upper95_is_the_exact_clopper_pearson_bound():
    # 0 of n: 1 - 0.05**(1/n), not the rule of three (3/n is its large-n approximation)
    assert bounds.upper95(0, 10) == pytest.approx(0.2589, abs=1e-4)
    assert bounds.upper95(0, 2) == pytest.approx(0.7764, abs=1e-4)
    assert bounds.upper95(0, 1) == pytest.approx(0.95)
    assert bounds.upper95(0, 1000) == pytest.approx(0.002991, abs=1e-6)
    # published one-sided 95 % Clopper-Pearson values: 1 of 10 -> 0.3942, 5 of 20 -> 0.4556
    assert bounds.upper95(1, 10) == pytest.approx(0.3942, abs=1e-4)
    assert bounds.upper95(5, 20) == pytest.approx(0.4556, abs=1e-4)
    assert bounds.upper95(10, 10) == 1.0
    assert bounds.upper95(0, 0) is None


@pytest.mark.parametrize("runs", [1, 2, 3, 10, 57, 1000])
def test_upper95_grows_with_the_diverged_count(runs):
    limits = [bounds.upper95(k, runs) for k in range(runs + 1)]
    assert all(a < b for a, b in zip(limits, limits[1:]))  # 0 of 2 is below 1 of 2, and so on
    assert all(k / runs <= b <= 1 for k, b in enumerate(limits))


SETTINGS = dict(model="m", engine="llamacpp", dtype="auto", gpu="any", batch_invariant=False, seed=0,
                temperature=0.0, top_p=1.0, top_k=0, max_tokens=8, **LATER_AXES_DEFAULTS)


def _rows(spec):
    """spec: list of (overrides, prompt_id, repeat, tokens or status)."""
    rows = []
    for over, prompt, repeat, tokens in spec:
        s = SETTINGS | {"batch_size": 1} | over
        cell = "c-" + "-".join(str(s[a]) for a in AXES)
        row = s | {"cell_id": cell, "prompt_id": prompt, "repeat": repeat, "error": "", "target_tokens_per_s": 10.0}
        if isinstance(tokens, str):
            row |= {"status": tokens, "error": "refused", "output_hash": None, "n_tokens": None}
        else:
            row |= {"status": "ok", "output_hash": output_hash(tokens), "n_tokens": len(tokens), "_tokens": tokens}
        rows.append(row)
    frame = pd.DataFrame(rows)
    tokens = {r["output_hash"]: r["_tokens"] for r in rows if r["status"] == "ok"}
    return frame.drop(columns="_tokens"), lambda hashes: {h: tokens[h] for h in hashes}


REF = [1, 2, 3, 4, 5, 6]


def test_summarize_against_batch_one():
    frame, tokens_for = _rows(
        [({}, "p", r, REF) for r in range(3)]
        + [({"batch_size": 4}, "p", 0, REF), ({"batch_size": 4}, "p", 1, [1, 2, 3, 9, 9, 9]),
           ({"batch_size": 4}, "p", 2, [1, 2]), ({"batch_size": 4}, "p", 3, [7, 2, 3, 4, 5, 6])]
        + [({"batch_size": 8}, "p", r, [5, 5, 5]) for r in range(4)]
    )
    out = metrics.summarize(frame, tokens_for).set_index("batch_size")
    b1, b4, b8 = out.loc[1], out.loc[4], out.loc[8]
    assert (b1.runs, b1.unique_outputs, b1.match_rate, b1.modal_share, b1.compared) == (3, 1, 1.0, 1.0, 2)
    assert pd.isna(b1.first_divergence_min) and b1.divergence_rate_upper95 == pytest.approx(1 - 0.05 ** 0.5)
    assert (b4.runs, b4.unique_outputs, b4.match_rate, b4.modal_share) == (4, 4, 0.25, 0.25)
    assert (b4.first_divergence_min, b4.first_divergence_median, b4.diverged) == (0, 2, 3)
    assert b4.divergence_rate_upper95 == pytest.approx(bounds.upper95(3, 4))
    assert (b8.unique_outputs, b8.match_rate, b8.first_divergence_min, b8.modal_share) == (1, 0.0, 0, 1.0)
    assert b4.reference_cell == b1.cell_id


def test_summarize_reference_axis_and_missing_reference():
    frame, tokens_for = _rows(
        [({"dtype": "f32"}, "p", 0, REF), ({"dtype": "f16"}, "p", 0, REF[:4] + [0, 0]),
         ({"dtype": "f16"}, "q", 0, REF)]
    )
    out = metrics.summarize(frame, tokens_for, reference_rules.parse_reference(["dtype=float32"]))
    f16p = out[(out.dtype == "f16") & (out.prompt_id == "p")].iloc[0]
    assert (f16p.match_rate, f16p.first_divergence_min) == (0.0, 4)
    f16q = out[(out.dtype == "f16") & (out.prompt_id == "q")].iloc[0]
    assert pd.isna(f16q.match_rate) and f16q.runs == 1  # no f32 run of prompt q: nothing to compare
    assert set(out["reference"]) == {"dtype=f32"}


def test_summarize_keeps_refused_cells():
    frame, tokens_for = _rows([({}, "p", 0, REF), ({"batch_invariant": True}, "p", 0, "unsupported")])
    out = metrics.summarize(frame, tokens_for)
    refused = out[out.batch_invariant].iloc[0]
    assert (refused.status, refused.runs, refused.error) == ("unsupported", 0, "refused")


def test_summarize_all_different():
    frame, tokens_for = _rows([({}, "p", r, [r, 1, 2]) for r in range(5)])
    row = metrics.summarize(frame, tokens_for).iloc[0]
    # the reference run (repeat 0) is not compared with itself: 0 of the 4 others match
    assert (row.unique_outputs, row.modal_share, row.match_rate, row.diverged, row.compared) == (5, 0.2, 0.0, 4, 4)


def test_parse_reference_errors():
    with pytest.raises(HarnessError, match="AXIS=VALUE"):
        reference_rules.parse_reference(["colour=red"])
    with pytest.raises(HarnessError, match="unknown dtype"):
        reference_rules.parse_reference(["dtype=f12"])
    assert reference_rules.parse_reference([]) == {"batch_size": 1}
    assert reference_rules.parse_reference(["batch_invariant=true", "batch_size=2"]) == {"batch_invariant": True, "batch_size": 2}


def test_slowdown_pairs_runs_that_differ_only_in_batch_invariant():
    rows = []
    for bi, speed in ((False, 30.0), (True, 10.0)):
        for repeat in range(3):
            rows.append(SETTINGS | {"batch_size": 4, "batch_invariant": bi, "prompt_id": "p", "repeat": repeat,
                                    "status": "ok", "n_tokens": 60, "target_tokens_per_s": speed / 2 * (1 + repeat),
                                    "batch_tokens_per_s": speed * (1 + repeat)})
    rows.append(SETTINGS | {"batch_size": 8, "batch_invariant": False, "prompt_id": "p", "repeat": 0,
                            "status": "ok", "n_tokens": 60, "target_tokens_per_s": 5.0, "batch_tokens_per_s": 9.0})
    cost = metrics.slowdown(pd.DataFrame(rows))
    assert len(cost) == 1 and cost.iloc[0].batch_size == 4  # batch 8 has no partner
    rec = cost.iloc[0]
    assert (rec.pairs, rec.throughput_ratio, rec.latency_ratio) == (3, 3.0, 3.0)
    assert rec.throughput_ratio_min == rec.throughput_ratio_max == 3.0


def test_rows_of_an_older_schema_read_back_with_new_columns_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.results.schema import ROW_SCHEMA
    from harness.results.store import Store

    store = Store(tmp_path)
    store.write_cell("new", [{"cell_id": "new", "prompt_id": "p", "status": "ok", "token_texts": ["a"]}])
    old = pa.schema([f for f in ROW_SCHEMA if f.name != "token_texts" and not f.name.startswith("probe_")])
    pq.write_table(pa.Table.from_pylist([{"cell_id": "old", "prompt_id": "p", "status": "ok"}], schema=old),
                   store.cell_path("old"))
    rows = store.read_rows()
    assert list(rows.columns) == ROW_SCHEMA.names
    rows = rows.set_index("cell_id")
    assert rows.loc["old", "token_texts"] is None and list(rows.loc["new", "token_texts"]) == ["a"]
    some = store.read_rows(columns=["cell_id", "token_texts", "probe_steps"])
    assert list(some.columns) == ["cell_id", "token_texts", "probe_steps"] and len(some) == 2


def test_rows_from_before_the_cache_axes_read_back_at_their_defaults(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.results.schema import ROW_SCHEMA
    from harness.results.store import Store

    store = Store(tmp_path)
    store.write_cell("new", [{"cell_id": "new", "status": "ok", "prefix_cache": "warm", "context_tokens": 9,
                              "llamacpp.n_ubatch": 16}])
    old = pa.schema([f for f in ROW_SCHEMA if f.name not in LATER_AXES_DEFAULTS])
    pq.write_table(pa.Table.from_pylist([{"cell_id": "old", "status": "ok"}], schema=old), store.cell_path("old"))
    rows = store.read_rows().set_index("cell_id")
    assert rows.loc["old", list(LATER_AXES_DEFAULTS)].to_dict() == LATER_AXES_DEFAULTS  # what they ran with
    assert rows.loc["new", "prefix_cache"] == "warm" and rows.loc["new", "context_tokens"] == 9
    # a swept option is a text column of the files that have it, empty in the others
    assert rows.loc["new", "llamacpp.n_ubatch"] == "16" and pd.isna(rows.loc["old", "llamacpp.n_ubatch"])


def test_verdict_lines_keep_settings_an_engine_does_not_have():
    from harness.report.table import verdict_lines

    # llama.cpp sweeps its n_batch; vLLM's cells have no value for it, and must keep their verdicts
    records = [{"engine": e, "batch_size": b, "llamacpp.n_batch": nb, "compared": 3, "diverged": d,
                "first_divergence_min": 5 if d else None, "runs": 3, "reference_cell": "r", "reference": "batch_size=1"}
               for e, nb in (("llamacpp", "64"), ("llamacpp", "512"), ("vllm", None)) for b, d in ((1, 0), (8, 1))]
    lines = verdict_lines(pd.DataFrame(records))
    assert len(lines) == 6
    assert "engine=vllm, batch_size=8: 2/3 runs identical to the reference, first divergence at token 5" in "\n".join(lines)
    assert not any("nan" in line or "None" in line for line in lines)


def test_a_verdict_says_half_departed_only_when_half_did():
    """Identical runs that stop early leave the curve's risk set: its median can fall below 0.5 while
    most runs stayed identical. The line then names the Kaplan-Meier median for what it is."""
    import pandas as pd

    from harness.report.table import verdict_lines

    summary = pd.DataFrame({"engine": ["llamacpp"] * 2, "batch_size": [1, 4], "runs": [8, 8],
                            "reference_cell": ["a", "a"], "reference": ["batch_size=1"] * 2})
    base = {"engine": "llamacpp", "prompts": 5, "first_divergence_min": 3, "median_tokens_to_divergence": 7,
            "upper95_prompts": 0.5, "upper95_pooled": 0.3, "logprobs_compared": 0}
    few = pd.DataFrame([{**base, "batch_size": 4, "compared": 8, "diverged": 2, "departed_by_median": 2}])
    most = pd.DataFrame([{**base, "batch_size": 4, "compared": 8, "diverged": 5, "departed_by_median": 4}])
    # most departed in the end, but only 3 by the median: the total does not choose the words
    late = pd.DataFrame([{**base, "batch_size": 4, "compared": 8, "diverged": 6, "departed_by_median": 3}])
    (line,) = verdict_lines(summary, few)
    assert "half departed by" not in line and "Kaplan-Meier median 7 tokens among the runs still going" in line
    (line,) = verdict_lines(summary, most)
    assert "half departed by token 7 (4/8)" in line
    (line,) = verdict_lines(summary, late)
    assert "half departed by" not in line and "(3/8 had departed by then" in line


def test_the_median_is_where_the_curve_reaches_one_half_computed_by_hand():
    """Issue 43's runs: 10 at batch 8 of 48 tokens, departing at tokens 1, 1, 1, 7, 7, 16, 16. By hand:
    S = 0.7 after token 1, 0.7 * 5/7 = 0.5 after token 7 (0.5000000000000001 in floating point), 0.3
    after 16: half had departed by token 7, and 5 runs had."""
    import pandas as pd

    from harness.analysis import survival
    from harness.results.columns import KEY_COLUMNS

    setting = {k: "x" for k in KEY_COLUMNS} | {"batch_size": 8, "cell_id": "c", "n_tokens": 48}
    splits = [1, 1, 1, 7, 7, 16, 16, None, None, None]
    compared = pd.DataFrame({**setting, "matched": [s is None for s in splits],
                             "first_divergence": [float("nan") if s is None else s for s in splits]})
    curve = survival.curves(compared).set_index("tokens")
    assert curve.loc[2, "identical"] == pytest.approx(0.7) and curve.loc[8, "identical"] == pytest.approx(0.5)
    (row,) = survival.medians(survival.curves(compared)).to_dict("records")
    got = (row["runs"], row["departed"], row["median_tokens_to_divergence"], row["departed_by_median"])
    assert got == (10, 7, 7, 5)
    ten = pd.DataFrame({**setting, "matched": False, "first_divergence": [3.0] * 4 + [9.0] * 6})
    (row,) = survival.medians(survival.curves(ten)).to_dict("records")
    assert (row["median_tokens_to_divergence"], row["departed_by_median"]) == (9, 10)


def test_a_split_at_the_first_step_compares_no_log_probability():
    from harness.analysis.divergence import logprob_difference

    first, largest = logprob_difference([-0.1, -0.2], [-0.3, -0.2], 0)
    assert first is None and math.isnan(largest)  # not compared, never "0.0 apart"
    assert logprob_difference([-0.1, -0.2], [-0.1, -0.25], 2)[0] == 1


def test_the_gate_sees_refused_cells_and_names_their_reasons(tmp_path):
    """A rule that selects cells the engine refused (unsupported) fails, listing each reason, unless
    it says allow_unsupported: true; the rest of the selection is judged either way."""
    import json

    import yaml

    from .conftest import row_for, run_harness, synthetic_folder

    folder, cells = synthetic_folder(tmp_path / "out", ["p1", "p2"], {"batch_size": [1, 2, 4]}, repeats=2)
    why = {2: "kv_cache_dtype q8_0 needs flash attention (flash_attn: on)", 4: "batch 4 > max_num_seqs 2"}
    for cell in cells:
        size = cell["batch_size"]
        rows = [row_for(cell, p, r, [1, 2, 3]) if size == 1 else row_for(cell, p, r, status="unsupported",
                                                                          error=why[size])
                for p in ("p1", "p2") for r in range(2)]
        folder.write_cell(cell.id, rows, "t")
    rules = tmp_path / "rules.yaml"

    def check(*rule: dict) -> list[dict]:
        rules.write_text(yaml.safe_dump({"expect": list(rule)}))
        out = run_harness("check", str(folder.root), "--expect", str(rules), "--format", "json")
        verdicts = json.loads(out.stdout)["verdicts"]
        assert out.returncode == (0 if all(v["passed"] for v in verdicts) else 1), out.stderr
        return verdicts

    refused, everything = check({"where": {"batch_size": 2}, "match_rate_min": 1.0}, {"match_rate_min": 1.0})
    assert not refused["passed"] and "1 selected cell(s) were refused (unsupported)" in refused["detail"]
    assert why[2] in refused["detail"] and why[4] not in refused["detail"]
    assert not everything["passed"] and why[2] in everything["detail"] and why[4] in everything["detail"]
    assert "2 selected cell(s)" in everything["detail"]
    allowed, expected = check({"match_rate_min": 1.0, "allow_unsupported": True},
                              {"where": {"batch_size": 4}, "status": "unsupported"})
    assert allowed["passed"] and expected["passed"]
    only_refused = check({"where": {"batch_size": 2}, "match_rate_min": 1.0, "allow_unsupported": True})[0]
    assert not only_refused["passed"] and "judged nothing" in only_refused["detail"]
