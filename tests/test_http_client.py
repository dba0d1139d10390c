"""The asynchronous client that sends a batch's requests to a server engine, against a real HTTP server.

The server here is Python's own (a thread per connection), so that the test decides what the
server does: hold every request until all have arrived, answer slowly, or fail.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest

from harness.engines.parts.server_process import post_concurrently


def _serve(handle: Callable[[dict], tuple[int, dict]]):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code, answer = handle(body)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None: ...

    class Server(ThreadingHTTPServer):
        request_queue_size = 1024  # the listen backlog: 256 clients connect at once
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/completion"


@pytest.mark.parametrize("n", [8, 256])
def test_every_request_is_in_flight_at_once(n):
    # The server answers none until all n have arrived: a client that sent them one after
    # another, or fewer at a time, would break the barrier (and the test) instead.
    barrier = threading.Barrier(n, timeout=20)

    def handle(body: dict) -> tuple[int, dict]:
        barrier.wait()
        return 200, {"echo": body["i"]}

    server, url = _serve(handle)
    try:
        sent = post_concurrently(url, [{"i": i} for i in range(n)], timeout=30)
    finally:
        server.shutdown()
    assert [a["echo"] for a in sent.answers] == list(range(n))  # answers in request order
    assert sent.overlapped and len(sent.spans) == n
    assert 0 <= sent.release_spread_s < 20


def test_requests_that_do_not_overlap_are_seen_as_such():
    from harness.engines.parts.server_process import Concurrent

    apart = Concurrent([{}, {}], [(0.0, 1.0), (2.0, 3.0)], 3.0)
    together = Concurrent([{}, {}], [(0.0, 2.5), (0.1, 3.0)], 3.0)
    assert not apart.overlapped and together.overlapped
    assert apart.release_spread_s == 2.0


def test_a_slow_server_times_out_with_a_clear_message():
    server, url = _serve(lambda body: (time.sleep(3), (200, {}))[1])
    try:
        with pytest.raises(RuntimeError, match=r"no answer from .* within 1 s"):
            post_concurrently(url, [{"i": 0}, {"i": 1}], timeout=1)
    finally:
        server.shutdown()


def test_an_http_error_carries_the_servers_words():
    server, url = _serve(lambda body: (400, {"error": "n_probs too large"}) if body["i"] else (200, {}))
    try:
        with pytest.raises(RuntimeError, match=r"HTTP 400 from .*n_probs too large"):
            post_concurrently(url, [{"i": 0}, {"i": 1}], timeout=10)
    finally:
        server.shutdown()


def test_an_unreachable_server_is_named():
    with pytest.raises(RuntimeError, match=r"cannot reach http://127.0.0.1:9/"):
        post_concurrently("http://127.0.0.1:9/completion", [{"i": 0}], timeout=5)
