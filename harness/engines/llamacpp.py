"""llama.cpp in-process, decoding N sequences together the way llama-server's slots do.

One context with n_seq_max = N; the target prompt and its N-1 fillers are prefilled
together and then advanced with one llama_decode per step for all live sequences.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import math
import os
import re
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from harness.core import native_preload
from harness.engines.base import (
    HONOUR,
    AutoOnOff,
    BatchOutput,
    Engine,
    EngineOptions,
    Finding,
    LoadSpec,
    Log,
    Refuse,
    Sampling,
    SequenceOutput,
    StepObserver,
    Unsupported,
    template_sha256,
)
from harness.engines.parts import cpu_kernels
from harness.engines.parts.chat_template import ChatTemplate
from harness.engines.parts.child_probe import probe_in_child
from harness.engines.parts.llama_offload import gpu_layers, offload_state
from harness.models import catalog as models

INSTALL_CUDA = ('CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF" pip install --force-reinstall --no-cache-dir '
                '--no-deps llama-cpp-python')
_PROBE = """
import json, llama_cpp as ll
from importlib import metadata
info = ll.llama_print_system_info().decode(errors="replace")
print(json.dumps({"version": metadata.version("llama-cpp-python"), "gpu_offload": bool(ll.llama_supports_gpu_offload()),
                  "system_info": info.strip()}))
"""


def backends(system_info: str) -> list[str]:
    """The ggml backends named in llama.cpp's system info ('CUDA : ARCHS = 900 | CPU : AVX2 = 1 | ...')."""
    return list(dict.fromkeys(re.findall(r"(?:^|\|\s*)([A-Za-z][A-Za-z0-9_]*) : ", system_info)))

class LlamaCppOptions(EngineOptions):
    added_later = ("extra_bufts",)
    n_gpu_layers: int | None = Field(
        None, ge=-1, description="layers offloaded to a GPU; -1 = all; default: all, or none for gpu: cpu")
    n_threads: int | None = Field(None, ge=1, description="decode threads; default: all cores")
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


def _step_stats(logits: np.ndarray, token: int, scratch: np.ndarray) -> tuple[float, float]:
    """The chosen token's log-probability and the top-1 minus top-2 logit margin.

    Two max passes and one exp into a reused buffer: cheaper than a sort or a partition.
    """
    best = int(logits.argmax())
    top = float(logits[best])
    second = max(float(logits[:best].max(initial=-np.inf)), float(logits[best + 1 :].max(initial=-np.inf)))
    np.subtract(logits, top, out=scratch)
    np.exp(scratch, out=scratch)
    return float(logits[token]) - top - math.log(float(scratch.sum())), top - second


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


class LlamaCppEngine(Engine):
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
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        facts = probe_in_child(_PROBE, timeout_s=60, preload=cls.native_package)
        if "system_info" in facts:
            facts["backends"] = backends(facts["system_info"])
        return facts

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        offload = "GPU offload compiled in" if facts["gpu_offload"] else "CPU only (no GPU offload compiled in)"
        return f"llama-cpp-python {facts['version']}, {offload}; backends {', '.join(facts['backends'])}"

    @classmethod
    def crash_hint(cls, spec: LoadSpec, signal_name: str, before: str = "") -> str:
        """For a build with a GPU backend: the backend, what was in the process before the engine and
        the preload, with the preload's fix where it was not in force; the CPU's kernels and the
        extra-buffer advice only for cells whose layers the CPU computes."""
        gpu_build = native_preload.backends(cls.native_package)
        on_gpu = bool(gpu_build) and gpu_layers(spec.gpu, spec.options.get("n_gpu_layers")) != 0
        natives, preload = native_preload.split_before(before)
        said = ["llama.cpp died in native code"]
        if gpu_build:
            said += [f"this build has a GPU backend ({', '.join(gpu_build)}) and the cell's layers were meant for the "
                     + ("GPU" if on_gpu else "CPU (gpu: cpu or n_gpu_layers: 0)"),
                     f"native libraries in the process before the engine: {natives or 'not recorded in the log'}",
                     f"native preload {preload or 'not recorded'}"]
            if not preload.startswith("on"):
                said.append(f"a GPU build can crash so where numpy or pyarrow loaded first (a stock CUDA + PyTorch "
                            f"image): leave {native_preload.SWITCH} unset (auto starts engine processes with the "
                            "GPU backend preloaded); see docs/gpu-nodes.md")
            elif on_gpu:
                said.append("the backend was preloaded and it still died: run 'harness doctor FILE', set "
                            "engine_options.llamacpp.verbose: true to keep llama.cpp's last words in the group's "
                            "log, and check that the build's CUDA architectures include this GPU's "
                            "(docs/gpu-nodes.md)")
        if not on_gpu:
            facts = probe_in_child(_PROBE, timeout_s=60, preload=cls.native_package)
            features = " ".join(cpu_kernels.build_features(facts.get("system_info", ""))) or "unknown"
            chosen = spec.options.get("extra_bufts", "auto")
            tries = ("engine_options.llamacpp.extra_bufts: off (no AMX or repacked kernels)" if chosen != "off" else
                     "a llama-cpp-python built for a plainer CPU (CMAKE_ARGS=\"-DGGML_NATIVE=OFF\")")
            said.append(f"this build uses CPU features {features} (extra_bufts {chosen}); try {tries}")
        return "; ".join(said)

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        found = []
        named_gpu = any(c["gpu"] not in ("any", "cpu") for c in cells)
        if wants_gpu and not facts["gpu_offload"]:
            found.append(Finding(cls.name, "this llama-cpp-python has no GPU offload compiled in: its cells "
                                 + ("that name a GPU type will fail (they would run on the CPU)" if named_gpu
                                    else "would run on the CPU"), False, INSTALL_CUDA))
        if options.get("n_gpu_layers") == 0 and named_gpu:
            found.append(Finding(cls.name, "n_gpu_layers: 0 keeps every layer on the CPU, yet cells name a GPU type: "
                                 "they will fail", False, "drop n_gpu_layers (default: all layers on the GPU) or use "
                                 "gpu: cpu"))
        if any(c["dtype"] != "auto" for c in cells) and importlib.util.find_spec("gguf") is None:
            found.append(Finding(cls.name, "dtype f16/bf16/f32 copies need the gguf package", False, models.INSTALL_GGUF))
        return found

    @classmethod
    def kernel_choice(cls, option: str, model: Path, model_sha256: str, system_info: str, threads: int,
                      log: Log) -> tuple[cpu_kernels.Choice, cpu_kernels.Probe, str]:
        """The extra-buffer choice for a load of `model` (what a run and doctor both ask), with the
        probe behind it and the key its answers are kept under (host, this build, the model file)."""
        probe = cpu_kernels.probe_child(model, threads)
        # the GPUs the process may see are part of the key: the same build answers for another device set
        key = cpu_kernels.cache_key("llama-cpp-python", metadata.version("llama-cpp-python"), system_info, model_sha256,
                                    os.environ.get("CUDA_VISIBLE_DEVICES", "<all>"))
        amx = cpu_kernels.has_amx(system_info) or cpu_kernels.cpu_reports_amx()
        return cpu_kernels.choose(option, amx, probe, models.cache_dir(), key, log), probe, key

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
        self.n_threads = self.opts.n_threads or os.cpu_count() or 1
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
        self._batch = None
        self._batch_cap = 0

    # -- text <-> tokens ------------------------------------------------------------
    def chat(self, text: str) -> str:
        """The model's own Jinja chat template; llama.cpp's built-in matcher if that fails."""
        if self._jinja is not None:
            try:
                return self._jinja.render(text)
            except ValueError:
                self.chat_template_kind = "llama.cpp built-in"
        if self._template_raw is None:
            return text
        ll = self._ll
        msg = (ll.llama_chat_message * 1)()
        msg[0].role = b"user"
        msg[0].content = text.encode()
        size = 4 * len(text) + 4096
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(self._template_raw, msg, 1, True, buf, size)
        return buf.raw[:n].decode("utf-8", errors="replace") if 0 <= n <= size else text

    def prompt_tokens(self, text: str) -> list[int]:
        """Chat-formatted, tokenized prompt; cached, since every prompt is run many times."""
        tokens = self._prompt_cache.get(text)
        if tokens is None:
            tokens = self._prompt_cache[text] = self.tokenize(self.chat(text))
        return tokens

    def _special(self, getter: Any) -> str:
        tok = getter(self._vocab)
        return self.detokenize_special([tok]) if tok >= 0 else ""

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        ll = self._ll
        data = text.encode()
        cap = len(data) + 16
        out = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), out, cap, special, special)
        if n < 0:
            cap = -n
            out = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), out, cap, special, special)
        return list(out[:n])

    def detokenize(self, tokens: list[int]) -> str:
        return self._pieces(tokens, special=False)

    def detokenize_special(self, tokens: list[int]) -> str:
        return self._pieces(tokens, special=True)

    def _pieces(self, tokens: list[int], special: bool) -> str:
        ll = self._ll
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for tok in tokens:
            n = ll.llama_token_to_piece(self._vocab, tok, buf, 256, 0, special)
            pieces.append(buf.raw[: max(n, 0)])
        return b"".join(pieces).decode("utf-8", errors="replace")

    # -- contexts and batches ---------------------------------------------------------
    def _context(self, n_seq: int, per_seq: int) -> Any:
        key = (n_seq, per_seq)
        ctx = self._contexts.get(key)
        if ctx is not None:
            return ctx
        for old in self._contexts.values():  # one live context at a time keeps memory flat
            self._ll.llama_free(old)
        self._contexts.clear()
        ll = self._ll
        params = ll.llama_context_default_params()
        params.n_ctx = n_seq * per_seq
        params.n_seq_max = n_seq
        self._set_params(params, max(self.prefill_step, n_seq))
        ctx = ll.llama_init_from_model(self._model, params)
        if not ctx:
            self._refuse_kv()
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences x {per_seq} tokens")
        self._contexts[key] = ctx
        return ctx

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

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text, special=False))

    def prefill_logits(self, prompt: str, steps: list[int]) -> np.ndarray:
        """Logits of every generation step from one prefill of prompt + the generated tokens.

        `steps` are the tokens chosen at each decode step; row i holds the logits that chose
        steps[i], computed with all positions in one llama_decode call (a context of its own).
        """
        ll = self._ll
        prompt_ids = self.prompt_tokens(prompt)
        seq = prompt_ids + steps[:-1]
        size = -(-len(seq) // 256) * 256 + 256
        if self._probe_ctx is None or self._probe_ctx_size < size:
            if self._probe_ctx is not None:
                ll.llama_free(self._probe_ctx)
            params = ll.llama_context_default_params()
            params.n_ctx = size
            params.n_seq_max = 1
            self._set_params(params, size)
            if self.spec.prefill_chunk == "auto":
                params.n_ubatch = size  # one pass
            self._probe_ctx = ll.llama_init_from_model(self._model, params)
            self._probe_ctx_size = size
            if not self._probe_ctx:
                raise RuntimeError(f"llama.cpp could not create a prefill-probe context of {size} tokens")
        ctx = self._probe_ctx
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        batch = ll.llama_batch_init(len(seq), 0, 1)
        try:
            first = len(prompt_ids) - 1
            for i, tok in enumerate(seq):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i >= first
            batch.n_tokens = len(seq)
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} in the prefill probe")
            return np.stack([
                np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)).copy()
                for i in range(first, len(seq))
            ])
        finally:
            ll.llama_batch_free(batch)

    def score(self, prompt: str, tokens: list[int]) -> list[float]:
        """Each token's log-probability (log-softmax of the raw logits, as decode records it) from
        one prefill of prompt + tokens in a context of its own."""
        if not tokens:
            return []
        logits = self.prefill_logits(prompt, list(tokens)).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        norm = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        return (logits[np.arange(len(tokens)), tokens] - norm).tolist()

    def _ensure_batch(self, size: int) -> Any:
        if size > self._batch_cap:
            if self._batch is not None:
                self._ll.llama_batch_free(self._batch)
            self._batch = self._ll.llama_batch_init(size, 0, 1)
            self._batch_cap = size
        return self._batch

    def _per_seq(self, tokens: list[list[int]], max_tokens: int) -> int:
        """Context per sequence: the option, or the longest prompt + max_tokens rounded up."""
        need = max(len(t) for t in tokens) + max_tokens + 1
        per_seq = self.opts.n_ctx or max(512, -(-need // 256) * 256)
        if need > per_seq:
            raise RuntimeError(f"prompt + max_tokens = {need} tokens exceeds n_ctx {per_seq}")
        return per_seq

    def warm_up(self, prompts: list[str], target: int, sampling: Sampling) -> None:
        """This batch shape's one-time costs without a full prefill: the prompts templated and
        tokenized (cached), the context for n sequences that generate will use, and a first
        llama_decode of n sequences together (one token each, which starts the thread pool)."""
        ll = self._ll
        tokens = [self.prompt_tokens(p) for p in prompts]
        ctx = self._context(len(prompts), self._per_seq(tokens, sampling.max_tokens))
        memory = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(memory, True)
        batch = self._ensure_batch(max(self.prefill_step, len(prompts)))
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t[0], 0, 1
            batch.seq_id[i][0], batch.logits[i] = i, True
        batch.n_tokens = len(tokens)
        rc = ll.llama_decode(ctx, batch)
        ll.llama_memory_clear(memory, True)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _samplers(self, n: int, target: int, sampling: Sampling) -> list[Any]:
        """One llama.cpp sampler chain per sequence (None = greedy argmax), seeded per request.

        The target gets the cell's seed wherever it sits; fillers get seeds derived from it.
        """
        if sampling.temperature == 0:
            return [None] * n
        ll = self._ll
        chains = []
        for i in range(n):
            chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            if sampling.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(sampling.top_k))
            if sampling.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(sampling.top_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(sampling.temperature))
            seed = sampling.seed_for(i, target)  # None: an unseeded filler, llama.cpp draws a random seed
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(ll.LLAMA_DEFAULT_SEED if seed is None else seed))
            chains.append(chain)
        return chains

    # -- generation ---------------------------------------------------------------
    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False, force: list[int] | None = None,
    ) -> BatchOutput:
        """`force`: the target's tokens, fed in place of its own picks (a recorded output replayed
        through this decode loop); its statistics are then of the forced tokens, and `argmax` says
        what it would have picked at each step. The batch-mates decode as usual."""
        ll = self._ll
        n = len(prompts)
        tokens = [self.prompt_tokens(p) for p in prompts]
        ctx = self._context(n, self._per_seq(tokens, sampling.max_tokens))
        memory = ll.llama_get_memory(ctx)
        ll.llama_memory_clear(memory, True)
        batch = self._ensure_batch(max(self.prefill_step, n))
        samplers = self._samplers(n, target, sampling)
        vocab = self._vocab
        n_vocab = self.n_vocab
        ignore_eos = self.opts.ignore_eos
        scratch = np.empty(n_vocab, dtype=np.float32)

        outs: list[list[int]] = [[] for _ in range(n)]
        # per-step statistics of the target (and, with members, of every sequence)
        logprobs: list[list[float]] = [[] for _ in range(n)]
        margins: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        live = [True] * n
        argmax: list[int] = []  # forced decoding: the target's own pick at each step
        pos = [len(t) for t in tokens]
        generated = 0

        def pick(seq: int, idx: int) -> None:
            nonlocal generated
            if force is not None and seq == target:
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
                argmax.append(int(logits.argmax()))
                tok = int(force[len(outs[seq])])
                lp, margin = _step_stats(logits, tok, scratch)
                logprobs[seq].append(lp)
                margins[seq].append(margin)
                generated += 1
                outs[seq].append(tok)
                if len(outs[seq]) >= len(force):
                    live[seq] = False
                return
            if samplers[seq] is None:
                ptr = ll.llama_get_logits_ith(ctx, idx)
                logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
                tok = int(logits.argmax())
            else:
                tok = int(ll.llama_sampler_sample(samplers[seq], ctx, idx))
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))
            if seq == target or members:
                if observe is not None and seq == target:
                    observe(len(logprobs[seq]), logits, tok)
                lp, margin = _step_stats(logits, tok, scratch)
                logprobs[seq].append(lp)
                margins[seq].append(margin)
            generated += 1
            if not ignore_eos and ll.llama_vocab_is_eog(vocab, tok):
                finish[seq], live[seq] = "stop", False
                return
            outs[seq].append(tok)
            if len(outs[seq]) >= sampling.max_tokens:
                live[seq] = False

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:
            for i, (tok, p, seq, want) in enumerate(entries):
                batch.token[i] = tok
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
            batch.n_tokens = len(entries)
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

        reused = 0
        if cache == "warm":
            # The target prompt served just before on the target's sequence: its KV, all but the
            # last token (whose logits the batch needs), is kept and reused, as llama-server does.
            lone = [(tok, p, target, False) for p, tok in enumerate(tokens[target])]
            for start in range(0, len(lone), self.prefill_step):
                decode(lone[start : start + self.prefill_step])
            reused = len(tokens[target]) - 1
            ll.llama_memory_seq_rm(memory, target, reused, -1)
        try:
            t0 = time.perf_counter()
            # Prefill: all prompts together, split into prefill-step-sized calls like llama-server.
            flat = [(tok, p, s, p == len(t) - 1) for s, t in enumerate(tokens) for p, tok in enumerate(t)
                    if s != target or p >= reused]
            for start in range(0, len(flat), self.prefill_step):
                chunk = flat[start : start + self.prefill_step]
                decode(chunk)
                for i, (_, _, seq, last) in enumerate(chunk):
                    if last:
                        pick(seq, i)
            t_prefill = time.perf_counter()
            t_target = t_prefill
            # when each output token of the target was in hand (an end-of-generation pick is no token)
            arrivals = [t_prefill - t0] if outs[target] else []
            while live[target] or (members and any(live)):
                order = [s for s in range(n) if live[s]]
                had = len(outs[target])
                decode([(outs[s][-1], pos[s] + len(outs[s]) - 1, s, True) for s in order])
                for i, seq in enumerate(order):
                    pick(seq, i)
                if target in order:  # the target's time ends with its last step
                    t_target = time.perf_counter()
                    if len(outs[target]) > had:
                        arrivals.append(t_target - t0)
            t_end = time.perf_counter()
        finally:
            for chain in samplers:
                if chain is not None:
                    ll.llama_sampler_free(chain)

        def output(seq: int) -> SequenceOutput:
            ids = outs[seq]
            return SequenceOutput(ids, self.detokenize(ids), finish[seq], logprobs[seq], margins[seq],
                                  [self.detokenize([t]) for t in ids], argmax if seq == target else [])

        every = [output(s) for s in range(n)] if members else []
        return BatchOutput(
            target=every[target] if members else output(target),
            prompt_tokens=len(tokens[target]),
            prefill_s=t_prefill - t0,
            ttft_s=t_prefill - t0,
            target_s=t_target - t0,
            wall_s=t_end - t0,
            batch_generated_tokens=generated,
            cached_tokens=reused,
            members=every,
            token_times=arrivals,
        )

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
        for ctx in self._contexts.values():
            ll.llama_free(ctx)
        self._contexts.clear()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


ENGINE = LlamaCppEngine
