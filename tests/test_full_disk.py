"""A disk that fills up while results are written: the run stops with the cause named, every cell
that landed before stays whole, and no half-written file is left. A real tmpfs of 4 MiB stands in
for the full disk (mounting one needs root, which CI has; elsewhere these tests are skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from .conftest import PROMPTS, needs_llama, row_for, run_harness, synthetic_folder


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk):
    """Take every byte left on the disk (unbuffered: a buffered file's close would try the last bytes again
    and raise where they do not fit, depending on how much room the files before left)."""
    try:
        with open(disk / "filler", "wb", buffering=0) as handle:
            while True:
                handle.write(b"\0" * 65536)
    except OSError:
        pass


def _leftovers(root):
    return [p for p in root.rglob("*.tmp")]


def test_saving_summaries_onto_a_full_disk_names_the_cause_and_keeps_the_cells(small_disk):
    folder, cells = synthetic_folder(small_disk / "out", ["p1"], {"batch_size": [1, 2]})
    for cell in cells:
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2])], "t")
    before = {p.name: p.read_bytes() for p in folder.store.cell_files()}
    _fill(small_disk)
    done = run_harness("summarize", "out", "--save", cwd=small_disk)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "No space left on device" in done.stderr and "the disk or quota is full" in done.stderr
    assert {p.name: p.read_bytes() for p in folder.store.cell_files()} == before
    assert not _leftovers(small_disk / "out")
    with pytest.raises(OSError):  # a cell that cannot land leaves no partial file either
        folder.write_cell(cells[0].id, [row_for(cells[0], "p1", 0, [1, 2, 3])] * 2000, "t2", replace_done=True)
    assert not _leftovers(small_disk / "out") and folder.store.cell_files()[0].read_bytes() in before.values()


#: enough work per cell (8 generations of 64 tokens) that a fast machine still lands the first cell
#: well before the last, so the disk fills in the middle of the run
FILLING = """
name: filling
prompts: prompts.yaml
repeats: 4
max_tokens: 64
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2, 3]
engine_options:
  llamacpp: {ignore_eos: true, n_threads: 2}
"""


@needs_llama
def test_a_run_whose_disk_fills_up_stops_with_the_cause_and_keeps_what_landed(small_disk):
    """The disk fills as soon as the first cell lands: the run ends with exit 1 naming the full disk,
    no traceback; the landed cell reads back whole and the folder has no half-written file."""
    (small_disk / "prompts.yaml").write_text(PROMPTS)
    (small_disk / "exp.yaml").write_text(FILLING)
    run = subprocess.Popen([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--no-summary"],
                           cwd=small_disk, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "COLUMNS": "400"})
    cells = small_disk / "out" / "cells"
    deadline = time.monotonic() + 240
    while not list(cells.glob("*.parquet")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _fill(small_disk)
    out, err = run.communicate(timeout=240)
    assert run.returncode == 1 and "Traceback" not in err, out + err
    assert "No space left on device" in out + err, out + err
    landed = list(cells.glob("*.parquet"))
    assert 1 <= len(landed) < 3
    rows = pd.read_parquet(landed[0])
    assert len(rows) == 2 * 4 and set(rows["status"]) == {"ok"}
    assert not _leftovers(small_disk / "out")
