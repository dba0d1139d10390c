"""Plain progress for logs (the reporter alone; a real piped run is in test_server_urls.py)."""

from __future__ import annotations

import io
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
    beats = [l for l in text if l.startswith("progress: 5/10 generations, 0/2 cells")]
    assert len(beats) >= 2 and all("eta 0:00:0" in l for l in beats), text
