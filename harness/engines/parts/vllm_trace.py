"""One vLLM batch traced module by module, as `harness locate` asks (a part of harness.engines.vllm; the
comparison is harness.run.trace_diff's, for every engine).

The batch goes through vLLM's own step loop (vllm_steps.run_batch: the requests added at once, vLLM's
scheduler composing each forward pass), the target forced its recorded tokens by the forcing logits
processor (vllm_force). Forward hooks are put on every module of the loaded model inside vLLM's model
worker, through vLLM's own way of running a function there (`LLM.collective_rpc`). They record only
in the forward pass that computes the target's traced step: the one where the target's request has
computed 0 tokens (the prefill) or its prompt and step - 1 tokens (decode step `step`), as the model
runner's input batch says. Each module's output is reduced to the target's own rows of the pass's
flattened tokens (the runner's query_start_loc), and the logits processor's to the target's request
row. A module shared by every layer (the rotary embedding) is named under the layer that called it.
The logits row must give, through a log-softmax, the log-probabilities vLLM returned for the target
at that step, or the pass is refused: rows misread are never compared.

The worker writes the pass into a file (trace_diff.Recording), which this process reads back in
order. The check against the run is the row's: vLLM hands out no logit vector, so the returned
log-probabilities hold the ones it exposed at that step (the forced token's and its top two) and
-inf elsewhere. A compiled model runs its modules inside one graph that hooks do not see: tracing
needs a load with `enforce_eager: true`, as the run's own load must have had for the pass to be rebuilt
bitwise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.core.op_recording import Recording
from harness.engines.base import Sampling, Unsupported

#: record(name, op, values): one module's output on the target's own rows (harness.run.trace_diff)
Record = Callable[[str, str, Any], None]
_STATE = "_harness_trace"  # the worker's attribute that holds a trace in progress


def install(worker: Any, request: str, computed: int, path: str, offset: int = 0) -> None:
    """Runs in vLLM's model worker: hooks on every module, recording into `path` during the forward pass
    where the request whose id starts with `request` has computed `computed` tokens (`offset`: read the
    request that many places further on, which only a test of the row check asks)."""
    import torch

    from harness.engines.parts.hf_trace import _first_tensor

    runner, model = worker.model_runner, worker.model_runner.model
    state: dict[str, Any] = {"armed": False, "rows": None, "request_row": -1, "passes": 0, "logits": False,
                             "stack": [], "handles": [], "recording": Recording(Path(path))}
    setattr(worker, _STATE, state)
    uses: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    shared = {key for key, count in uses.items() if count > 1}
    once = dict(model.named_modules())

    def arm(module: Any, args: Any) -> None:
        batch = runner.input_batch
        index = next((i for i, rid in enumerate(batch.req_ids[:batch.num_reqs]) if str(rid).startswith(request)), None)
        state["armed"] = (index is not None and int(batch.num_computed_tokens_cpu[index]) == computed)
        if state["armed"]:
            index = (index + offset) % batch.num_reqs
            bounds = runner.query_start_loc.np
            state["rows"], state["request_row"] = (int(bounds[index]), int(bounds[index + 1])), index
            state["tokens"], state["requests"] = int(bounds[batch.num_reqs]), batch.num_reqs
            state["passes"], state["scheduled"] = state["passes"] + 1, int(bounds[index + 1] - bounds[index])

    def enter(name: str, module: Any, args: Any) -> None:
        stack = state["stack"]
        own = f"{stack[-1]}.{name.rsplit('.', 1)[-1]}" if id(module) in shared and stack else name
        stack.append(own)

    def leave(module: Any, args: Any, output: Any) -> None:
        name = state["stack"].pop()
        if not state["armed"]:
            return
        tensor = _first_tensor(output, torch)
        if tensor is None or not tensor.dim():
            return
        start, end = state["rows"]
        if name == "logits_processor" or type(module).__name__ == "LogitsProcessor":
            if tensor.shape[0] != state["requests"]:
                return
            tensor, state["logits"], state["armed"] = tensor[state["request_row"]], True, False
        elif tensor.shape[0] >= state["tokens"]:
            tensor = tensor[start:end]
        else:
            return
        state["recording"](name, type(module).__name__, tensor.detach().float().cpu().numpy())

    handles = [model.register_forward_pre_hook(arm)]
    for name, module in once.items():
        if name:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: enter(n, m, a)))
            handles.append(module.register_forward_hook(leave))
    state["handles"] = handles


def collect(worker: Any) -> dict[str, Any]:
    """Runs in vLLM's model worker: the hooks removed, the recording saved; what was seen."""
    state = getattr(worker, _STATE)
    for handle in state["handles"]:
        handle.remove()
    state["recording"].save()
    state["recording"].close()
    delattr(worker, _STATE)
    return {"ops": len(state["recording"].ops), "passes": state["passes"], "logits": state["logits"],
            "scheduled": state.get("scheduled", 0)}


def _check_row(logits: np.ndarray, exposed: np.ndarray) -> None:
    """The traced logits row is the target's: its log-softmax gives the log-probabilities vLLM exposed for
    the target at that step (to float rounding; another request's row is off by far more)."""
    top = logits.max()
    own = logits - top - np.log(np.exp(logits - top).sum())
    shown = np.isfinite(exposed)
    if logits.size != exposed.size or not shown.any() or np.abs(own[shown] - exposed[shown]).max() > 1e-4:
        raise Unsupported("vLLM: the traced logits row does not give the log-probabilities vLLM returned for the "
                          "target: its rows were misread")


class VllmTrace:
    """`trace` for an engine that holds VllmGenerate's `llm`, `_params` and its options."""

    trace_unavailable: str | None = None
    #: the request read is this many places past the target's: 0, but for a test that sees the row check refuse
    _trace_offset = 0

    def trace(self, prompts: list[str], target: int, sampling: Sampling, forced: list[int], step: int,
              record: Record, inside: str | None = None) -> np.ndarray:
        """Rebuild the batch through vLLM's step loop, the target forced its tokens up to step `step` (0:
        the prefill), recording each module's output on the target's rows in that step's forward pass
        (see the module's doc); returns the log-probabilities vLLM exposed for the target at that step."""
        from harness.engines.parts import vllm_steps

        why = self._untraceable()
        if why or inside is not None:
            raise Unsupported(f"vLLM: {why or 'a level inside a module is not traced on vLLM'}")
        head = self.prompt_tokens(prompts[target])
        force = list(forced[:step]) + [forced[step] if step < len(forced) else 0]  # the last only closes the step
        params = self._params(prompts, target, sampling, None, force)
        self._batches += 1
        tag = f"harness-trace-{self._batches}"
        with tempfile.TemporaryDirectory(prefix="harness-vllm-trace-") as folder:
            path = Path(folder) / "pass.bin"
            computed = 0 if step == 0 else len(head) + step - 1
            self.llm.collective_rpc(install, args=(f"{tag}-{target}-", computed, str(path), self._trace_offset))
            try:
                outputs, _, _ = vllm_steps.run_batch(self.llm.llm_engine, tag, [{"prompt_token_ids": self.prompt_tokens(p)}
                                                                                 for p in prompts], params, target)
            finally:
                seen = self.llm.collective_rpc(collect)[0]
            result = outputs[target].outputs[0]
            if list(result.token_ids) != force:
                raise Unsupported("vLLM did not emit the forced tokens: the traced pass is not the run's")
            exposed = np.full(self._vocab_size, -np.inf, dtype=np.float32)
            for token, logprob in (result.logprobs[step] if step < len(result.logprobs) else {}).items():
                exposed[token] = logprob.logprob
            recording = Recording.load(path)
            try:
                if seen["logits"]:
                    _check_row(recording.values(len(recording.ops) - 1).astype(np.float64), exposed)
                if seen["passes"] != 1 or not seen["logits"] or seen["scheduled"] != (len(head) if step == 0 else 1):
                    raise Unsupported(f"vLLM computed the traced step in {seen['passes']} forward pass(es), "
                                      f"{seen['scheduled']} of the target's tokens in it"
                                      + ("" if seen["logits"] else ", no logits for the target")
                                      + ": a prefill in chunks is not traced")
                for index, (name, op, _, _) in enumerate(recording.ops):
                    record(name, op, recording.values(index))
            finally:
                recording.close()
        return exposed

    def _untraceable(self) -> str | None:
        if not hasattr(self.llm, "collective_rpc"):
            return f"vLLM {self._vllm.__version__} has no LLM.collective_rpc to put hooks in its model worker"
        if not self.opts.enforce_eager:
            return ("a compiled model runs its modules inside one graph, where hooks see nothing: trace a load with "
                    "enforce_eager: true (the run's own, for its pass to be rebuilt bitwise)")
        if self.opts.tensor_parallel_size > 1:
            return "with tensor_parallel_size > 1 each worker holds a shard of every module's output"
        if self.spec.prefix_caching or self.opts.enable_prefix_caching:
            return "with prefix caching, cached positions are not computed again"
        if self.spec.draft_tokens:
            return "with speculative decoding a step is a drafter's and a verifier's pass"
        return None
