"""Reading a results folder never writes into it: every reader works on a read-only copy (an
archived folder, a colleague's results on a read-only share)."""

from __future__ import annotations

import hashlib
import json

from .conftest import read_only, row_for, run_harness, synthetic_folder


def _fingerprint(root):
    return {p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_every_reader_works_on_a_read_only_folder_and_writes_only_where_asked(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1", "p2"], {"batch_size": [1, 2]}, repeats=2)
    for cell in cells:
        rows = [row_for(cell, p, r, [1, 2, 3] if cell["batch_size"] == 1 or p == "p1" else [1, 2, 4])
                for p in ("p1", "p2") for r in (0, 1)]
        folder.write_cell(cell.id, rows, "t")
    (tmp_path / "rules.yaml").write_text("expect:\n  - {where: {batch_size: 1}, unique_outputs: 1}\n")
    before = _fingerprint(tmp_path / "out")
    with read_only(tmp_path / "out"):
        for args in (["summarize", "out"], ["summarize", "out", "--what", "splits"],
                     ["summarize", "out", "-f", "json", "--what", "answers"],
                     ["status", "out"], ["status", "out", "--format", "json"],
                     ["check", "out", "--expect", "rules.yaml", "--junit", "junit.xml"],
                     ["report", "out", "-o", "r.html"], ["plot", "out", "-o", "plots", "-f", "svg"],
                     ["compare", "out", "out"], ["check", "out", "--expect", "rules.yaml", "-f", "json"]):
            done = run_harness(*args, cwd=tmp_path)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stdout, done.stderr)
        for args in (["report", "out"], ["plot", "out"], ["summarize", "out", "--save"]):
            done = run_harness(*args, cwd=tmp_path)  # asked to write into it: refused, saying why
            assert done.returncode == 1 and "read-only" in done.stderr, (args, done.stderr)
            assert "Traceback" not in done.stderr
        status = json.loads(run_harness("status", "out", "-f", "json", cwd=tmp_path).stdout)
        assert status["counts"] == {"done": 2} and {s["settings"]["batch_size"] for s in status["states"]} == {1, 2}
        check = run_harness("check", "out", "--expect", "rules.yaml", "-f", "json", cwd=tmp_path)
        assert check.returncode == 0 and json.loads(check.stdout)["passed"] is True, check.stdout
    assert _fingerprint(tmp_path / "out") == before
    assert (tmp_path / "r.html").stat().st_size > 0 and list((tmp_path / "plots").glob("*.svg"))
    done = run_harness("summarize", "out", "--save", cwd=tmp_path)  # writable again: --save writes the summaries
    assert done.returncode == 0 and (tmp_path / "out" / "summary.parquet").is_file(), done.stderr
