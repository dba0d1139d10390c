"""Model output, error messages and paths are printed as text, never read as rich markup."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from harness.report.progress import RichReporter

from .conftest import needs_browser, row_for, run_harness, synthetic_folder
from .test_report import _open

#: what a model may well say, and what rich would take for markup
MARKUP = ["[/INST]", "[bold]", " word", "[/", "]", "<!--", "<script>", "</script>", "\x07 &amp;"]


def _folder(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out[1]", ["p1"], {"batch_size": [1, 2], "gpu": ["any", "A100"]},
                                     repeats=3)
    for cell in cells:
        rows = []
        for repeat in range(3):
            if cell["gpu"] == "A100":
                rows.append(row_for(cell, "p1", repeat, status="failed", error="cannot open [/data/x] [red]"))
                continue
            split = 2 if cell["batch_size"] == 2 and repeat == 2 else 0  # ' word' where the others say '[/INST]'
            tokens = [1, 3, split, 4, 5, 6, 7, 8]
            rows.append(row_for(cell, "p1", repeat, tokens, token_texts=[MARKUP[t] for t in tokens],
                                text="".join(MARKUP[t] for t in tokens)))
        folder.write_cell(cell.id, rows, "t")
    return folder


def test_markup_in_outputs_errors_and_paths_prints_as_it_is(tmp_path):
    folder = _folder(tmp_path)
    splits = run_harness("summarize", str(folder.root), "--what", "splits")
    assert splits.returncode == 0, splits.stderr
    assert "Traceback" not in splits.stderr and "'[/INST]'" in splits.stdout and "' word'" in splits.stdout
    whole = run_harness("summarize", str(folder.root))
    assert whole.returncode == 0 and "out[1]" in whole.stdout, whole.stdout + whole.stderr
    wide = dict(os.environ, COLUMNS="400")  # the error column whole on one line
    status = subprocess.run([sys.executable, "-m", "harness", "status", str(folder.root)], capture_output=True,
                            text=True, env=wide)
    assert status.returncode == 0, status.stderr
    assert "cannot open [/data/x] [red]" in status.stdout


def test_a_log_line_with_markup_in_it_is_printed_not_parsed():
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, width=200))
    reporter.log("cell c failed: OSError: [Errno 2] No such file: '[/models/x.gguf]' [bold]")
    assert "'[/models/x.gguf]' [bold]" in out.getvalue()


@needs_browser
def test_the_report_shows_html_comments_and_script_tags_as_text(tmp_path, browser):
    folder = _folder(tmp_path)
    out = tmp_path / "report.html"
    done = run_harness("report", str(folder.root), "-o", str(out))
    assert done.returncode == 0, done.stderr
    page, errors = _open(browser, out)  # waits for the page's script to have run on the data
    shown = page.inner_text("#groups")
    assert "<!--" in shown and "<script>" in shown and "</script>" in shown and "[/INST]" in shown
    assert errors == []


def test_loading_lines_name_what_tells_the_loads_apart():
    from harness.engines.base import LoadSpec
    from harness.matrix import load_label

    def spec(**over):
        base = dict(engine="llamacpp", model="smollm2-135m", dtype="auto", gpu="any", batch_invariant=False,
                    options={"n_threads": 2})
        return LoadSpec(**(base | over))

    q4, f32 = spec(), spec(dtype="f32", options={"n_threads": 2, "flash_attn": "on"})
    assert load_label(q4, [q4]) == "llamacpp / smollm2-135m"
    assert load_label(f32, [q4, f32]) == "llamacpp / smollm2-135m dtype=f32 flash_attn=on"
    assert load_label(q4, [q4, f32]) == "llamacpp / smollm2-135m dtype=auto flash_attn=None"
    keyed = [spec(options={"api_key": "sk-1"}), spec(options={"api_key": "sk-2"})]
    assert "sk-" not in load_label(keyed[0], keyed)  # a key never reaches a log line
