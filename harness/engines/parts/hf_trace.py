"""One forward pass of a padded batch traced op by op, as `harness locate` asks (a part of
harness.engines.hf_transformers; the comparison is harness.run.trace_diff's, for every engine).

The pass is rebuilt exactly as the padded loop (hf_padded) ran it: the same left padding, mask and
position ids, the same forward calls with the KV cache, batch-mates decoding as they did (greedy, or
drawn with their own seeded generators), the target fed its recorded tokens, up to the step asked
(0: the prefill). At that step every module's output is recorded (forward hooks, in the order they
fire), or, `inside` a module, every torch op that module runs (a dispatch-level trace), each reduced
to the target's own elements: its row of the batch, and along any dimension as long as the padded
sequence (the prompt's width, or the cache's length at a decode step) only its own last positions.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np

from harness.engines.base import Sampling, Unsupported
from harness.engines.parts.hf_padded import _generators

#: record(name, op, values): one op's output on the target's own elements (harness.run.trace_diff)
Record = Callable[[str, str, Any], None]


def _first_tensor(output: Any, torch: Any) -> Any:
    """A module's or op's output tensor: itself, or the first floating tensor of a tuple or a ModelOutput."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _own(t: Any, target: int, rows: int, total: int, own: int) -> np.ndarray:
    """The target's own elements of one output: its row where the output has one per request, and along
    each dimension as long as the padded sequence (`total`), its own last `own` positions."""
    if t.dim() and t.shape[0] == rows:
        t = t[target]
    if total != own:
        for dim, size in enumerate(t.shape):
            if size == total:
                t = t.narrow(dim, total - own, own)
    return t.detach().float().cpu().numpy()


@contextlib.contextmanager
def _tracing(model: Any, torch: Any, record: Record, take: Callable[[Any], np.ndarray],
             inside: str | None) -> Iterator[None]:
    """Every module's output recorded while the block runs; `inside` a module, every torch op it runs."""
    handles = []

    def hook(name: str, module: Any, args: Any, output: Any) -> None:
        tensor = _first_tensor(output, torch)
        if tensor is not None:
            record(name, type(module).__name__, take(tensor))

    if inside is None:
        for name, module in model.named_modules():
            if name:  # the model itself hands back a ModelOutput: its logits are lm_head's output
                handles.append(module.register_forward_hook(partial(hook, name)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        return
    from torch.overrides import TorchFunctionMode

    modules = dict(model.named_modules())
    if inside not in modules:
        raise Unsupported(f"trace: the model has no module named {inside}")

    class Calls(TorchFunctionMode):
        """Every torch function the module calls (F.linear, F.scaled_dot_product_attention, torch.cat, a
        tensor's methods), at the Python level: below it a dispatch-level mode changed which kernel ran."""

        active = False

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            tensor = _first_tensor(out, torch) if self.active else None
            if tensor is not None:  # the mode is off inside its own handler: take()'s calls are not traced
                record(inside, _function_name(func), take(tensor))
            return out

    mode = Calls()
    handles = [modules[inside].register_forward_pre_hook(lambda *_: setattr(mode, "active", True)),
               modules[inside].register_forward_hook(lambda *_: setattr(mode, "active", False))]
    try:
        with mode:
            yield
    finally:
        for handle in handles:
            handle.remove()


def _function_name(func: Any) -> str:
    """'torch.nn.functional.linear', 'Tensor.view': a torch function's name as the code calls it."""
    owner = getattr(func, "__objclass__", None)
    if owner is not None:
        return f"{owner.__name__}.{func.__name__}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{getattr(func, '__qualname__', getattr(func, '__name__', repr(func)))}"


class HfTrace:
    """`trace` for an engine that also holds HfPadded's `_padded_inputs`, `_next_feed`, `_picks`."""

    trace_unavailable: str | None = None
    trace_inside = True

    def trace(self, prompts: list[str], target: int, sampling: Sampling, forced: list[int], step: int,
              record: Record, inside: str | None = None) -> np.ndarray:
        """Rebuild the batch's forward pass at decode step `step` (0: the prefill) with the target fed
        `forced`, recording each op's output on the target's own elements (see the module's doc);
        returns the target's float32 log-probabilities at that step, for the check against the row."""
        if self.opts.batching != "padded":
            raise Unsupported("trace: transformers' continuous-batching manager runs its forward passes in a thread "
                              "of its own, with its own scheduler; a padded batch can be traced")
        torch = self.torch
        ids, tokens, mask, positions = self._padded_inputs(prompts)
        rows, width, own = len(ids), tokens.shape[1], len(ids[target])
        generators = _generators(torch, self.device, rows, target, sampling) if sampling.temperature > 0 else []
        outs: list[list[int]] = [[] for _ in range(rows)]
        live = [True] * rows
        out: Any = None
        with torch.inference_mode():
            for at in range(step + 1):
                take = partial(_own, target=target, rows=rows, total=width + at, own=own + at)
                traced = _tracing(self.model, torch, record, take, inside) if at == step else contextlib.nullcontext()
                with traced:
                    if at == 0:
                        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                                         **self.forward_extra)
                    else:
                        feed, mask, positions = self._next_feed(outs, live, mask, positions)
                        out = self.model(input_ids=feed, attention_mask=mask, position_ids=positions, use_cache=True,
                                         **{self.cache_arg: getattr(out, self.cache_arg)})
                logits = out.logits[:, -1, :].float()
                if at == step:
                    return logits[target].log_softmax(-1).cpu().numpy()
                picks = self._picks(logits, live, generators, sampling)
                picks[target] = forced[at]
                for seq in range(rows):
                    if not live[seq]:
                        continue
                    if not self.opts.ignore_eos and picks[seq] in self._eos:
                        live[seq] = False
                        continue
                    outs[seq].append(picks[seq])
                    live[seq] = len(outs[seq]) < sampling.max_tokens
        raise AssertionError("unreachable: the loop returns at its last step")
