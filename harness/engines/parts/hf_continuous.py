"""A batch through transformers' continuous batching: the batch's requests added together to one
ContinuousBatchingManager (paged KV cache, its own scheduler, a thread of its own), kept for the
whole load as a server keeps its scheduler (a part of harness.engines.hf_transformers).

The manager samples with one generator for every request, so a draw would depend on the batch-mates:
only greedy decoding is run. It hands out the chosen tokens' log-probabilities and each token's
time, not logits: margins are not recorded and a logit probe is refused. Prefix sharing between
requests (`allow_block_sharing`) and the switch to flash attention are turned off, so that the
attention implementation asked for is the one that runs and no request reuses another's KV; a
transformers whose ContinuousBatchingConfig cannot turn sharing off or return log-probabilities
(before 5.4) is refused (`continuous_gap`), never run on its defaults.
"""

from __future__ import annotations

import math
import time
from typing import Any

from harness.engines.base import BatchOutput, Sampling, SequenceOutput, StepObserver, Unsupported
from harness.engines.parts.end_of_generation import without_end

#: what a continuous batch must be run with to measure what it claims: its own log-probabilities, no request
#: reading another's KV blocks, and the attention asked for (no switch to flash); each applied where the
#: installed transformers has the field
CONFIG_WANTED: dict[str, bool] = {"return_logprobs": True, "allow_block_sharing": False, "auto_switch_to_flash": False}
#: the fields without which a continuous batch is not run: rows would hold no log-probabilities, or
#: requests would share KV blocks (ContinuousBatchingConfig has both from transformers 5.4 on)
CONFIG_REQUIRED = ("return_logprobs", "allow_block_sharing")
#: the first transformers whose ContinuousBatchingConfig holds CONFIG_REQUIRED (read from its released source)
CONTINUOUS_FLOOR = "5.4"


def config_fields(transformers: Any) -> set[str] | None:
    """The fields of this transformers' ContinuousBatchingConfig; None where it has none."""
    import dataclasses
    import inspect

    config = getattr(transformers, "ContinuousBatchingConfig", None)
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)}
    return set(inspect.signature(config).parameters)


def continuous_gap(transformers: Any) -> str | None:
    """Why this transformers cannot run a continuous batch as the harness measures it (its version and
    the field it lacks), None where it can: one answer for the engine, which refuses such cells as
    unsupported, and for doctor."""
    version = getattr(transformers, "__version__", "?")
    if not hasattr(getattr(transformers, "GenerationMixin", None), "init_continuous_batching"):
        return f"transformers {version} has no continuous batching (init_continuous_batching)"
    fields = config_fields(transformers)
    if fields is None:
        return (f"transformers {version} has no ContinuousBatchingConfig, so neither log-probabilities nor KV blocks "
                f"kept apart can be asked for (transformers {CONTINUOUS_FLOOR} on has both)")
    missing = [f for f in CONFIG_REQUIRED if f not in fields]
    if missing:
        return (f"transformers {version}'s ContinuousBatchingConfig has no {', '.join(missing)} "
                f"(transformers {CONTINUOUS_FLOOR} on has it)")
    return None


def quiet_broken_telemetry(transformers: Any) -> str | None:
    """Some releases (5.4 among them) fail every continuous batch where OpenTelemetry is installed (vLLM
    installs it): their batch telemetry reads `status` of the scheduler's FutureRequestState, which has
    none. The telemetry changes no output: it is turned off in this process (the engine's worker), and
    what was done is said (None where nothing was)."""
    try:
        from transformers.generation.continuous_batching.requests import FutureRequestState
        from transformers.utils import metrics
    except ImportError:
        return None
    watcher = getattr(metrics, "ContinuousBatchProcessorMetrics", None)
    if getattr(watcher, "record_batch_metrics", None) is None or not getattr(metrics, "_has_opentelemetry", False):
        return None
    if "status" in getattr(FutureRequestState, "__slots__", ("status",)) or hasattr(FutureRequestState, "status"):
        return None
    watcher.record_batch_metrics = lambda self, requests_in_batch: None
    return (f"batch telemetry off: transformers {getattr(transformers, '__version__', '?')}'s reads a field its "
            "request states lack and stops the manager while OpenTelemetry is installed")


def watch_passes() -> list[tuple[str, ...]] | None:
    """The request ids of each forward pass transformers' scheduler makes in this process, appended as it
    schedules them (its schedule_batch wrapped, once per process), so a row can say which requests shared
    its passes: "batch 8" under a scheduler is otherwise nominal. None where the scheduler is not readable."""
    try:
        from transformers.generation.continuous_batching import scheduler
    except ImportError:
        return None
    classes = set(getattr(scheduler, "SCHEDULER_MAPPING", {}).values()) or {getattr(scheduler, "Scheduler", None)}
    log = None
    for cls in [c for c in classes if c is not None and "schedule_batch" in c.__dict__]:
        known = getattr(cls.schedule_batch, "pass_log", None)
        if known is not None:
            log = known
            continue
        log = log if log is not None else []

        def logged(self: Any, *args: Any, _original: Any = cls.schedule_batch, _log: list = log, **kwargs: Any) -> Any:
            out = _original(self, *args, **kwargs)
            batch = out[0] if isinstance(out, tuple) else out
            if batch:
                _log.append(tuple(str(getattr(getattr(f, "state", f), "request_id", "?")) for f in batch))
            return out

        logged.pass_log = log  # type: ignore[attr-defined]
        cls.schedule_batch = logged
    return log


def pass_record(passes: list[tuple[str, ...]], names: list[str], target: str) -> dict[str, Any]:
    """What a batch's forward passes held: how many passes ran its requests, how many requests each held
    (a count per size), and in how many of the target's passes it had company."""
    ours = set(names)
    mine = [p for p in passes if ours.intersection(p)]
    sizes: dict[str, int] = {}
    for p in mine:
        sizes[str(len(p))] = sizes.get(str(len(p)), 0) + 1
    with_target = [p for p in mine if target in p]
    return {"passes": len(mine), "requests_per_pass": sizes, "target_passes": len(with_target),
            "target_shared": sum(1 for p in with_target if len(p) > 1)}


#: the longest generation the manager is first started for (a cell that asks for more restarts it)
_FIRST_TOKENS = 256
#: how long a batch may go without any request finishing before the manager is judged stuck
_STALL_S = 600.0


class HfContinuous:
    """`generate` for continuous batching, for an engine that holds `model`, `tokenizer`, `_eos`,
    `pad_id`, `opts` and `prompt_tokens` / `decode_tokens`."""

    _manager: Any = None
    _manager_tokens = 0
    _passes: list[tuple[str, ...]] | None = None

    def _open_continuous(self) -> None:
        """Start the load's manager (so that what describe() reads, the attention it switched to, is what
        runs), or refuse a transformers without continuous batching, naming its version."""
        gap = continuous_gap(self._transformers)
        if gap:
            raise Unsupported(f"batching continuous: {gap}")
        self._start_manager(_FIRST_TOKENS)

    def _start_manager(self, max_tokens: int) -> Any:
        """The load's manager, started once (again only if a cell asks for more tokens than it was made for)."""
        if self._manager is not None and max_tokens <= self._manager_tokens:
            return self._manager
        self._close_continuous()
        from transformers import GenerationConfig

        generation = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=self.pad_id,
                                      eos_token_id=None if self.opts.ignore_eos else sorted(self._eos))
        fields = config_fields(self._transformers) or set()
        applied = {k: v for k, v in CONFIG_WANTED.items() if k in fields}
        kwargs: dict[str, Any] = {"generation_config": generation,
                                  "continuous_batching_config": self._transformers.ContinuousBatchingConfig(**applied)}
        # what the rows' detail says: each field as applied, and one this transformers does not have
        quieted = quiet_broken_telemetry(self._transformers)
        self._cb_config = ", ".join([f"{k}={v}" for k, v in applied.items()]
                                    + [f"{k}: not a field in transformers {self._transformers.__version__}"
                                       for k in CONFIG_WANTED if k not in applied] + ([quieted] if quieted else []))
        self._passes = watch_passes()
        self._manager = self.model.init_continuous_batching(**kwargs)
        self._manager.start()
        self._manager_tokens = max_tokens
        return self._manager

    def _continuous(self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None,
                    members: bool) -> BatchOutput:
        if sampling.temperature > 0:
            raise Unsupported("batching continuous: transformers' manager draws every request from one generator, so "
                              "a run's draw would depend on its batch-mates; only greedy (temperature 0) is run")
        if observe is not None:
            raise Unsupported(self.logit_probe_unavailable)
        manager = self._start_manager(sampling.max_tokens)
        ids = [self.prompt_tokens(p) for p in prompts]
        seen = len(self._passes) if self._passes is not None else 0
        t0 = time.perf_counter()
        first = getattr(manager, "_request_counter", None)
        names = manager.add_requests(ids, max_new_tokens=sampling.max_tokens, record_timestamps=True)
        if names is None:  # before transformers 5.9 the ids are not handed back: they are req_<counter>, counted on
            if not isinstance(first, int):
                raise Unsupported(f"batching continuous: transformers {self._transformers.__version__}'s manager hands "
                                  "back no request ids, and its counter is not readable")
            names = [f"req_{i}" for i in range(first, first + len(ids))]
        results: dict[str, Any] = {}
        waited = 0.0
        while len(results) < len(names):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id in names:
                results[result.request_id] = result
                waited = 0.0
                continue
            if not manager.is_running():
                raise RuntimeError("transformers' continuous-batching manager stopped before the batch finished")
            waited += 1.0 if result is None else 0.0
            if waited > _STALL_S:
                for name in names:
                    if name not in results:
                        manager.cancel_request(name)
                raise RuntimeError(f"no request of the batch finished within {_STALL_S:.0f} s")
        wall = time.perf_counter() - t0
        failed = [r.error for r in results.values() if r.error]
        if failed:
            raise RuntimeError(f"transformers' continuous batching failed a request: {failed[0]}")
        outs = [self._sequence(results[name], sampling.max_tokens) for name in names]
        times = [t - t0 for t in (results[names[target]].timestamps or [])]
        mine = outs[target]
        return BatchOutput(
            target=mine,
            prompt_tokens=len(ids[target]),
            prefill_s=None,
            ttft_s=times[0] if times else None,
            target_s=times[len(mine.logprobs) - 1] if len(times) >= len(mine.logprobs) > 0 else wall,
            wall_s=wall,
            batch_generated_tokens=sum(len(results[n].generated_tokens) for n in names),
            members=outs if members else [],
            token_times=times[:len(mine.token_ids)],
            detail={"continuous_config": self._cb_config,
                    "forward_passes": ("not readable in this transformers" if self._passes is None
                                       else pass_record(self._passes[seen:], names, names[target]))},
        )

    def _sequence(self, result: Any, max_tokens: int) -> SequenceOutput:
        """One request's output: its tokens without a final end-of-generation one (kept as a step in the
        log-probabilities, as every engine keeps it), margins unknown."""
        generated = [int(t) for t in result.generated_tokens]
        logprobs = [float(x) for x in (result.logprobs or [])] or [math.nan] * len(generated)
        stopped = bool(generated) and not self.opts.ignore_eos and generated[-1] in self._eos
        ids, _ = without_end(generated, [], None if self.opts.ignore_eos else self._eos, stopped)
        finish = "stop" if stopped else "length"
        return SequenceOutput(ids, self.decode_tokens(ids), finish, logprobs, [math.nan] * len(logprobs),
                              [self.decode_tokens([t]) for t in ids])

    def _close_continuous(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.stop(block=True, timeout=30)
