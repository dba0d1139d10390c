"""Bad files, folders and arguments: a message naming what is wrong and the right exit code, never a
traceback, a hang or a lost result."""

from __future__ import annotations

import pytest

from .conftest import PROMPTS, row_for, run_harness, synthetic_folder

GOOD = "name: t\nprompts: prompts.yaml\nmatrix: {model: [smollm2-135m]}\n"


@pytest.mark.parametrize(("content", "says"), [
    (b"name: t\nprompts: [{id: a, text: \"caf\xe9\"}]\nmatrix: {model: [smollm2-135m]}\n",
     "exp.yaml:2: not UTF-8 text (byte 0xe9)"),
    (b"name: t\nprompts: [{id: a, text: \"x\x01y\"}]\nmatrix: {model: [smollm2-135m]}\n",
     "exp.yaml:2: invalid YAML: unacceptable character #x0001"),
    (GOOD.encode() + b"context: {text: \"  \\n \"}\n", "exp.yaml:4: context.text: only whitespace"),
    (b"\xff\xfe" + GOOD.encode("utf-16-le"), "exp.yaml:1: not UTF-8 text (byte 0xff)"),
])
def test_unreadable_experiment_text_is_refused_at_its_line(tmp_path, content, says):
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_bytes(content)
    done = run_harness("plan", "exp.yaml", cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr.replace("\n", " "), done.stderr
    assert "Traceback" not in done.stderr


def _folder(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2]})
    for cell in cells:
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2])], "t")
    return folder, cells


@pytest.mark.parametrize("damage", [b"", b"PAR1 cut short"])
def test_a_damaged_cell_file_is_named_by_every_reader_and_status_counts_it_not_done(tmp_path, damage):
    folder, cells = _folder(tmp_path)
    path = folder.store.cell_path(cells[0].id)
    path.write_bytes(damage)
    for args in (["summarize", "out"], ["report", "out", "-o", "r.html"], ["plot", "out", "-o", "plots"]):
        done = run_harness(*args, cwd=tmp_path)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert f"out/cells/{path.name}: not a readable Parquet file" in done.stderr.replace("\n", " ")
        assert "Move it out" in done.stderr
    status = run_harness("status", "out", "--ids", "missing,failed", cwd=tmp_path)
    assert status.returncode == 0 and status.stdout.split() == [cells[0].id]  # its cell runs again
    assert folder.store.cell_path(cells[1].id).stat().st_size > 0  # the other cell is untouched


def test_out_naming_a_file_and_junit_into_a_new_folder(tmp_path):
    folder, _ = _folder(tmp_path)
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(GOOD)
    (tmp_path / "a-file").write_text("x")
    done = run_harness("run", "exp.yaml", "--out", "a-file", cwd=tmp_path)
    assert done.returncode == 2 and "--out a-file: a file, not a folder" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "rules.yaml").write_text("expect:\n  - {unique_outputs: 1}\n")
    done = run_harness("check", "out", "--expect", "rules.yaml", "--junit", "reports/ci/junit.xml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "<testsuite" in (tmp_path / "reports" / "ci" / "junit.xml").read_text()


def test_models_export_takes_the_experiment_dtype_spellings_and_refuses_others_with_exit_2(tmp_path):
    done = run_harness("models", "export", "smollm2-135m", "--dtype", "int8", cwd=tmp_path)
    assert done.returncode == 2 and "--dtype: dtype 'int8' cannot be written as GGUF; allowed" in done.stderr
    assert "Traceback" not in done.stderr
