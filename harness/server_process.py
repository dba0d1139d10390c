"""A server process the harness starts, health-checks and always stops (its whole process group).

Shared by the engines that talk to a server over HTTP. Binds to loopback by default.
"""

from __future__ import annotations

import json
import os
import threading
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any



#: Set by the runner for each worker: where server engines put their servers' logs.
LOG_DIR_ENV = "HARNESS_LOG_DIR"


def log_dir() -> Path:
    return Path(os.environ.get(LOG_DIR_ENV, "."))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def post_json(url: str, payload: dict[str, Any], timeout: float, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST JSON and return the JSON answer; HTTP errors raise RuntimeError with the server's text."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"HTTP {exc.code} from {url}: {body}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"cannot reach {url}: {exc.reason}") from None


def get_json(url: str, timeout: float = 10) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RuntimeError(f"cannot read {url}: {exc}") from None


@dataclass
class Concurrent:
    """Answers of requests sent together, with each one's (start, end) on the client's clock."""

    answers: list[dict[str, Any]]
    spans: list[tuple[float, float]]
    wall_s: float

    @property
    def overlapped(self) -> bool:
        """True when every request was in flight at one moment: they really shared the server."""
        return max(s for s, _ in self.spans) < min(e for _, e in self.spans)


def post_concurrently(url: str, bodies: list[dict[str, Any]], timeout: float,
                      headers: dict[str, str] | None = None) -> Concurrent:
    """POST all bodies at once (one thread each, released together by a barrier)."""
    n = len(bodies)
    barrier = threading.Barrier(n)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def send(i: int) -> dict[str, Any]:
        barrier.wait()
        start = time.perf_counter()
        try:
            return post_json(url, bodies[i], timeout, headers)
        finally:
            spans[i] = (start, time.perf_counter())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(send, range(n)))
    return Concurrent(answers, spans, time.perf_counter() - t0)


class ManagedServer:
    """Start `args`, wait until GET `health_url` answers 200, stop the process group on close."""

    def __init__(self, args: list[str], health_url: str, log_path: Path, startup_timeout_s: float) -> None:
        self.args = args
        self.health_url = health_url
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"server exited at start with code {code}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait()
