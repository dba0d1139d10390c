"""An engine's GPU backend libraries mapped when its process starts, before any other native library.

Seen on an H200 node whose image is a stock CUDA + PyTorch environment, with llama-cpp-python built
for CUDA: in a process that had imported numpy or pyarrow, a model load died with SIGSEGV; in one
that had loaded llama.cpp, a Parquet write did. llama.cpp alone ran, so a probe process holding
nothing else passed. Importing llama.cpp first from Python did not help; starting the process with
the build's CUDA backend preloaded (LD_PRELOAD) fixed every case. So every process that will load
llama.cpp calls `ensure` first thing: where the installed build has a GPU backend and the switch
allows it, the process executes itself again, once, with those libraries preloaded. The value of
LD_PRELOAD from before is put back at once, so the processes it starts (a llama-server, vLLM's
workers) inherit nothing; those that load llama.cpp call `ensure` themselves.

The switch is the environment variable HARNESS_NATIVE_PRELOAD: `auto` (default: the GPU backends
of the installed build, none for a CPU-only build), `off`, or a ':'-separated list of library paths.
Standard library only: it runs before anything else is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: the switch: auto, off, or PATH[:PATH...]
SWITCH = "HARNESS_NATIVE_PRELOAD"
#: set for the one re-execution: LD_PRELOAD's value before it ('-' when it was unset)
_BEFORE = "HARNESS_NATIVE_PRELOAD_BEFORE"
#: ggml's GPU backends, as the build names their libraries (libggml-cuda.so, ...)
GPU_BACKENDS = ("cuda", "hip", "musa", "vulkan", "sycl", "opencl", "cann", "metal")
#: the package whose native libraries the built-in llama.cpp engine loads
LLAMA_CPP = "llama_cpp"
_OFF = ("off", "0", "no", "false")
_AUTO = ("", "auto", "on", "1", "yes", "true")


def backend_libraries(package: str = LLAMA_CPP) -> list[Path]:
    """The GPU backend libraries of the installed `package` (its `lib/libggml-<gpu>.so`), found without
    importing it; [] for a CPU-only build or where it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    found: dict[str, Path] = {}
    for root in (spec.submodule_search_locations or []) if spec else []:
        # one file per backend: a wheel holds libggml-cuda.so, .so.0 and .so.0.x.y, often as copies of
        # one library; the shortest name is preloaded, and the loader then serves the others' soname
        for path in sorted(Path(root, "lib").glob("libggml-*.so*"), key=lambda p: (len(p.name), p.name)):
            backend = path.name[len("libggml-"):].split(".")[0]
            if backend in GPU_BACKENDS:
                found.setdefault(backend, path)
    return list(found.values())


def backends(package: str = LLAMA_CPP) -> list[str]:
    """The GPU backends the installed build has ('cuda', ...), from its library names."""
    return [p.name[len("libggml-"):].split(".")[0] for p in backend_libraries(package)]


@dataclass(frozen=True)
class Plan:
    """What a process that loads `package` should have preloaded, and the switch's word for it."""

    setting: str  # "auto", "off" or "paths"
    libraries: tuple[str, ...]
    #: paths named by the switch that do not exist (left out, and said)
    missing: tuple[str, ...] = ()


def plan(package: str = LLAMA_CPP, environ: dict[str, str] | None = None) -> Plan:
    value = (os.environ if environ is None else environ).get(SWITCH, "auto").strip()
    if value.lower() in _OFF:
        return Plan("off", ())
    if value.lower() in _AUTO:
        return Plan("auto", tuple(str(p) for p in backend_libraries(package)))
    paths = [p for p in value.split(":") if p]
    return Plan("paths", tuple(p for p in paths if Path(p).is_file()), tuple(p for p in paths if not Path(p).is_file()))


def mapped_files() -> set[str]:
    """Every file mapped into this process (Linux: /proc/self/maps), by resolved path."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split(None, 5)[5].strip() for line in text.splitlines() if line.count(" ") >= 5 and "/" in line}


def mapped(libraries: tuple[str, ...] | list[str]) -> list[str]:
    """Those of `libraries` that are mapped into this process."""
    here = mapped_files()
    return [lib for lib in libraries if str(Path(lib).resolve()) in here]


def ensure(package: str = LLAMA_CPP) -> None:
    """Have `package`'s GPU backend libraries preloaded in this process, per the switch: where they are
    not mapped yet, execute this process again with them in LD_PRELOAD (once; the arguments, open
    inheritable descriptors and standard streams carry over). Call it before anything else is
    imported. After the re-execution LD_PRELOAD is as it was, for the processes this one starts."""
    if _BEFORE in os.environ:  # this is the re-executed process: put the variable back, never loop
        before = os.environ.pop(_BEFORE)
        if before == "-":
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before
        return
    if not sys.platform.startswith("linux"):
        return
    wanted = plan(package).libraries
    if not wanted or len(mapped(wanted)) == len(wanted):
        return
    env = dict(os.environ)
    before = env.get("LD_PRELOAD")
    env[_BEFORE] = "-" if before is None else before
    env["LD_PRELOAD"] = " ".join([*wanted, *([before] if before else [])])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


#: how a process is told, first on its command line, which package to preload for (worker, rehearsal)
FLAG = "--preload"


def flag(package: str | None) -> list[str]:
    """The command-line words that make a harness process preload for `package` ([] for None)."""
    return [FLAG, package] if package else []


def ensure_from_argv() -> None:
    """`ensure` for the package the command line names first (`--preload PACKAGE ...`), if it does."""
    if sys.argv[1:2] == [FLAG] and len(sys.argv) > 2:
        ensure(sys.argv[2])


def state(package: str = LLAMA_CPP) -> str:
    """This process's preload, in words, for the rows and the crash text: 'on: libggml-cuda.so',
    'off (HARNESS_NATIVE_PRELOAD=off; the build has cuda)', 'not needed (no GPU backend in this build)'."""
    chosen = plan(package)
    have = backends(package)
    if chosen.setting == "off":
        return f"off ({SWITCH}=off" + (f"; the build has {', '.join(have)})" if have else ")")
    if not chosen.libraries:
        if chosen.missing:
            return f"off ({SWITCH} names no existing file: {', '.join(chosen.missing)})"
        return "not needed (no GPU backend in this build)"
    there = mapped(chosen.libraries)
    names = ", ".join(Path(lib).name for lib in there)
    if len(there) == len(chosen.libraries):
        return f"on: {names}" + (f" ({SWITCH})" if chosen.setting == "paths" else "")
    absent = ", ".join(Path(lib).name for lib in chosen.libraries if lib not in there)
    return f"not in force: {absent} not mapped at start (a process that did not call ensure)"


def native_packages() -> list[str]:
    """The installed packages whose native libraries (.so) are mapped into this process, with their
    versions ('numpy 2.4.6', 'pyarrow 22.0.0'): what was there before an engine loaded."""
    from importlib import metadata

    tops: dict[str, None] = {}
    for path in sorted(mapped_files()):
        if not (path.endswith(".so") or ".so." in path):
            continue
        parts = Path(path).parts
        marker = next((m for m in ("site-packages", "dist-packages") if m in parts), None)
        rest = parts[parts.index(marker) + 1:] if marker else ()
        if len(rest) > 1:  # numpy/..., numpy.libs/... -> numpy
            tops.setdefault(rest[0].removesuffix(".libs"), None)
    distributions = metadata.packages_distributions()
    out = []
    for top in tops:
        names = distributions.get(top, [])
        if not names:
            continue
        try:
            out.append(f"{names[0]} {metadata.version(names[0])}")
        except metadata.PackageNotFoundError:
            out.append(names[0])
    return list(dict.fromkeys(out))


#: how a worker's log says what was in its process before the engine loaded, and its preload
BEFORE_ENGINE = "harness: native libraries in this process before the engine: "
_PRELOAD_PART = "; native preload "


def before_engine_line(package: str = LLAMA_CPP) -> str:
    """One log line: the native packages in this process and its preload, before `package` loads."""
    return f"{BEFORE_ENGINE}{', '.join(native_packages()) or 'none'}{_PRELOAD_PART}{state(package)}"


def split_before(said: str) -> tuple[str, str]:
    """(the native packages, the preload state) of what `last_before_engine` read; ('', '') if nothing."""
    natives, _, preload = said.partition(_PRELOAD_PART)
    return natives, preload


def last_before_engine(log_text: str) -> str:
    """The last such line of a log, without its prefix ('' if none)."""
    lines = [line for line in log_text.splitlines() if line.startswith(BEFORE_ENGINE)]
    return lines[-1][len(BEFORE_ENGINE):] if lines else ""
