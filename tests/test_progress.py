"""Plain progress for logs (the reporter alone; a real piped run is in test_server_urls.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

from rich.console import Console

from harness.report.progress import PlainReporter


def test_plain_reporter_heartbeat_and_eta():
    """The heartbeat: a line when nothing was printed for `every_s`, with done/total, cells and an ETA."""
    out = io.StringIO()
    with PlainReporter(Console(file=out, width=80), every_s=0.5) as reporter:
        reporter.start(10, cells=2)
        reporter.advance(5)
        time.sleep(1.8)
    text = out.getvalue().splitlines()
    beats = [ln for ln in text if ln.startswith("progress: 5/10 generations, 0/2 cells")]
    assert len(beats) >= 2 and all("eta 0:00:0" in ln for ln in beats), text


def test_a_spare_worker_released_unused_ends_at_once_and_a_taken_one_is_taken_once():
    """The spare worker `harness run` starts before it reads the experiment (harness.run.spare.SpareWorker):
    released unused, it exits 0 on its own; taken, it is handed out once."""
    import time

    from harness.run.spare import SpareWorker

    spare = SpareWorker()
    proc = spare.proc
    t0 = time.monotonic()
    spare.release()
    assert proc.returncode == 0 and time.monotonic() - t0 < 10
    with SpareWorker() as other:
        taken = other.take()
        assert taken is not None and other.take() is None and other.taken.is_set()
        taken[0].stdin.close()  # no work after all: it ends
        assert taken[0].wait(timeout=10) == 0
        os.close(taken[1])


def test_a_spare_prepares_pandas_and_the_engine_modules_but_no_engine_library():
    """What a spare imports before its work order (the engine libraries must wait for the group's
    environment: VLLM_BATCH_INVARIANT, CUDA_VISIBLE_DEVICES are read when they are imported)."""
    code = ("import importlib, sys\nfrom harness.run.worker import _spare_imports\n"
            "[importlib.import_module(m) for m in _spare_imports()]\n"
            "print(' '.join(sorted(m for m in sys.modules if '.' not in m)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert {"pandas", "pyarrow", "pydantic"} <= loaded
    assert not loaded & {"llama_cpp", "vllm", "torch", "openai", "transformers"}, loaded & {"llama_cpp", "vllm", "torch"}


def test_plain_progress_lines_stay_under_80_columns_at_ordinary_sizes():
    import io

    from rich.console import Console

    from harness.report.progress import PlainReporter

    reporter = PlainReporter(Console(file=io.StringIO(), width=200), show_progress=False)
    reporter.start(1200, 24)
    reporter.advance(1150)
    reporter.cells_done = 23
    assert len(reporter.line()) <= 80
    line = reporter.cell_line("7104b27a687d", "unsupported")
    assert line.startswith("cell 7104b27a687d unsupported; 23/24 cells, 1150/1200 gen., 0:00:00, eta ")
    assert len(line) <= 80, (len(line), line)
