"""`harness report` opened in a real headless Chromium (Debian's), and `harness plot`.

The page is checked against the rows: the highlighted token is where the statistics say the
run departs, the filters change what is shown, pagination works on thousands of runs, and the
browser logs no error. A screenshot is kept as a test artifact (HARNESS_ARTIFACTS or
./test-artifacts).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness import metrics
from harness.store import Store

from .conftest import needs_llama, row_for, run_harness, synthetic_folder

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HAVE_BROWSER = Path(CHROMIUM).exists() and importlib.util.find_spec("playwright") is not None
# On CI the browser is installed by .ci/run: a missing one is a failure there, not a skip.
needs_browser = pytest.mark.skipif(
    not HAVE_BROWSER and not os.environ.get("CI"), reason="Debian's chromium or playwright not installed"
)
ARTIFACTS = Path(os.environ.get("HARNESS_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


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
    judged = metrics.against_reference(rows, store.tokens_for, {"seed": 1})
    split = judged[judged.first_divergence.notna()]
    assert len(split) > 0  # the fixture's seed-2 runs depart from seed 1 (temperature 1), on any CPU

    page, errors = _open(browser, out)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)

    for r in judged.itertuples():
        row = page.locator(f".run[data-cell='{r.cell_id}'][data-prompt='{r.prompt_id}'][data-repeat='{r.repeat}']")
        assert row.count() == 1
        marked = row.locator(".tok.split")
        if np.isnan(r.first_divergence):
            assert marked.count() == 0
            continue
        k = int(r.first_divergence)
        assert marked.count() == 1 and marked.get_attribute("data-i") == str(k)
        assert marked.inner_text() == r.token_texts[k]
        assert row.locator(".tok.same").count() == k  # the shared prefix is dimmed, nothing more
        assert f"departs at token {k}" in row.locator(".label").inner_text()

    shown = lambda: page.locator(".run:not(.is-ref)")  # noqa: E731
    compared = judged[~judged.is_reference]
    assert shown().count() == len(compared)
    _select(page, "batch_size", "2")
    assert shown().count() == int((compared.batch_size == 2).sum())
    assert set(shown().evaluate_all("rs => rs.map(r => r.dataset.batch_size)")) == {"2"}
    _select(page, "show", "diverged")
    assert shown().count() == int((split.batch_size == 2).sum())
    _select(page, "batch_size", "")
    _select(page, "dtype", "f32")
    assert shown().count() == 0 and "No run matches" in page.inner_text("#groups")
    assert "logits moved" in page.inner_text("#probe-body")  # probes shown
    assert errors == []


def _synthetic(root: Path, prompts: int, repeats: int):
    """A results folder with many runs and known splits: run r of prompt p departs at token (p + r) % 40."""
    ids = [f"p{p:03d}" for p in range(prompts)]
    folder, cells = synthetic_folder(root, ids, {"batch_size": [1, 4, 8]}, repeats=repeats, max_tokens=48)
    by_batch = {c["batch_size"]: c for c in cells}
    ref_tokens = list(range(100, 148))
    for batch in (1, 8):
        cell_rows = []
        for p in range(prompts):
            for r in range(repeats):
                toks = list(ref_tokens)
                if batch == 8 and (p + r) % 3 == 0:
                    toks[(p + r) % 40] = 7
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
    store = _synthetic(tmp_path / "big", prompts=120, repeats=25)  # 6,000 runs in 120 blocks
    out = tmp_path / "big.html"
    done = run_harness("report", str(store.root), "-o", str(out))
    assert done.returncode == 0, done.stderr
    page, errors = _open(browser, out)
    info = page.inner_text("#pager-top .page-info")
    assert info.startswith("page 1 of 5") and "121 block(s)" in info  # a block: one prompt, one reference or status
    assert page.locator(".group").count() == 25
    first = page.locator(".group").first.get_attribute("data-group")
    page.click("#pager-top .next")
    assert page.inner_text("#pager-top .page-info").startswith("page 2 of 5")
    assert page.locator(".group").first.get_attribute("data-group") != first
    group = page.locator(".group").first  # 24 batch-1 repeats and 25 batch-8 runs: 40 shown at first
    assert group.locator(".run:not(.is-ref)").count() == 40
    group.locator("button.more").click()
    group = page.locator(".group").first
    assert group.locator(".run:not(.is-ref)").count() == 49 and group.locator("button.more").count() == 0
    _select(page, "show", "problems")  # failed rows are shown with their cause
    assert page.locator(".run").count() == 2 and page.locator("#groups .badge.failed").count() == 2
    assert "SIGKILL" in page.inner_text("#groups")
    for row in group.locator(".run[data-fd]:not([data-fd=''])").all():
        assert row.locator(".tok.split").get_attribute("data-i") == row.get_attribute("data-fd")
    assert errors == []


def test_plot_writes_figures_and_their_numbers(tmp_path):
    store = _synthetic(tmp_path / "small", prompts=6, repeats=3)
    done = run_harness("plot", str(store.root), "-o", str(tmp_path / "plots"))
    assert done.returncode == 0, done.stderr
    for name in ("identical", "divergence", "margins"):
        for ext in ("png", "svg", "csv"):
            assert (tmp_path / "plots" / f"{name}.{ext}").stat().st_size > 0
    assert (tmp_path / "plots" / "identical.png").read_bytes()[:4] == b"\x89PNG"
    assert "left out" in done.stdout and "slowdown" in done.stdout  # no batch-invariant pairs here
    identical = (tmp_path / "plots" / "identical.csv").read_text().splitlines()
    # batch 1: repeats 1 and 2 of 6 prompts, all identical; batch 8: one run in three departs
    assert identical[1:] == ["llamacpp,1,12,12,1.0", "llamacpp,8,18,12,0.6666666666666666"]


def test_report_and_plot_refuse_an_empty_folder(tmp_path):
    for command in ("report", "plot"):
        done = run_harness(command, str(tmp_path))
        assert done.returncode != 0 and "no results here" in done.stderr
