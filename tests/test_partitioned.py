"""A campaign's statistics part by part (harness.analysis.partitioned) equal those of one
whole-folder read, table by table as the CSV `summarize` writes, on a seeded folder that has what a
campaign has: several seeds and batch sizes, batch-invariant pairs, failed runs, two engine loads
per cell, log-probabilities that move, near ties, parsed answers, serving latencies, a missing cell,
and stale cells read with --all-cells. Parts are made small here (BUDGET rows: four to seven parts of a
400-row campaign) so that units land in different parts; test_part_whole.py cuts generated folders into
parts down to one row each, and the 1M-row check is scripts/bench_scale.py."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import yaml

from harness.analysis.folder_analysis import TABLES, Analysis
from harness.analysis.partitioned import PartitionedAnalysis, streamed
from harness.analysis.splits import folder_splits
from harness.core.errors import HarnessError
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results.folder_rows import open_results
from harness.results.rows import logprobs_hash

from .conftest import row_for, synthetic_folder

PROMPTS = ["p1", "p2", "p3", "p4"]
REPEATS = 6
#: rows per part: each part costs a fixed half second here (it reads every cell file), so a few parts
#: test the joins as well as twenty do, in a quarter of the time
BUDGET = 100
BASE = {p: [100 + 7 * i + j for j in range(12)] for i, p in enumerate(PROMPTS)}


def _runs(cell, rng: np.random.Generator) -> list[dict]:
    """A cell's rows: batch 1 mostly agrees with itself, larger batches depart at seeded steps."""
    rows = []
    for prompt in PROMPTS:
        for repeat in range(REPEATS):
            tokens = list(BASE[prompt])
            if rng.random() < (0.1 if cell["batch_size"] == 1 else 0.4):
                at = int(rng.integers(0, len(tokens)))
                tokens[at:] = [int(t) for t in rng.integers(900, 990, size=len(tokens) - at)]
            if rng.random() < 0.15:
                tokens = tokens[:int(rng.integers(3, len(tokens)))]  # ended early: censored
            if rng.random() < 0.05:
                rows.append(row_for(cell, prompt, repeat, status="failed", error="engine died (seeded)"))
                continue
            lp = [-0.25 * j - (0.001 if rng.random() < 0.3 else 0.0) for j in range(len(tokens))]
            margins = [float(m) for m in rng.choice([0.01, 0.05, 0.5, 3.0], size=len(tokens))]
            answer = "yes" if tokens[0] == BASE[prompt][0] else "no"
            rows.append(row_for(
                cell, prompt, repeat, tokens, schema_version=3, logprobs=lp, logprobs_hash=logprobs_hash(lp),
                margins=margins, load_id=f"{cell.id}-{repeat // 3}", target_tokens_per_s=float(rng.uniform(10, 50)),
                batch_tokens_per_s=float(rng.uniform(20, 90)), ttft_s=float(rng.uniform(0.01, 0.2)),
                itl_s=[float(x) for x in rng.uniform(0.01, 0.05, size=max(0, len(tokens) - 1))],
                answer_parsed=answer if prompt in ("p1", "p2") else None,
                answer_expected="yes" if prompt in ("p1", "p2") else None,
                answer_correct=(answer == "yes") if prompt in ("p1", "p2") else None,
                cpu_kernels="avx512" if cell["seed"] == 0 else "amx",
                engine_info=json.dumps({"extra_bufts": "off (auto: AMX crashed here)" if cell["seed"] == 1 else "on"})))
    return rows


def _campaign(root, repeats: int = REPEATS, seeds: tuple[int, ...] = (0, 1, 2)):
    folder, cells = synthetic_folder(root, PROMPTS, {"batch_size": [1, 2, 4], "batch_invariant": [False, True],
                                                     "seed": list(seeds)}, repeats=repeats, max_tokens=12)
    spec_path = root.parent / f"{root.name}.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    for p in spec["prompts"][:2]:
        p |= {"answer": "yes", "parse": "exact"}
    spec_path.write_text(yaml.safe_dump(spec))
    loaded = load_experiment(spec_path)
    folder.adopt(loaded)
    rng = np.random.default_rng(45)
    for cell in expand(loaded):
        if (cell["batch_size"], cell["seed"], cell["batch_invariant"]) == (4, 2, True):
            continue  # never ran: a missing cell
        folder.write_cell(cell.id, _runs(cell, rng), "t")
    return folder


def _csv(frame) -> str:
    out = io.StringIO()
    frame.to_csv(out, index=False)
    return out.getvalue()


def _assert_equal(results, budget: int, workers: int, **options) -> None:
    # the seeds' loads differ in CPU kernels and in what llama.cpp chose (both in the notes)
    options.setdefault("allow_mixed", frozenset({"cpu_kernels", "engine_info"}))
    parts = streamed(Analysis(results, **options), budget=budget, workers=workers)
    assert isinstance(parts, PartitionedAnalysis) and len(parts.parts) > 2
    whole = Analysis(results, **options)
    for name in TABLES:
        assert not whole.table(name).empty or name in ("probes",), name  # the folder exercises the table
        assert _csv(parts.table(name)) == _csv(whole.table(name)), name
    assert _csv(parts.latency) == _csv(whole.latency)
    assert not folder_splits(whole).empty and _csv(folder_splits(parts)) == _csv(folder_splits(whole))
    assert parts.notes == whole.notes and len(whole.notes) == 3


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    return _campaign(tmp_path_factory.mktemp("campaign") / "results")


def test_parts_in_worker_processes_equal_the_whole_folder(campaign):
    _assert_equal(open_results(campaign.root), budget=BUDGET, workers=2)


@pytest.mark.parametrize("options", [{"reference": {"seed": 0}, "reference_run": "modal"},
                                     {"reference": {"batch_size": 2}, "near_tie": 0.02, "confident": 1.0}])
def test_parts_equal_the_whole_folder_under_other_references(campaign, options):
    _assert_equal(open_results(campaign.root), budget=BUDGET, workers=1, **options)


def test_stale_cells_read_with_all_cells_are_planned_from_their_rows(tmp_path):
    """A changed experiment leaves the old cells stale: --all-cells reads them, and their units come
    from their files' first rows (no experiment names them any more)."""
    first = _campaign(tmp_path / "results")
    _campaign(tmp_path / "results", seeds=(3, 4))  # the new version: other cells, the old ones stale
    results = open_results(first.root, all_cells=True)
    assert len(results.stale) == 17
    _assert_equal(results, budget=BUDGET, workers=1)


def test_two_cells_of_one_setting_are_refused_part_by_part_too(tmp_path):
    """Stale and current cells of the same setting and prompt: the whole-folder read refuses them,
    naming both, and so does the read part by part (they fall in one part; the pair it names first
    may be another of the same kind)."""
    first = _campaign(tmp_path / "results")
    _campaign(tmp_path / "results", repeats=REPEATS + 1)  # same settings, new cell ids
    results = open_results(first.root, all_cells=True)
    with pytest.raises(HarnessError, match="both claim prompt"):
        Analysis(results).summary
    with pytest.raises(HarnessError, match="both claim prompt .* they come from different experiments"):
        streamed(Analysis(results), budget=1, workers=1).summary


def test_a_folder_within_one_part_is_read_whole(campaign):
    analysis = Analysis(open_results(campaign.root))
    assert streamed(analysis) is analysis


def test_summarize_and_check_read_a_folder_above_one_part_part_by_part(campaign, monkeypatch):
    """The commands as a user runs them: with parts of BUDGET rows, `summarize --format csv` of these
    tables is the whole-folder CSV, and `check` gives the verdicts a whole-folder read gives."""
    from harness.analysis import partitions

    from .conftest import run_harness

    monkeypatch.setattr(partitions, "PART_ROWS", BUDGET)  # the forked command sees it
    whole = Analysis(open_results(campaign.root))  # batch sizes of one seed: one load's kernels, no mixing
    assert len(partitions.plan(whole.results, whole.reference, BUDGET)) > 2
    for name in ("cells", "settings", "flips", "splits"):
        done = run_harness("summarize", str(campaign.root), "--what", name, "--format", "csv")
        assert done.returncode == 0, done.stderr
        assert done.stdout == _csv(folder_splits(whole) if name == "splits" else whole.table(name)), name
    rules = campaign.root.parent / "expect.yaml"
    rules.write_text("expect:\n  - {where: {batch_size: 1}, match_rate_min: 0.5}\n"
                     "  - {where: {batch_size: 4}, match_rate_min: 0.99}\n")
    check = ["check", str(campaign.root), "--expect", str(rules), "--format", "json"]
    parts = run_harness(*check)
    monkeypatch.setattr(partitions, "PART_ROWS", 10**9)
    whole_check = run_harness(*check)
    assert parts.returncode == whole_check.returncode == 1, parts.stderr  # batch 4 departs: the gate fails
    assert parts.stdout == whole_check.stdout


def test_the_report_part_by_part_shows_what_a_whole_read_shows(campaign):
    """Every number, entry and chart of the HTML report's data, read part by part and whole."""
    from harness.report import html

    results = open_results(campaign.root)
    parts = streamed(Analysis(results), budget=BUDGET, workers=1)
    assert isinstance(parts, PartitionedAnalysis)
    payloads = [html.build(parts), html.build(Analysis(results))]
    for payload in payloads:
        payload["meta"].pop("generated_at")
    assert payloads[0]["runs"] and payloads[0]["charts"]["splits"]["records"] and payloads[0]["charts"]["margins"]
    texts = [json.dumps(p, sort_keys=True) for p in payloads]
    assert texts[0] == texts[1]


def test_a_report_entry_lists_its_first_repeat_ranges_and_counts_the_rest():
    """A campaign's entry of thousands of runs scattered over the repeats: the page lists the first
    RANGES_SHOWN ranges and says how many more there are, so the file stays small and says so."""
    from harness.report.html import RANGES_SHOWN, _ranges

    assert _ranges([3, 1, 2, 7]) == {"repeats": [[1, 3], [7, 7]]}
    scattered = _ranges(list(range(0, 200, 2)))
    assert scattered["repeats"] == [[r, r] for r in range(0, 2 * RANGES_SHOWN, 2)]
    assert scattered["ranges_left_out"] == 100 - RANGES_SHOWN


def test_workers_are_sized_by_memory_as_well_as_by_cores():
    """The report's parts (500,000 rows, about 1.25 GB a worker) take 2 workers within the 4 GB budget
    however many cores a login node has; the statistics' parts take up to MOST_WORKERS; a machine short of
    memory now gets fewer; never none."""
    from harness.analysis.partitioned import MOST_WORKERS, workers_here
    from harness.analysis.partitions import PART_ROWS, REPORT_PART_ROWS

    gib = 1 << 30
    assert workers_here(REPORT_PART_ROWS, cpus=16, available=64 * gib) == 2
    assert workers_here(PART_ROWS, cpus=16, available=64 * gib) == MOST_WORKERS
    assert workers_here(PART_ROWS, cpus=1, available=64 * gib) == 1
    assert workers_here(PART_ROWS, cpus=16, available=2 * gib) == 1
    assert workers_here(REPORT_PART_ROWS, cpus=16, available=gib // 2) == 1
