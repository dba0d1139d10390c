"""A STAND-IN for the GPU node of issue 42 (there is no GPU here): the local CPU build of llama.cpp
dressed as a CUDA build, with the crashes that node showed, so that the fix can be tested on a CPU.

On an H200 node with a stock CUDA + PyTorch image and llama-cpp-python built for CUDA:
- numpy or pyarrow imported before llama.cpp, then a model load: SIGSEGV;
- llama.cpp loaded, then a Parquet write (pyarrow's ParquetWriter): SIGSEGV;
- llama.cpp alone: fine; loading llama.cpp first from Python did not help;
- the CUDA backend library preloaded when the process started (LD_PRELOAD): every case fine.

`make(root)` builds, under root/site (first on PYTHONPATH through the environment it returns):
- `llama_cpp/`: a copy of the installed package's Python files, its libraries linked in, plus
  `lib/libggml-cuda.so`, a real but empty shared library compiled here (what the harness inspects to
  tell a GPU build; it computes nothing: every layer still runs on this CPU);
- `sitecustomize.py`: at each interpreter's start, notes whether that library was mapped already
  (only a preload maps it that early), and arms the two crashes above, which kill the process with a
  real SIGSEGV. Mapping the library later, from Python, does not disarm them, as on the node.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

RULES = r'''
"""The GPU-node stand-in's rules (tests/gpu_node_standin.py): not a GPU, not llama.cpp."""
import os
import signal
import sys
from pathlib import Path

STUB = (Path(__file__).parent / "llama_cpp" / "lib" / "libggml-cuda.so").resolve()
PRELOADED = False
FIRST = []


def _die(what):
    sys.stderr.write(f"gpu-node stand-in: {what}: SIGSEGV, as on the H200 node (issue 42)\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSEGV)


def at_start():
    global PRELOADED
    try:
        PRELOADED = str(STUB) in Path("/proc/self/maps").read_text()
    except OSError:
        PRELOADED = False
    sys.meta_path.insert(0, _ParquetHook())


def before_llama():
    """First lines of the stand-in llama_cpp package: what native library was there before it."""
    FIRST[:] = [m for m in ("numpy", "pyarrow") if m in sys.modules]


def after_llama(package):
    low = package.llama_cpp
    real = low.llama_model_load_from_file

    def load(*args, **kwargs):
        if not PRELOADED and FIRST:
            _die(f"a model load in a process that imported {' and '.join(FIRST)} before llama.cpp")
        return real(*args, **kwargs)

    low.llama_model_load_from_file = package.llama_model_load_from_file = load


class _ParquetHook:
    """Arms pyarrow's ParquetWriter when pyarrow.parquet is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "pyarrow.parquet":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            writer = module.ParquetWriter
            init = writer.__init__

            def armed(self, *args, **kwargs):
                if not PRELOADED and "llama_cpp.llama_cpp" in sys.modules:
                    _die("a Parquet write in a process that loaded llama.cpp")
                init(self, *args, **kwargs)

            writer.__init__ = armed

        loader.exec_module = exec_module
        return spec
'''

STUB_C = "int ggml_standin_cuda_backend(void) { return 0; }\n"


def make(root: Path) -> dict[str, str]:
    """Build the stand-in under `root`; the environment variables that put it in force."""
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.submodule_search_locations, "llama-cpp-python is needed for the stand-in"
    real = Path(next(iter(spec.submodule_search_locations)))
    site = root / "site"
    package = site / "llama_cpp"
    shutil.copytree(real, package, ignore=shutil.ignore_patterns("__pycache__", "lib"))
    (package / "lib").mkdir()
    for lib in (real / "lib").iterdir():
        (package / "lib" / lib.name).symlink_to(lib.resolve())
    source = root / "standin_cuda.c"
    source.write_text(STUB_C)
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(package / "lib" / "libggml-cuda.so"),
                    str(source)], check=True)
    init = package / "__init__.py"
    init.write_text("import _gpu_node_standin as _standin\n_standin.before_llama()\n" + init.read_text()
                    + "\nimport sys as _sys\n_standin.after_llama(_sys.modules[__name__])\n")
    (site / "_gpu_node_standin.py").write_text(RULES)
    (site / "sitecustomize.py").write_text("import _gpu_node_standin\n_gpu_node_standin.at_start()\n")
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(site) + (os.pathsep + path if path else "")}
