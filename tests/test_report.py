"""`harness report` opened in a real headless Chromium (Debian's), and `harness plot`.

The page is checked against the rows: the highlighted token is where the statistics say the
run departs, the filters change what is shown, pagination works on thousands of runs, and the
browser logs no error. A screenshot is kept as a test artifact (HARNESS_ARTIFACTS or
./test-artifacts).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.analysis import divergence
from harness.results.store import Store

from .conftest import needs_browser, needs_llama, row_for, run_harness, synthetic_folder

ARTIFACTS = Path(os.environ.get("HARNESS_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


def _open(browser, path: Path, width: int = 1280):
    """A page with the report loaded, and the list that collects its console errors."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"network request: {r.url}") if not r.url.startswith(("file:", "data:")) else None)
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    return page, errors


def _count(entries) -> int:
    """Runs behind the shown entries (an entry stands for the runs of a cell and prompt that show the same)."""
    return int(entries.evaluate_all("rs => rs.reduce((n, r) => n + Number(r.dataset.count), 0)"))


def _select(page, name: str, value: str) -> None:
    page.select_option(f"#filter-{name}", value)


@needs_llama
@needs_browser
@pytest.mark.engine
def test_report_highlights_the_split_where_the_rows_say(probed_results, tmp_path, browser):
    out = tmp_path / "report.html"
    done = run_harness("report", str(probed_results), "-o", str(out), "-r", "seed=1")
    assert done.returncode == 0, done.stderr
    store = Store(probed_results)
    rows = store.read_rows()
    judged = divergence.against_reference(rows, store.tokens_for, {"seed": 1})
    split = judged[judged.first_divergence.notna()]
    assert len(split) > 0  # the fixture's seed-2 runs depart from seed 1 (temperature 1), on any CPU

    page, errors = _open(browser, out)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)

    for r in judged.itertuples():
        row = page.locator(f".run[data-cell='{r.cell_id}'][data-prompt='{r.prompt_id}'][data-repeats~='{r.repeat}']")
        assert row.count() == 1  # the entry that holds this run (runs that show the same are one entry)
        marked = row.locator(".tok.split")
        if np.isnan(r.first_divergence):
            assert marked.count() == 0
            continue
        k = int(r.first_divergence)
        assert marked.count() == 1 and marked.get_attribute("data-i") == str(k)
        assert marked.inner_text() == r.token_texts[k]
        assert row.locator(".tok.same").count() == k  # the shared prefix is dimmed, nothing more
        assert f"departs at token {k}" in row.locator(".label").inner_text()

    shown = lambda: _count(page.locator(".run:not(.is-ref)"))  # noqa: E731
    compared = judged[~judged.is_reference]
    assert shown() == len(compared)
    _select(page, "batch_size", "2")
    assert shown() == int((compared.batch_size == 2).sum())
    assert set(page.locator(".run:not(.is-ref)").evaluate_all("rs => rs.map(r => r.dataset.batch_size)")) == {"2"}
    _select(page, "show", "diverged")
    assert shown() == int((split.batch_size == 2).sum())
    _select(page, "batch_size", "")
    _select(page, "dtype", "f32")
    assert shown() == 0 and "No run matches" in page.inner_text("#groups")
    assert "logits moved" in page.inner_text("#probe-body")  # probes shown
    # survival of agreement: a line and a band per setting compared; flips by margin: a point per
    # setting and margin bucket with steps at risk (the seed-2 departures have recorded margins)
    settings = judged[judged.matched.notna()].groupby(["seed", "dtype", "batch_size"]).ngroups
    assert page.locator("svg[aria-label='survival of agreement'] path").count() == 2 * settings
    assert page.locator("svg[aria-label='flips by margin'] circle").count() > 0
    assert errors == []


def _synthetic(root: Path, prompts: int, repeats: int):
    """A results folder with many runs and known splits: batch-8 run r of prompt p departs at token
    (p + r) % 40 when (p + r) % 3 != 0, each with a token of its own (so each is a distinct output)."""
    ids = [f"p{p:03d}" for p in range(prompts)]
    folder, cells = synthetic_folder(root, ids, {"batch_size": [1, 4, 8]}, repeats=repeats, max_tokens=48)
    by_batch = {c["batch_size"]: c for c in cells}
    ref_tokens = list(range(100, 148))
    for batch in (1, 8):
        cell_rows = []
        for p in range(prompts):
            for r in range(repeats):
                toks = list(ref_tokens)
                if batch == 8 and (p + r) % 3 != 0:
                    toks[(p + r) % 40] = 1000 + r
                cell_rows.append(row_for(
                    by_batch[batch], ids[p], r, toks, max_tokens=48, token_texts=[f"<{t}>" for t in toks],
                    text="".join(f"<{t}>" for t in toks), margins=[0.5] * len(toks), run_id="x",
                ))
        folder.write_cell(by_batch[batch].id, cell_rows, "x")
    folder.write_cell(by_batch[4].id, [row_for(by_batch[4], "p000", r, max_tokens=48, status="failed",
                                               error="engine worker killed by signal SIGKILL")
                                       for r in range(2)], "x")
    return folder


@needs_browser
def test_report_paginates_thousands_of_runs(tmp_path, browser):
    store = _synthetic(tmp_path / "big", prompts=30, repeats=70)  # 4,200 runs in 30 blocks, plus one of failures
    out = tmp_path / "big.html"
    done = run_harness("report", str(store.root), "-o", str(out))
    assert done.returncode == 0, done.stderr
    departed = sum(1 for p in range(30) for r in range(70) if (p + r) % 3 != 0)
    # the summary line counts runs (entries aggregate them): 4,200 ok and 2 failed
    assert f"4202 runs in 3 cells, {departed} departed" in " ".join(done.stdout.split())
    page, errors = _open(browser, out)
    # the split view: ~47 departures per prompt make trees of over 400 records in all; the largest
    # are shown whole, and the heading says how many more `summarize --what splits` holds
    heading = page.inner_text("#splits")
    assert "Where the outputs split" in heading and "more records in 'harness summarize --what splits'" in heading
    shown = page.locator("#probe-body table").last.locator("tr")
    assert 0 < shown.count() - 1 <= 400
    info = page.inner_text("#pager-top .page-info")
    assert info.startswith("page 1 of 2") and "31 block(s)" in info  # a block: one prompt, one reference or status
    assert page.locator(".group").count() == 25
    first = page.locator(".group").first.get_attribute("data-group")
    page.click("#pager-top .next")
    assert page.inner_text("#pager-top .page-info").startswith("page 2 of 2")
    assert page.locator(".group").first.get_attribute("data-group") != first
    group = page.locator(".group").first
    entries = group.locator(".run:not(.is-ref)")
    # 69 batch-1 repeats identical to the reference: one entry; batch 8: one entry for the runs
    # that match, one per departed run (each a distinct output): 40 entries shown at first
    assert entries.count() == 40
    group.locator("button.more").click()
    group = page.locator(".group").first
    entries = group.locator(".run:not(.is-ref)")
    prompt = int(group.get_attribute("data-group").split("|")[0].removeprefix("p"))
    departed = sum(1 for r in range(70) if (prompt + r) % 3 != 0)
    assert entries.count() == 1 + 1 + departed and group.locator("button.more").count() == 0
    assert _count(entries) == 69 + 70  # every run is behind an entry, none twice
    same = group.locator(".run[data-count='69']")
    assert same.count() == 1 and "69 runs, repeats 1–69" in same.inner_text()
    for row in entries.all():
        if row.get_attribute("data-fd"):
            assert row.locator(".tok.split").get_attribute("data-i") == row.get_attribute("data-fd")
    _select(page, "show", "problems")  # failed rows are shown with their cause
    assert _count(page.locator(".run")) == 2 and page.locator("#groups .badge.failed").count() == 1
    assert "SIGKILL" in page.inner_text("#groups")
    assert errors == []


def test_plot_writes_figures_and_their_numbers(tmp_path):
    store = _synthetic(tmp_path / "small", prompts=6, repeats=3)
    done = run_harness("plot", str(store.root), "-o", str(tmp_path / "plots"))
    assert done.returncode == 0, done.stderr
    for name in ("identical", "divergence", "margins", "splits"):
        for ext in ("png", "svg", "csv"):
            assert (tmp_path / "plots" / f"{name}.{ext}").stat().st_size > 0
    assert (tmp_path / "plots" / "identical.png").read_bytes()[:4] == b"\x89PNG"
    assert "left out" in done.stdout and "slowdown" in done.stdout  # no batch-invariant pairs here
    # margins at the split, read for the departing runs and their references only: every row says 0.5
    margins = pd.read_csv(tmp_path / "plots" / "margins.csv")
    assert len(margins) == 12 and (margins.margin_run == 0.5).all() and (margins.margin_reference == 0.5).all()
    identical = (tmp_path / "plots" / "identical.csv").read_text().splitlines()
    # batch 1: repeats 1 and 2 of 6 prompts, all identical; batch 8: two runs in three depart
    assert identical[1:] == ["llamacpp,1,12,12,1.0", "llamacpp,8,18,6,0.3333333333333333"]
    # the split view: each prompt's batch-8 runs (3: one as the reference, two departing at their
    # own token) part at the earlier of the two departures; batch 1 never splits
    splits = pd.read_csv(tmp_path / "plots" / "splits.csv")
    first = splits[splits.depth == 0]
    assert set(first.batch_size) == {8} and (first.groupby("prompt_id").runs.sum() == 3).all()
    for p in range(6):
        departs = sorted((p + r) % 40 for r in range(3) if (p + r) % 3 != 0)
        assert set(first[first.prompt_id == f"p{p:03d}"].split_at) == {departs[0]}


def test_report_and_plot_refuse_an_empty_folder(tmp_path):
    for command in ("report", "plot"):
        done = run_harness(command, str(tmp_path))
        assert done.returncode != 0 and "no results here" in done.stderr


@needs_browser
def test_report_shows_the_batch_invariant_latency_cost(tmp_path, browser):
    """Beside the throughput bars, the slowdown chart's table of TTFT / ITL / TPOT / E2EL percentiles off and
    on (a stand-in folder written by hand: no CPU runs the mode)."""
    root = tmp_path / "out"
    folder, cells = synthetic_folder(root, ["p"], {"batch_size": [4], "batch_invariant": [False, True]}, repeats=2)
    for cell in cells:
        slow = 2.5 if cell["batch_invariant"] else 1.0
        folder.write_cell(cell.id, [row_for(cell, "p", r, [1, 2, 3, 4], ttft_s=0.1 * slow, itl_s=[0.02 * slow] * 3,
                                            target_tokens_per_s=4 / (0.16 * slow), batch_tokens_per_s=16 / (0.16 * slow))
                                    for r in range(2)], "x")
    done = run_harness("report", str(root), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    page, errors = _open(browser, tmp_path / "r.html")
    rows = page.locator("table.serving tr").all_inner_texts()
    assert not errors
    assert len(rows) == 5 and "TTFT\t100.0 / 100.0 / 100.0\t250.0 / 250.0 / 250.0\t2.5 / 2.5 / 2.5" in rows[1]
