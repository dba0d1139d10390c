"""llama.cpp in-process, decoding N sequences together the way llama-server's slots do.

This file is the load (options, model file, contexts, what ran); its parts are in engines/parts/:
llamacpp_decode.py (the batch decode loop), llamacpp_tokens.py (chat template and vocabulary),
llamacpp_scoring.py (prefill scoring), llamacpp_trace.py (a batch's graph traced tensor by tensor, for
`harness locate`) and llamacpp_doctor.py (the build, its needs and crash advice).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from harness.core import native_preload
from harness.core.cpus import usable_cpus
from harness.engines.base import (
    HONOUR,
    AutoOnOff,
    Engine,
    EngineOptions,
    LoadSpec,
    Log,
    Refuse,
    Unsupported,
    template_sha256,
)
from harness.engines.parts import cpu_kernels
from harness.engines.parts.chat_template import ChatTemplate
from harness.engines.parts.llama_offload import gpu_layers, offload_state
from harness.engines.parts.llamacpp_decode import LlamaDecode
from harness.engines.parts.llamacpp_doctor import LlamaCppDoctor
from harness.engines.parts.llamacpp_scoring import LlamaScoring
from harness.engines.parts.llamacpp_tokens import LlamaTokens
from harness.engines.parts.llamacpp_trace import LlamaTrace
from harness.models import catalog as models


class LlamaCppOptions(EngineOptions):
    added_later = ("extra_bufts",)
    n_gpu_layers: int | None = Field(
        None, ge=-1, description="layers offloaded to a GPU; -1 = all; default: all, or none for gpu: cpu")
    n_threads: int | None = Field(None, ge=1, description="decode threads; default: the CPUs this process may use "
                                  "(affinity, cgroup quota, SLURM_CPUS_PER_TASK)")
    n_threads_batch: int | None = Field(None, ge=1, description="prefill threads; default: n_threads")
    n_batch: int = Field(2048, ge=1, description="logical batch (tokens per llama_decode call)")
    n_ubatch: int = Field(512, ge=1, description="physical micro-batch")
    n_ctx: int | None = Field(None, ge=16, description="context per sequence; default: fits prompt + max_tokens")
    flash_attn: AutoOnOff = "auto"
    kv_unified: bool = False
    ignore_eos: bool = False
    use_mmap: bool = True
    verbose: bool = Field(False, description="show llama.cpp's own log lines")
    extra_bufts: AutoOnOff = Field(
        "auto", description="llama.cpp's extra buffer types (AMX tiles, repacked weights): on, off (its --no-repack), "
                            "or auto: on, unless the CPU reports AMX and a probe finds its kernels crash here")


_FLASH = {"auto": -1, "off": 0, "on": 1}
#: kv_cache_dtype axis -> ggml type of the K and V caches (None: llama.cpp's default, f16)
_KV_TYPES = {"auto": None, "f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}


class LoadLog:
    """llama.cpp's log lines while a model loads, kept (and echoed when verbose) so that what it
    did, e.g. how many layers it offloaded, is read from llama.cpp itself."""

    def __init__(self, ll: Any, echo: bool) -> None:
        self._ll, self.lines = ll, []

        @ll.llama_log_callback
        def keep(level: int, text: bytes, user_data: Any) -> None:
            line = text.decode("utf-8", errors="replace")
            self.lines.append(line)
            if echo:
                print(line, end="", file=sys.stderr, flush=True)

        self._keep = keep  # referenced for as long as llama.cpp may call it

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> "LoadLog":
        self._ll.llama_log_set(self._keep, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc: object) -> None:
        from llama_cpp import _logger

        self._ll.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))



class LlamaCppEngine(LlamaCppDoctor, LlamaTokens, LlamaScoring, LlamaTrace, LlamaDecode, Engine):
    name = "llamacpp"
    Options = LlamaCppOptions
    logit_probe_unavailable = None
    score_unavailable = None
    replay_unavailable = None  # generate(..., force=tokens)
    axes = {
        "model": HONOUR,
        "engine": HONOUR,
        "dtype": HONOUR,
        "gpu": HONOUR,
        "batch_invariant": Refuse("llama.cpp has no batch-invariant mode; its results may depend on slot count and batch size"),
        "batch_size": HONOUR,
        "seed": HONOUR,
        "temperature": HONOUR,
        "top_p": HONOUR,
        "top_k": HONOUR,
        "prefix_cache": HONOUR,
        "context_tokens": HONOUR,
        "prefill_chunk": HONOUR,
        "kv_cache_dtype": HONOUR,
        "kv_cache_tokens": Refuse("llama.cpp's in-process loop keeps every sequence of a batch in its KV cache from "
                                  "start to end, with no scheduler: nothing is ever preempted (a batch that does not "
                                  "fit fails); preemption is measured on vLLM"),
        "draft_tokens": Refuse("the in-process loop decodes one token per step; speculative decoding of llama.cpp "
                               "runs through --engine llama-server (its draft_model option)"),
        "filler_tokens": HONOUR,
        "environment": HONOUR,  # the worker's interpreter: any engine runs in another venv
    }
    exits_fast = True  # close() frees its contexts; the rest is memory the process gives back
    native_package = native_preload.LLAMA_CPP
    rehearsed = True
    install = 'CMAKE_ARGS="-DLLAVA_BUILD=OFF" pip install -e ".[llamacpp]"'

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        if spec.dtype not in ("auto",) + models.GGUF_DTYPES:
            return f"llama.cpp engine cannot use dtype '{spec.dtype}'"
        if spec.kv_cache_dtype not in _KV_TYPES:
            return f"llama.cpp has no KV cache of type '{spec.kv_cache_dtype}'; allowed: {', '.join(_KV_TYPES)}"
        return None

    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        import llama_cpp as ll  # imported here so that `plan` and `summarize` never need it

        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if spec.options.get("verbose") else logging.ERROR)
        self._ll = ll
        self.spec = spec
        self.opts = LlamaCppOptions.model_validate(spec.options)
        source = models.resolve_gguf(spec.model, base)
        self.model_path = models.gguf_in_dtype(source, spec.dtype, log)
        self.model_sha256 = models.file_sha256(self.model_path)
        ll.llama_backend_init()
        self.n_threads = self.opts.n_threads or usable_cpus()  # the job's CPUs, not the node's
        self.system_info = ll.llama_print_system_info().decode(errors="replace").strip()
        self.extra = self.kernel_choice(self.opts.extra_bufts, self.model_path, self.model_sha256, self.system_info,
                                        self.n_threads, log)[0]
        if self.extra.warning:
            log(self.extra.warning)
        mparams = ll.llama_model_default_params()
        self.n_gpu_layers = gpu_layers(spec.gpu, self.opts.n_gpu_layers)
        mparams.n_gpu_layers = self.n_gpu_layers
        mparams.use_mmap = self.opts.use_mmap
        mparams.use_extra_bufts = self.extra.use_extra
        with LoadLog(ll, echo=self.opts.verbose) as load_log:
            self._model = ll.llama_model_load_from_file(str(self.model_path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.model_path}")
        self.kernel_path = cpu_kernels.kernel_path(cpu_kernels.extra_buffers(load_log.text), self.system_info)
        self._offload = offload_state(load_log.text, bool(ll.llama_supports_gpu_offload()), self.n_gpu_layers,
                                      ll.llama_print_system_info().decode(errors="replace"),
                                      int(ll.llama_model_n_layer(self._model)))
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        #: tokens per prefill call (the prefill_chunk axis; n_batch by default)
        self.prefill_step = self.opts.n_batch if spec.prefill_chunk == "auto" else int(spec.prefill_chunk)
        self._probe_ctx: Any = None
        self._probe_ctx_size = 0
        self._template_raw = ll.llama_model_chat_template(self._model, None)
        self._prompt_cache: dict[str, list[int]] = {}
        self._jinja: ChatTemplate | None = None
        self.chat_template_kind = "none (raw prompt)"
        if self._template_raw:
            self.chat_template_kind = "model jinja"
            try:
                self._jinja = ChatTemplate(
                    self._template_raw.decode("utf-8", errors="replace"),
                    self._special(ll.llama_vocab_bos),
                    self._special(ll.llama_vocab_eos),
                )
            except ValueError:
                self.chat_template_kind = "llama.cpp built-in"
        self._contexts: dict[tuple[int, int], Any] = {}
        #: llama.cpp's graph-evaluation callback for the contexts made while a tracer (llamacpp_trace) runs
        self._eval_callback: Any = None
        self._batch = None
        self._batch_cap = 0

    # -- contexts and batches ---------------------------------------------------------
    def _context(self, n_seq: int, per_seq: int) -> Any:
        key = (n_seq, per_seq)
        ctx = self._contexts.get(key)
        if ctx is not None:
            return ctx
        self._drop_contexts()  # one live context at a time keeps memory flat
        ll = self._ll
        params = ll.llama_context_default_params()
        params.n_ctx = n_seq * per_seq
        params.n_seq_max = n_seq
        self._set_params(params, max(self.prefill_step, n_seq))
        if self._eval_callback is not None:
            params.cb_eval = self._eval_callback
        ctx = ll.llama_init_from_model(self._model, params)
        if not ctx:
            self._refuse_kv()
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences x {per_seq} tokens")
        self._contexts[key] = ctx
        return ctx

    def _drop_contexts(self) -> None:
        for ctx in self._contexts.values():
            self._ll.llama_free(ctx)
        self._contexts.clear()

    def _set_params(self, params: Any, n_batch: int) -> None:
        """Context parameters from the options and the prefill_chunk / kv_cache_dtype axes."""
        params.n_batch = n_batch
        if self.spec.prefill_chunk == "auto":
            params.n_ubatch = min(self.opts.n_ubatch, self.opts.n_batch, n_batch)
        else:
            params.n_ubatch = self.prefill_step
        params.n_threads = self.n_threads
        params.n_threads_batch = self.opts.n_threads_batch or self.n_threads
        params.flash_attn_type = _FLASH[self.opts.flash_attn]
        params.kv_unified = self.opts.kv_unified
        params.no_perf = True
        kv = _KV_TYPES[self.spec.kv_cache_dtype]
        if kv is not None:
            params.type_k = params.type_v = kv

    def _refuse_kv(self) -> None:
        if self.spec.kv_cache_dtype in ("q8_0", "q4_0") and self.opts.flash_attn == "off":
            raise Unsupported(f"llama.cpp: a quantized ({self.spec.kv_cache_dtype}) V cache needs flash_attn; "
                              "it is off here")


    def describe(self) -> dict[str, Any]:
        ll = self._ll
        return {
            "engine_version": f"llama-cpp-python {ll.__version__}",
            "engine_info": self.system_info,
            "extra_bufts": self.extra.said,
            "cpu_kernels": self.kernel_path,
            "gpu_offload": bool(ll.llama_supports_gpu_offload()),
            "native_preload": native_preload.state(self.native_package),
            "n_gpu_layers": self.n_gpu_layers,
            "n_threads": self.n_threads,
            "prefill_step": self.prefill_step,
            "n_ubatch": self.prefill_step if self.spec.prefill_chunk != "auto" else self.opts.n_ubatch,
            "kv_cache_type": self.spec.kv_cache_dtype if self.spec.kv_cache_dtype != "auto" else "f16",
            "flash_attn": self.opts.flash_attn,
            "chat_template": self.chat_template_kind,
            "chat_template_sha256": template_sha256(self._template_raw),
            "model_file": str(self.model_path),
            "model_sha256": self.model_sha256,
        }

    def in_force(self) -> dict[str, Any]:
        return dict(self._offload)

    def close(self) -> None:
        ll = self._ll
        if self._probe_ctx is not None:
            ll.llama_free(self._probe_ctx)
            self._probe_ctx = None
        self._drop_contexts()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


ENGINE = LlamaCppEngine
