"""A server process the harness starts, health-checks and always stops (its whole process group).

Shared by the engines that talk to a server over HTTP. Binds to loopback by default.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.core.process_end import died_of, how_it_ended
from harness.core.redaction import REDACTED, redact_url, scrub, secret_values

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


def get_json(url: str, timeout: float = 10, headers: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RuntimeError(f"cannot read {redact_url(url)}: {exc}") from None


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

    @property
    def release_spread_s(self) -> float:
        """Seconds between the first and the last request leaving the client."""
        return max(s for s, _ in self.spans) - min(s for s, _ in self.spans)


def post_concurrently(url: str, bodies: list[dict[str, Any]], timeout: float,
                      headers: dict[str, str] | None = None) -> Concurrent:
    """POST all bodies at once through one asynchronous HTTP client, not a thread per request.

    Every request is built first, then waits at a barrier; all are released together, so
    they are in flight at once (`Concurrent.overlapped` says whether they were).
    The pool holds one connection per request (so none waits for another's), and `timeout`
    bounds each request's connect, read and write. A failed request fails the batch with the
    server's words.
    """
    import asyncio

    return asyncio.run(_post_all(url, bodies, timeout, headers or {}))


async def _post_all(url: str, bodies: list[dict[str, Any]], timeout: float, headers: dict[str, str]) -> Concurrent:
    import asyncio

    import httpx

    n = len(bodies)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers) as client:
        ready = 0
        go = asyncio.Event()

        async def send(i: int) -> dict[str, Any]:
            nonlocal ready
            encoded = json.dumps(bodies[i]).encode()
            request = client.build_request("POST", url, content=encoded, headers={"Content-Type": "application/json"})
            ready += 1
            if ready == n:
                go.set()
            await go.wait()
            start = time.perf_counter()
            try:
                response = await client.send(request)
            except httpx.TimeoutException as exc:
                raise RuntimeError(f"no answer from {url} within {timeout:.0f} s ({type(exc).__name__})") from None
            except httpx.HTTPError as exc:
                raise RuntimeError(f"cannot reach {url}: {type(exc).__name__} {exc}".rstrip()) from None
            finally:
                spans[i] = (start, time.perf_counter())
            if response.status_code >= 400:
                raise RuntimeError(f"HTTP {response.status_code} from {url}: {response.text[:500]}")
            return response.json()

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(send(i)) for i in range(n)]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    return Concurrent(list(answers), spans, time.perf_counter() - t0)


def die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec function: the child gets SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG), and
    ends at once if the parent is already gone. Resolved before the fork, so the child only calls it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the worker's own cleanup is what remains
        return lambda: None

    def arm() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _how(code: int) -> str:
    """How a process ended, a crash by signal named with what to try."""
    number = died_of(code)
    if number is None:
        return f"with code {code}"
    hint = ("; a llama.cpp server may be running kernels this CPU cannot (AMX, repacked weights): try --no-repack"
            if number in (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS) else "")
    return f"killed by signal {how_it_ended(code)}{hint}"


class ManagedServer:
    """Start `args`, wait until GET `health_url` answers 200, stop the process group on close."""

    def __init__(self, args: list[str], health_url: str, log_path: Path, startup_timeout_s: float,
                 headers: dict[str, str] | None = None) -> None:
        self.args = args
        self.health_url = health_url
        #: sent with the health check too: a key-protected server answers it only with the key
        self.headers = headers or {}
        #: credentials in the arguments, kept out of the log tails that go into error messages
        self.secrets = secret_values(args) | {v.removeprefix("Bearer ") for v in self.headers.values()}
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            #: where this server's lines start in a log that earlier servers wrote to
            self.log_offset = log.tell()
            # Its own session, so that close() ends it with everything it started; and killed when
            # the worker that started it dies, however that happens (SIGKILL included).
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
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
                raise RuntimeError(f"server exited at start {_how(code)}: {self.log_tail()}")
            try:
                request = urllib.request.Request(self.health_url, headers=self.headers)
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def died(self, wait_s: float = 2.0) -> bool:
        """Whether the server has ended, waiting up to `wait_s` for it: a request that failed as the server
        died can come back before the process is gone."""
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def own_log(self) -> str:
        """What this server wrote to its log so far."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(self.log_offset)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = " | ".join(line.strip() for line in text[-lines:] if line.strip())
        for secret in self.secrets:
            tail = tail.replace(secret, REDACTED) if len(secret) >= 4 else tail
        return tail

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
        scrub(self.log_path, self.secrets)  # a server may print its own arguments, keys included
