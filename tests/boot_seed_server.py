"""A stand-in llama-server that draws a random seed at each boot (as SGLang did): given as the
llama-server engine's `binary`, it starts the real llama-server on another port and forwards every
request to it with the request's seed replaced by the one it drew when it started.

    python tests/boot_seed_server.py ARGS...     (the real binary: $REAL_LLAMA_SERVER)

Within one boot a seed then holds (the same request gives the same answer); across boots it does
not. Asked for its version (no --port), it answers as the real binary does.
"""

from __future__ import annotations

import os
import random
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from seedless_proxy import relay


def main() -> None:
    real, args = os.environ["REAL_LLAMA_SERVER"], sys.argv[1:]
    if "--port" not in args:
        os.execv(real, [real, *args])
    at = args.index("--port") + 1
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        inner = probe.getsockname()[1]
    boot_seed = random.SystemRandom().randrange(1 << 31)
    print(f"boot seed {boot_seed}", flush=True)
    served = int(args[at])
    args[at] = str(inner)
    relay(served, f"http://127.0.0.1:{inner}", [real, *args], lambda body: body | {"seed": boot_seed})


if __name__ == "__main__":
    main()
