"""One llama.cpp batch traced tensor by tensor, as `harness locate` asks (a part of
harness.engines.llamacpp; the comparison is harness.run.trace_diff's, for every engine).

The batch is rebuilt through the engine's own decode loop (LlamaDecode.generate: the same context
shape, prefill calls and per-step calls, the batch-mates decoding as they did, the target fed its
recorded tokens), in a context made with llama.cpp's graph-evaluation callback (`cb_eval` of the
context parameters). During the llama_decode call that computes the target's step, every float32
tensor the graph computes is read, by the graph's own names ('attn_norm-0', 'Qcur-0', 'kqv_out-0',
'ffn_out-0', 'l_out-0', 'result_output') and op (RMS_NORM, MUL_MAT, FLASH_ATTN_EXT, ...), on the
target's own token column: the token whose logits that step samples from. Views, permutes and the
writes into the KV cache compute nothing and are skipped; so is a tensor without a token dimension.

Where that column sits is llama.cpp's choice: it cuts a llama_decode batch into micro-batches
(ubatches) itself. With one KV stream (a unified cache, or one sequence) it takes the tokens in batch
order, n_ubatch at a time; with a stream per sequence it takes equal shares of consecutive sequences,
grouped by sequence (llama_batch_allocr's split_simple and split_equal). `ubatches` follows that
rule, each graph's token count is checked against it, and after the last layer keeps only the rows
whose logits are wanted (a GET_ROWS down to the outputs) a column is counted among the outputs. Two
checks refuse a pass read in a wrong column rather than compare it: the traced logits column must be
bitwise the logits llama.cpp hands back for the target, and each row kept for the outputs must be
bitwise a token column read before it (which ties the columns before the selection to the target).
"""

from __future__ import annotations

import ctypes
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from harness.engines.base import Sampling, Unsupported

#: record(name, op, values): one tensor's output on the target's own column (harness.run.trace_diff)
Record = Callable[[str, str, Any], None]
#: one token of a llama_decode call: (token, position, sequence, logits wanted)
Entry = tuple[int, int, int, bool]

_F32 = 0  # ggml_type
#: ops that compute nothing (a view of another tensor's data) or write into the KV cache
_SKIPPED = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "CPY", "SET_ROWS"}
_UNNAMED = re.compile(r"^node_\d+$")  # ggml's name for a node the model left unnamed: its index in the graph
_LAYER = re.compile(r"-(\d+)$")


class _Tensor(ctypes.Structure):
    """The leading fields of ggml.h's struct ggml_tensor (unchanged since 2023): type and shape. Its
    name, op and data are read through ggml's own functions."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int)]


def _ggml() -> Any:
    """ggml's library as llama-cpp-python loads it, its tensor functions typed."""
    try:
        from llama_cpp._ggml import libggml
    except (ImportError, OSError) as exc:
        raise Unsupported(f"llama.cpp: ggml's library is not reachable from llama-cpp-python ({exc})") from exc
    for name, restype, argtypes in (
            ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
            ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t])):
        function = getattr(libggml, name)
        function.restype, function.argtypes = restype, argtypes
    return libggml


def ubatches(entries: list[Entry], n_ubatch: int, streams: bool) -> list[list[int]]:
    """The micro-batches llama.cpp cuts a llama_decode call into, as indices of `entries` in each one's
    token order: one stream, in batch order n_ubatch at a time; a stream per sequence, equal shares of
    consecutive sequences grouped by sequence (see the module's doc)."""
    if not streams:
        return [list(range(start, min(start + n_ubatch, len(entries)))) for start in range(0, len(entries), n_ubatch)]
    by_seq: dict[int, list[int]] = {}
    for index, (_, _, seq, _) in enumerate(entries):
        by_seq.setdefault(seq, []).append(index)
    used, out = [False] * len(entries), []
    while not all(used):
        seqs: list[int] = []
        for index, (_, _, seq, _) in enumerate(entries):
            if not used[index] and seq not in seqs and (not seqs or seq == seqs[-1] + 1):
                seqs.append(seq)
                if len(seqs) > n_ubatch:
                    break
        cursor = [next(i for i, index in enumerate(by_seq[s]) if not used[index]) for s in seqs]
        shares: list[list[int]] = [[] for _ in seqs]
        while all(c < len(by_seq[s]) for c, s in zip(cursor, seqs)):
            for k, s in enumerate(seqs):
                index = by_seq[s][cursor[k]]
                shares[k].append(index)
                used[index] = True
                cursor[k] += 1
            if (len(shares[0]) + 1) * len(seqs) > n_ubatch:
                break
        out.append([index for share in shares for index in share])
    return out


@dataclass
class _Watch:
    """The traced llama_decode call: which ubatch holds the target's token, at which column, and what
    the graph callback has seen of it."""

    record: Record
    ggml: Any
    want: tuple[int, int]  # the target's (sequence, position) at the traced step
    n_vocab: int
    armed: bool = False
    done: bool = False
    sizes: list[int] = field(default_factory=list)  # each ubatch's tokens, llama.cpp's cut as `ubatches` says
    ubatch: int = -1  # the one holding the target's token
    column: int = -1  # its column among that ubatch's tokens
    output: int = -1  # and among that ubatch's outputs
    outputs: int = 0
    entry: int = -1  # its index in the call (llama_get_logits_ith)
    graph: int = -1  # the graph being computed, counted from the call's first
    start: tuple[str, str] | None = None  # the first node's name and op: a graph starts where they come again
    layer: str = ""  # the layer suffix of the last named node ('-3'), for naming unnamed ones
    selected: bool = False  # the graph kept only the output rows
    seen: list[int] = field(default_factory=list)  # each graph's tokens, as the graph says
    last: np.ndarray | None = None  # the last tensor read: the logits column
    recent: list[np.ndarray] = field(default_factory=list)  # the last columns read before the outputs were kept
    kept_unseen: list[str] = field(default_factory=list)  # output rows kept that no column read before matches
    logits: np.ndarray | None = None

    def before(self, ctx: Any, entries: list[Entry], ll: Any, streams: bool) -> None:
        """Called before each llama_decode of the loop: arms the callback for the call that computes the
        target's step (and reads the logits the previous call handed back, where that was the one)."""
        self.after(ctx, ll)
        hit = next((i for i, (_, pos, seq, want) in enumerate(entries) if (seq, pos) == self.want and want), None)
        if hit is None:
            return
        cut = ubatches(entries, int(ll.llama_n_ubatch(ctx)), streams)
        self.ubatch = next(u for u, share in enumerate(cut) if hit in share)
        share = cut[self.ubatch]
        wanted = [i for i in share if entries[i][3]]
        self.sizes, self.column, self.output = [len(s) for s in cut], share.index(hit), wanted.index(hit)
        self.outputs, self.entry, self.armed = len(wanted), hit, True

    def after(self, ctx: Any, ll: Any) -> None:
        if self.armed:
            self.armed, self.done = False, True
            self.logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, self.entry), shape=(self.n_vocab,)).copy()

    def __call__(self, pointer: int, ask: bool, _: Any) -> bool:
        if not self.armed:
            return not ask  # nothing asked: the graph runs whole, as in a run
        tensor = _Tensor.from_address(pointer)
        name = (self.ggml.ggml_get_name(pointer) or b"").decode(errors="replace")
        op = (self.ggml.ggml_op_desc(pointer) or b"").decode(errors="replace")
        ne = [int(n) for n in tensor.ne]
        first = ask and (self.start is None or self.start == (name, op))  # the token embedding: a graph's first node
        if first:
            self.start, self.graph, self.selected, self.layer = (name, op), self.graph + 1, False, ""
            self.seen.append(int(math.prod(ne[1:])))
        if self.graph != self.ubatch:
            return not ask
        name = self._named(name, op)
        if ask:
            if (op == "GET_ROWS" and not first and self.outputs < self.sizes[self.ubatch]
                    and math.prod(ne[1:]) == self.outputs):
                self.selected = True  # from here on a token's column is counted among the outputs
            return (tensor.type == _F32 and op not in _SKIPPED and self._axis(ne) is not None
                    and bool(self.ggml.ggml_is_contiguous(pointer)))
        axis = self._axis(ne)
        inner = math.prod(ne[:axis])
        values = np.empty(inner, dtype=np.float32)
        column = self.output if self.selected else self.column
        self.ggml.ggml_backend_tensor_get(pointer, values.ctypes.data, column * inner * 4, inner * 4)
        if self.selected and op == "GET_ROWS" and not any(np.array_equal(values.view(np.uint32), seen.view(np.uint32))
                                                          for seen in self.recent):
            self.kept_unseen.append(name)  # the target's output row is no token column read before it
        elif not self.selected:
            self.recent = self.recent[-15:] + [values]
        self.record(name, op, values)
        self.last = values
        return True

    def _named(self, name: str, op: str) -> str:
        """A node's graph name; an unnamed one ('node_21': its index, which a batch's extra nodes shift) by its
        op and the layer it sits in ('flash_attn_ext-0'), so that two passes' names align."""
        if not _UNNAMED.match(name):
            found = _LAYER.search(name)
            self.layer = found.group(0) if found else self.layer
            return name
        return f"{op.lower()}{self.layer}"

    def _axis(self, ne: list[int]) -> int | None:
        """The first dimension from which on a tensor runs over tokens (the trailing dimensions' product is
        the ubatch's tokens, or its outputs once selected): a [n_embd, n_tokens] or [head, heads, n_tokens]."""
        tokens = self.outputs if self.selected else self.sizes[self.ubatch]
        return next((d for d in range(1, 4) if math.prod(ne[d:]) == tokens), None)

    def check(self) -> None:
        """The traced column is the target's: graphs cut as expected, its logits bitwise llama.cpp's."""
        if not self.done:
            raise Unsupported("llama.cpp: the traced step was never computed (the run has no such step)")
        if self.seen != self.sizes:
            raise Unsupported(f"llama.cpp cut the traced call into ubatches of {self.seen} tokens, not the "
                              f"{self.sizes} the harness expects: the target's column is not known")
        if self.last is None or self.logits is None or not np.array_equal(self.last.view(np.uint32),
                                                                          self.logits.view(np.uint32)):
            raise Unsupported("llama.cpp: the traced graph's last tensor is not the target's logits bitwise: "
                              "the target's column was misread")
        if self.kept_unseen:
            raise Unsupported(f"llama.cpp: the rows {', '.join(self.kept_unseen)} kept for the target's logits are no "
                              "column read before them: the target's token column was misread")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Every token's log-probability, each as the decode loop's _step_stats computes the one it picked."""
    top = np.float32(logits.max())
    total = float(np.exp(logits - top).sum())
    return (logits.astype(np.float64) - float(top) - math.log(total)).astype(np.float32)


class LlamaTrace:
    """`trace` for an engine that holds LlamaDecode's generate and its contexts."""

    trace_unavailable: str | None = None

    def trace(self, prompts: list[str], target: int, sampling: Sampling, forced: list[int], step: int,
              record: Record, inside: str | None = None) -> np.ndarray:
        """Rebuild the batch through the decode loop up to step `step` (0: the prefill), the target fed
        `forced`, recording each tensor of that step's graph on the target's column (see the module's
        doc); returns the target's float32 log-probabilities at that step."""
        if inside is not None:
            raise Unsupported("llama.cpp: every tensor of the graph is traced at once; there is no level inside one")
        ll = self._ll
        watch = _Watch(record, _ggml(), (target, len(self.prompt_tokens(prompts[target])) - 1 + step),
                       self.n_vocab)
        streams = len(prompts) > 1 and not self.opts.kv_unified
        callback = ll.ggml_backend_sched_eval_callback(watch)
        self._drop_contexts()
        self._eval_callback = callback
        self._decode_watch = lambda ctx, entries: watch.before(ctx, entries, ll, streams)
        try:
            force = list(forced[:step]) + [forced[step] if step < len(forced) else 0]  # the last is never fed
            self.generate(prompts, target, sampling, force=force)
            if self._contexts:
                watch.after(next(iter(self._contexts.values())), ll)
        finally:
            self._decode_watch = None
            self._drop_contexts()
            self._eval_callback = None
        watch.check()
        return _log_softmax(watch.logits)
