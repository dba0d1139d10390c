"""One traced forward pass's ops in a file: what every engine's tracer writes (inside the engine's own
process, or a worker of it) and harness.run.trace_diff compares. Here, below the engines, so that a
tracer running in another process (vLLM's model worker) writes the same file the comparison reads.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

#: the op whose output is the logits, by name, in each engine's trace: a module ending in lm_head
#: (transformers), llama.cpp's graph tensor result_output, vLLM's logits processor; or a module named output
LOGITS_NAMES = ("output", "result_output", "logits_processor")


def is_logits(name: str) -> bool:
    """Whether a traced op is the one whose output is the logits (LOGITS_NAMES, or a name ending in lm_head)."""
    return name in LOGITS_NAMES or name.endswith("lm_head")


def as_float32(values: Any) -> np.ndarray:
    """An op's output as a flat float32 array (bf16 and f16 widen exactly: bitwise equality is kept)."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.float32)).reshape(-1)


class Recording:
    """One pass's ops: each op's name, kind and output, the outputs in a file (a temporary one, or
    `path` with its index beside it as JSON, so that another process compares them), never in memory."""

    def __init__(self, path: Path | None = None) -> None:
        self.ops: list[tuple[str, str, int, int]] = []  # name, op, offset, elements
        self.path = path
        self._file = open(path, "w+b") if path is not None else tempfile.TemporaryFile()
        self._offset = 0

    def __call__(self, name: str, op: str, values: Any) -> None:
        flat = as_float32(values)
        self._file.write(flat.tobytes())
        self.ops.append((name, op, self._offset, flat.size))
        self._offset += flat.nbytes

    def values(self, index: int) -> np.ndarray:
        _, _, offset, size = self.ops[index]
        self._file.seek(offset)
        return np.frombuffer(self._file.read(size * 4), dtype=np.float32)

    def save(self) -> None:
        """Write the index beside the values (PATH.json), for a reader in another process."""
        self._file.flush()
        if self.path is not None:
            Path(f"{self.path}.json").write_text(json.dumps(self.ops))

    @classmethod
    def load(cls, path: Path) -> Recording:
        """A recording another process saved."""
        found = cls.__new__(cls)
        found.path, found._offset = path, 0
        found.ops = [tuple(op) for op in json.loads(Path(f"{path}.json").read_text())]
        found._file = open(path, "rb")
        return found

    def close(self) -> None:
        self._file.close()
