"""A stand-in for an OpenAI-compatible endpoint that ignores `seed` (as SGLang's do, sglang #15481):
a proxy that starts a real llama-server and forwards every request to it with `seed` removed.

    python tests/seedless_proxy.py PORT SERVER_PORT -- llama-server ARGS... (ARGS with --port SERVER_PORT)

The sampling is the real server's; only the seed is lost on the way, so each request draws its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def relay(port: int, upstream: str, server_args: list[str], rewrite: Callable[[dict], dict]) -> None:
    """Start the real server (`server_args`), and serve `port` by forwarding every request to
    `upstream`, each POST body passed through `rewrite` on the way, until killed. When the real
    server ends, this process ends the same way (killed by the same signal, or with its exit code),
    as the binary it stands in for would: a stand-in that outlived a server killed by SIGILL would
    turn a crash into a hang (the harness's AMX probe reads how the binary died)."""
    server = subprocess.Popen(server_args)

    def mirror() -> None:
        code = server.wait()
        if code < 0:  # SIGILL, SIGSEGV, SIGTERM, SIGKILL: Python leaves them at their default action
            os.kill(os.getpid(), -code)
            time.sleep(1)
        os._exit(code if code >= 0 else 128 - code)

    threading.Thread(target=mirror, daemon=True).start()

    class Forward(BaseHTTPRequestHandler):
        def _relay(self, body: bytes | None) -> None:
            request = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as answer:
                    status, data = answer.status, answer.read()
            except urllib.error.HTTPError as exc:
                status, data = exc.code, exc.read()
            except OSError:
                status, data = 503, b'{"error": "upstream not ready"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._relay(None)

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self._relay(json.dumps(rewrite(payload)).encode())

        def log_message(self, *args: object) -> None: ...

    try:
        ThreadingHTTPServer(("127.0.0.1", port), Forward).serve_forever()
    finally:
        server.kill()
        time.sleep(0.1)


def _without_seed(payload: dict) -> dict:
    payload.pop("seed", None)
    return payload


if __name__ == "__main__":
    relay(int(sys.argv[1]), f"http://127.0.0.1:{sys.argv[2]}", sys.argv[sys.argv.index("--") + 1:], _without_seed)
