"""llama.cpp's CPU kernel path: which kernels compute a load's matrix products on the CPU.

llama.cpp picks them from the CPU's features and its build: AMX tiles and repacked weights (its
"extra buffer types", which llama.cpp's --no-repack and the model parameter `use_extra_bufts`
turn off), llamafile's tinyBLAS, or plain ggml. Two nodes with the same model and the same
llama-cpp-python can therefore compute different logits, and on some CPUs (virtualised Xeons with
AMX) the AMX kernels crash. This module reads the path from llama.cpp's own words (its system
info and load log) and, for `extra_bufts: auto` on a CPU with AMX, asks a child process once
whether the AMX kernels run here, so a crash costs a probe, not a cell.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.core.log import Log
from harness.core.process_end import died_of, how_it_ended

#: the signals a kernel that does not suit the CPU dies of
CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE)
#: where the answers of earlier probes are kept (per host, build and model file)
PROBE_CACHE = "kernel-probes.json"
#: a probe's prompt: over 128 tokens, the prefill shape that reaches the AMX and repacked kernels
PREFILL_TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the wall. " * 12


def build_features(system_info: str) -> list[str]:
    """The CPU features this llama.cpp build uses, from its system info ('CPU : AVX2 = 1 | AMX_INT8 = 1 | ...')."""
    cpu = system_info.split("CPU :", 1)[1] if "CPU :" in system_info else system_info
    cpu = re.split(r"\|\s*[A-Za-z][A-Za-z0-9_]* : ", cpu, maxsplit=1)[0]  # up to the next backend's section
    return [name for name, on in re.findall(r"([A-Z][A-Z0-9_]+) = (\d+)", cpu) if on != "0"]


def has_amx(system_info: str) -> bool:
    return any(f.startswith("AMX") for f in build_features(system_info))


def extra_buffers(load_log: str) -> list[str]:
    """The extra buffer types a load put weights in ('AMX', 'CPU_REPACK', ...), from llama.cpp's load log."""
    names = re.findall(r"load_tensors:\s+(\S+) model buffer size", load_log)
    return sorted({n for n in names if n == "AMX" or (n.startswith("CPU_") and n != "CPU_Mapped")})


def kernel_path(extra: list[str], system_info: str) -> str:
    """One line naming the path: extra buffers in use, the build's CPU features, llamafile on or off."""
    features = build_features(system_info)
    llamafile = "on" if "LLAMAFILE" in features else "off"
    shown = " ".join(f for f in features if f not in ("LLAMAFILE", "OPENMP", "REPACK"))
    return f"extra buffers: {'+'.join(extra) or 'none'}; build: {shown or 'plain'}; llamafile: {llamafile}"


@dataclass(frozen=True)
class Choice:
    """Whether a load uses llama.cpp's extra buffer types, and why, as the rows record it."""

    use_extra: bool
    said: str  # e.g. "on", "off", "off (auto: AMX kernels crashed on this CPU: SIGILL)"
    warning: str = ""  # one line for the user when auto had to turn them off


def cpu_reports_amx() -> bool:
    """The CPU itself reports AMX tiles (Linux: /proc/cpuinfo), whatever a build uses."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


#: a probe: runs the engine's kernels with extra buffers on (True) or off once; its exit code (a
#: negative signal number when it was killed) and the kernel path it saw ("" if it cannot tell)
Probe = Callable[[bool], tuple[int, str]]


def probe_child(model: Path, threads: int, timeout_s: float = 300) -> Probe:
    """llama-cpp-python's probe: a child that loads `model` and decodes a batch of 2 with long prefills."""
    def run(use_extra: bool) -> tuple[int, str]:
        try:
            from harness.engines.parts.server_process import die_with_parent

            done = subprocess.run([sys.executable, "-m", "harness.engines.parts.kernel_probe", str(model),
                                   "on" if use_extra else "off", str(threads)], capture_output=True, timeout=timeout_s,
                                  preexec_fn=die_with_parent(os.getpid()))  # ends with the process that probes
        except subprocess.TimeoutExpired:
            return 124, ""
        return done.returncode, ""

    return run


def cache_key(*parts: str) -> str:
    """A probe answer holds for one host, build and model file."""
    return hashlib.sha256("\n".join((socket.gethostname(), *parts)).encode()).hexdigest()[:24]


def probed(cache: Path, key: str, use_extra: bool, probe: Probe, log: Log) -> tuple[int, str]:
    """The probe's answer for (key, on/off), run once and kept in `cache` (an unwritable cache costs a
    probe next time, nothing else)."""
    path = cache / PROBE_CACHE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    slot = f"{key}:{'on' if use_extra else 'off'}"
    answer = known.get(slot)
    if isinstance(answer, list) and len(answer) == 2:
        return int(answer[0]), str(answer[1])
    log(f"probing llama.cpp's CPU kernels with extra buffer types {'on' if use_extra else 'off'} "
        "(once per host, build and model)")
    code, seen = probe(use_extra)
    known[slot] = [code, seen]
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass
    return code, seen


def choose(option: str, amx: bool, probe: Probe, cache: Path, key: str, log: Log) -> Choice:
    """The extra-buffer setting a load runs with. 'on' and 'off' are obeyed; 'auto' keeps llama.cpp's
    default (on) except where the CPU reports AMX (`amx`) and a probe with them on dies by a signal
    while one with them off runs: then off, said in every row and in one warning. Never silently."""
    if option != "auto":
        return Choice(option == "on", option)
    if not amx:
        return Choice(True, "on (auto: no AMX on this CPU)")
    on = probed(cache, key, True, probe, log)[0]
    if on == 0:
        return Choice(True, "on (auto: the AMX kernels ran a probe batch on this CPU)")
    off = probed(cache, key, False, probe, log)[0]
    died, number = how_it_ended(on), died_of(on)
    if off == 0 and number in CRASH_SIGNALS:
        why = {signal.SIGILL: "illegal instruction", signal.SIGSEGV: "segmentation fault"}.get(number, died)
        said = f"off (auto: AMX kernels crashed on this CPU: {why})"
        return Choice(False, said, f"warning: llama.cpp's extra buffer types are off for this load: {said[5:-1]}; "
                                   "rows record extra_bufts off (set the engine option extra_bufts to choose)")
    return Choice(True, f"on (auto: a probe with them on ended with {died}, and with them off "
                        f"{'ran' if off == 0 else 'failed too'}; left on)")
