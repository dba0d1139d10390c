"""Two traced forward passes compared op by op: the alignment, the comparison and the stored record,
written once for every engine's tracer (harness.engines.*: `Engine.trace`).

A tracer calls `record(name, op, values)` for each operation's output on the target's own elements,
in the order the pass runs them. The first pass (`Recording`) keeps each output once, spilled to a
temporary file so that memory holds no more than one op at a time; the second (`Comparing`) compares
each output as it arrives with the first pass's output at the same place in the order. Two passes
are aligned when they call the same ops in the same order; where they do not (alone, an attention
kernel without a mask; in the batch, one with the padding mask), the first place they part is said
by name on both sides, and nothing after it is compared: a trace that lost step would name a wrong
op.

Per op: `order`, `name` (module or tensor name), `layer` (from the name: 'layers.3.' or 'blk.3'),
`op` (module class or op name), `elements`, `differ_share` (the share of the target's elements not
bitwise equal), `max_abs_diff`, `max_rel_diff`, and per side a `digest` (blake2b of the float32
bytes) with `absmax` and `mean`, so that two folders traced on two machines can be compared by
digest without shipping activations (harness.run.locate).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.core.op_recording import Recording, as_float32

COLUMNS = ["order", "name", "layer", "op", "elements", "differ_share", "max_abs_diff", "max_rel_diff",
           "digest_a", "digest_b", "absmax_a", "absmax_b", "mean_a", "mean_b"]
_LAYER = re.compile(r"(?:^|[._])(?:layers|layer|blk|h|block|blocks)[._](\d+)(?:[._]|$)|^[A-Za-z_]+-(\d+)$")


def layer_of(name: str) -> int | None:
    """The layer index a module or tensor name carries ('model.layers.3.mlp' -> 3, 'blk.3.attn_q' -> 3, llama.cpp's
    graph names 'Qcur-3' -> 3)."""
    found = _LAYER.search(name)
    return int(found.group(1) or found.group(2)) if found else None


def digest(values: np.ndarray) -> str:
    """The digest of an output's float32 bytes (16 hex characters)."""
    return hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()


def _summary(values: np.ndarray) -> tuple[str, float, float]:
    finite = values[np.isfinite(values)]
    return (digest(values), float(np.abs(finite).max()) if finite.size else float("nan"),
            float(finite.mean()) if finite.size else float("nan"))


@dataclass
class Comparing:
    """The second pass: each op compared, as it arrives, with the first pass's op at the same place."""

    first: Recording
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: where the passes stopped calling the same ops: (order, first pass's op, second pass's op)
    parted: tuple[int, str, str] | None = None

    def __call__(self, name: str, op: str, values: Any) -> None:
        order = len(self.rows)
        if self.parted is not None:
            return
        if order >= len(self.first.ops):
            self.parted = (order, "(no more ops)", f"{name} ({op})")
            return
        name_a, op_a, _, size_a = self.first.ops[order]
        b = as_float32(values)
        if (name_a, op_a) != (name, op) or size_a != b.size:
            self.parted = (order, f"{name_a} ({op_a}, {size_a} elements)", f"{name} ({op}, {b.size} elements)")
            return
        a = self.first.values(order)
        self.rows.append(compare(order, name, op, a, b))

    def finish(self) -> None:
        """After the second pass: a first pass that ran ops the second never did parted there too."""
        if self.parted is None and len(self.rows) < len(self.first.ops):
            name, op, _, _ = self.first.ops[len(self.rows)]
            self.parted = (len(self.rows), f"{name} ({op})", "(no more ops)")


def compare(order: int, name: str, op: str, a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """One op's record (COLUMNS) from its two outputs, element for element."""
    unequal = a.view(np.uint32) != b.view(np.uint32)  # bitwise: -0.0 is not 0.0, a NaN equals its own bits
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        gap = np.abs(wide_a - wide_b)
        rel = gap / np.maximum(np.abs(wide_a), np.abs(wide_b))
    gap, rel = gap[unequal & np.isfinite(gap)], rel[unequal & np.isfinite(rel)]
    (digest_a, absmax_a, mean_a), (digest_b, absmax_b, mean_b) = _summary(a), _summary(b)
    return {"order": order, "name": name, "layer": layer_of(name), "op": op, "elements": int(a.size),
            "differ_share": float(unequal.mean()) if a.size else 0.0,
            "max_abs_diff": float(gap.max()) if gap.size else 0.0, "max_rel_diff": float(rel.max()) if rel.size else 0.0,
            "digest_a": digest_a, "digest_b": digest_b, "absmax_a": absmax_a, "absmax_b": absmax_b,
            "mean_a": mean_a, "mean_b": mean_b}


@dataclass(frozen=True)
class Finding:
    """What two aligned passes say: the first op whose output differs and the op before it that agreed
    (None where every op agreed), or where the passes parted."""

    first: dict[str, Any] | None
    before: dict[str, Any] | None
    parted: tuple[int, str, str] | None
    ops: int

    def line(self) -> str:
        if self.parted is not None:
            order, a, b = self.parted
            lead = (f"first differs at op {self.first['order']} {self.first['name']}; then "
                    if self.first is not None and self.first["order"] < order else "")
            return f"{lead}the passes call different ops at op {order}: first pass {a}; second pass {b}"
        if self.first is None:
            return f"no op differs ({self.ops} ops, every output bitwise equal)"
        after = f", after {self.before['name']} ({self.before['op']}) agreed" if self.before else " (the first op)"
        return (f"first differs at {self.first['name']} ({self.first['op']}){after}: "
                f"{100 * self.first['differ_share']:.1f}% of its elements, max |d| {self.first['max_abs_diff']:.3g}")


def compare_recordings(a: Recording, b: Recording) -> Comparing:
    """Two saved passes compared op by op, one op's outputs in memory at a time."""
    compared = Comparing(a)
    for index in range(len(b.ops)):
        name, op, _, _ = b.ops[index]
        compared(name, op, b.values(index))
    compared.finish()
    return compared


def finding(compared: Comparing) -> Finding:
    """The first differing op of two passes (see Finding)."""
    compared.finish()
    rows = compared.rows
    first = next((i for i, r in enumerate(rows) if r["differ_share"] > 0), None)
    return Finding(rows[first] if first is not None else None,
                   rows[first - 1] if first else None, compared.parted, len(rows))
