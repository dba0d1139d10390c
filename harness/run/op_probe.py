"""The per-node op probe (`harness doctor --ops FILE`): is a matmul row the same alone and inside M rows?

Batch variance starts in the kernels: a GEMM library picks another blocking, split of K or
instruction path for another number of rows, and the first row's dot products are summed in
another order. Whether that happens depends on the node (CPU features, GPU type, library build),
so two nodes that run the same experiment can disagree for reasons no setting shows. This probe
measures it for this node and stores the map beside the runs:

- for each library and dtype (NumPy f32 always; with torch, f32 and bf16 on the CPU, and f32,
  tf32, bf16 and f16 on a CUDA GPU), each inner size K (powers of two and others) and each row
  count M (1 to 256): row 0 of X[:M] @ W against X[:1] @ W, bitwise, `repeats` times;
- `row_invariant`: row 0 was bitwise the same as alone in every repeat; `max_abs_diff` the
  largest difference seen; `repeat_identical`: every repeat of the M-row product was bitwise the
  same (run-to-run determinism, apart from batch invariance);
- each row carries the node's provenance (host, CPU, GPU, driver, CUDA, library versions) and the
  threads the library used.

Inputs are seeded (the same on every node), so two nodes' maps compare cell by cell
(harness.analysis.op_maps).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
INNER = (64, 96, 128, 255, 256, 512, 1000, 1024, 4096)
COLUMNS = 256
REPEATS = 3
SEED = 20261202
#: the dtypes measured by device kind where torch is there (NumPy adds f32 on the CPU)
TORCH_DTYPES = {"cpu": ("f32", "bf16"), "cuda": ("f32", "tf32", "bf16", "f16")}
DTYPES = ("f32", "tf32", "bf16", "f16")
RESULT_COLUMNS = ["library", "device", "device_name", "dtype", "k", "n", "m", "repeats", "row_invariant",
                  "elements_differing", "max_abs_diff", "repeat_identical", "threads", "seconds"]


@dataclass(frozen=True)
class Kernel:
    """One matmul path: `run(x, w)` takes float32 arrays and returns the product as float32
    (bf16 and f16 results widen exactly, so bitwise equality is kept)."""

    library: str
    device: str
    device_name: str
    dtype: str
    threads: int
    run: Callable[[np.ndarray, np.ndarray], np.ndarray]


def _numpy_kernels() -> list[Kernel]:
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or 0)
    return [Kernel("numpy", "cpu", "", "f32", threads, lambda x, w: np.matmul(x, w))]


def _torch_kernels(devices: Iterable[str]) -> list[Kernel]:
    try:
        import torch
    except ImportError:
        return []
    types = {"f32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    kernels = []
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            continue
        name = torch.cuda.get_device_name(0) if device == "cuda" else ""

        def run(x: np.ndarray, w: np.ndarray, dtype: str = "", device: str = device) -> np.ndarray:
            if device == "cuda":  # TF32 only where asked: f32 is then real float32 arithmetic
                torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            a = torch.from_numpy(x).to(device=device, dtype=types[dtype])
            b = torch.from_numpy(w).to(device=device, dtype=types[dtype])
            out = torch.matmul(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            return out.float().cpu().numpy()

        for dtype in TORCH_DTYPES[device]:
            kernels.append(Kernel("torch", device, name, dtype, torch.get_num_threads() if device == "cpu" else 0,
                                  lambda x, w, dtype=dtype, run=run: run(x, w, dtype)))
    return kernels


def kernels(libraries: Iterable[str] = ("numpy", "torch"), devices: Iterable[str] = ("cpu", "cuda"),
            dtypes: Iterable[str] = DTYPES) -> list[Kernel]:
    """The matmul paths this node has, of those asked for (torch's where torch imports; CUDA's
    where torch sees a GPU)."""
    libraries, devices, dtypes = set(libraries), tuple(devices), set(dtypes)
    found = (_numpy_kernels() if "numpy" in libraries else []) + (_torch_kernels(devices) if "torch" in libraries else [])
    return [k for k in found if k.dtype in dtypes and k.device in devices]


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) == b.view(np.uint32)


def measure(kernel: Kernel, inner: Iterable[int] = INNER, rows: Iterable[int] = ROWS, columns: int = COLUMNS,
            repeats: int = REPEATS, seed: int = SEED) -> Iterator[dict[str, Any]]:
    """One record per (K, M) for this kernel: RESULT_COLUMNS but the provenance."""
    rows = sorted(set(rows))
    for k in inner:
        rng = np.random.default_rng([seed, k])
        w = (rng.standard_normal((k, columns)) / np.sqrt(k)).astype(np.float32)
        x = rng.standard_normal((max(rows), k)).astype(np.float32)
        alone = kernel.run(np.ascontiguousarray(x[:1]), w)[0]
        for m in rows:
            started = time.perf_counter()
            products = [kernel.run(np.ascontiguousarray(x[:m]), w) for _ in range(repeats)]
            spent = time.perf_counter() - started
            firsts = [p[0] for p in products]
            differing = max(int((~_same(f, alone)).sum()) for f in firsts)
            with np.errstate(invalid="ignore"):
                gap = max(float(np.nanmax(np.abs(f.astype(np.float64) - alone.astype(np.float64)))) for f in firsts)
            yield {"library": kernel.library, "device": kernel.device, "device_name": kernel.device_name,
                   "dtype": kernel.dtype, "k": int(k), "n": int(columns), "m": int(m), "repeats": int(repeats),
                   "row_invariant": differing == 0, "elements_differing": differing, "max_abs_diff": gap,
                   "repeat_identical": all(bool(_same(p, products[0]).all()) for p in products[1:]),
                   "threads": kernel.threads, "seconds": spent / repeats}


def read_config(path: Any) -> dict[str, Any]:
    """An op-probe file (k, m, repeats, dtypes), checked; a bad one is a ConfigError naming the file and key."""
    from harness.core.errors import ConfigError
    from harness.experiment import yamlsrc

    source = yamlsrc.load(path)
    data = source.data if isinstance(source.data, dict) else None
    if data is None:
        raise ConfigError(f"{path}: expected a mapping with k, m, repeats and dtypes")
    allowed = {"k": (1, 1 << 20), "m": (1, 4096), "repeats": (1, 100)}
    for key, value in data.items():
        where = source.where((key,))
        if key == "dtypes":
            if not isinstance(value, list) or any(v not in DTYPES for v in value):
                raise ConfigError(f"{where}: dtypes: a list of {', '.join(DTYPES)}")
        elif key in allowed:
            low, high = allowed[key]
            values = value if isinstance(value, list) and key != "repeats" else [value]
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high for v in values):
                shape = "a whole number" if key == "repeats" else "a list of whole numbers"
                raise ConfigError(f"{where}: {key}: {shape} from {low} to {high}")
        else:
            raise ConfigError(f"{where}: unknown key '{key}'; allowed: k, m, repeats, dtypes")
    return data


def probe(found: list[Kernel], inner: Iterable[int] = INNER, rows: Iterable[int] = ROWS, columns: int = COLUMNS,
          repeats: int = REPEATS, progress: Callable[[str], None] | None = None):
    """The op map of this node: one record per kernel, K and M, each with the node's provenance."""
    import pandas as pd

    from harness.results import provenance

    node = provenance.collect()
    context = {key: node[key] for key in ("host", "cpu", "cpu_count", "gpu_name", "gpu_driver", "gpu_uuid",
                                          "cuda_version", "library_versions", "platform", "harness_version")}
    records = []
    inner = list(inner)
    for kernel in found:
        if progress:
            progress(f"{kernel.library} {kernel.device} {kernel.dtype}: K in {', '.join(map(str, inner))}")
        records += [r | context for r in measure(kernel, inner, rows, columns, repeats)]
    return pd.DataFrame(records, columns=RESULT_COLUMNS + list(context))
