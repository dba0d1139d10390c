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
MARKUP = ["[/INST]", "[bold]", " word", "[/", "]", "<!--", "<script>", "</script>", "\x07 &amp;", "\x1b[2J\x00",
          "\ufffd\u202e"]


def _folder(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out[1]", ["p1"], {"batch_size": [1, 2], "gpu": ["any", "A100"]},
                                     repeats=3)
    for cell in cells:
        rows = []
        for repeat in range(3):
            if cell["gpu"] == "A100":
                rows.append(row_for(cell, "p1", repeat, status="failed", error="cannot open [/data/x] [red] \x1b[31m"))
                continue
            split = 2 if cell["batch_size"] == 2 and repeat == 2 else 0  # ' word' where the others say '[/INST]'
            tokens = [1, 3, split, 4, 5, 6, 7, 8, 9, 10]
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

    def spec(**over):
        base = dict(engine="llamacpp", model="smollm2-135m", dtype="auto", gpu="any", batch_invariant=False,
                    options={"n_threads": 2})
        return LoadSpec(**(base | over))

    q4, f32 = spec(), spec(dtype="f32", options={"n_threads": 2, "flash_attn": "on"})
    assert q4.label([q4]) == "llamacpp / smollm2-135m"
    assert f32.label([q4, f32]) == "llamacpp / smollm2-135m dtype=f32 flash_attn=on"
    assert q4.label([q4, f32]) == "llamacpp / smollm2-135m dtype=auto flash_attn=None"
    keyed = [spec(options={"api_key": "sk-1"}), spec(options={"api_key": "sk-2"})]
    assert "sk-" not in keyed[0].label(keyed)  # a key never reaches a log line
    # with no others: engine and model, and every field off its plain value (options never)
    assert q4.label() == "llamacpp / smollm2-135m"
    assert spec(dtype="f16", gpu="A100", draft_tokens=4).label() == "llamacpp / smollm2-135m dtype=f16 gpu=A100 draft_tokens=4"


def test_a_summary_in_a_ci_log_at_80_columns_keeps_every_prompt_id_and_header_whole(tmp_path):
    """Without a terminal (a CI log, `| tee`), at COLUMNS=80: the quickstart's shape fits in 80
    columns; a prompt id too long for them is printed whole anyway, never ending in an ellipsis."""
    long_id = "a-prompt-id-much-too-long-to-fit-in-an-eighty-column-table-at-all"
    ids = ["capital", "code", "explain", "hello", "story"]
    env = dict(os.environ, COLUMNS="80")
    for prompts, fits in ((ids, True), (ids + [long_id], False)):
        root = tmp_path / str(len(prompts))
        folder, cells = synthetic_folder(root / "out", prompts, {"batch_size": [1, 4]}, repeats=3)
        for cell in cells:
            folder.write_cell(cell.id, [row_for(cell, p, r, [1, 2, 3]) for p in prompts for r in range(3)], "t")
        done = subprocess.run([sys.executable, "-m", "harness", "summarize", "out"], cwd=root, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        table = lines[:lines.index("columns: batch = batch_size") + 1]  # the legend spells out the short names
        assert "…" not in done.stdout
        for header in ("batch", "prompt", "status", "runs", "unique", "match", "diverge@", "min/med", "upper95",
                       "tok/s"):
            assert header in table[1] + table[2], header
        for prompt in prompts:
            assert any(line.split()[1:2] == [prompt] for line in table), prompt
        assert max(len(line) for line in table) <= 80 or not fits


def test_every_reader_takes_model_text_with_markup_controls_and_replaced_bytes(tmp_path):
    """Rich markup, HTML, control characters (an escape sequence, NUL) and the replacement character
    of undecodable bytes pass through every reader without an error, and no control character
    reaches the terminal raw."""
    folder = _folder(tmp_path)
    root = str(folder.root)
    for args in ([*w] for w in (["summarize", root, "--what", what] for what in
                                ("cells", "slowdown", "probes", "answers", "splits"))):
        for fmt in ("table", "json", "csv"):
            done = run_harness(*args, "--format", fmt)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (args, fmt, done.stderr)
            if fmt != "csv":  # CSV is data for scripts and keeps the text as it is; a table or JSON shows it escaped
                assert "\x1b" not in done.stdout + done.stderr and "\x00" not in done.stdout, (args, fmt)
    for args in (["status", root], ["status", root, "-f", "json"], ["compare", root, root],
                 ["plot", root, "-o", str(tmp_path / "plots")], ["report", root, "-o", str(tmp_path / "r.html")]):
        done = run_harness(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        assert "\x1b" not in done.stdout + done.stderr, args
    status = subprocess.run([sys.executable, "-m", "harness", "status", root], capture_output=True, text=True,
                            env=dict(os.environ, COLUMNS="400")).stdout
    assert "[red] \\x1b[31m" in status  # an error's escape sequence, shown written out
    html = (tmp_path / "r.html").read_text()
    assert "\\u001b[2J" in html or "\\u001b" in html  # in the page's data, JSON-escaped
    assert list((tmp_path / "plots").glob("splits.*"))
