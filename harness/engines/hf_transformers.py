"""Hugging Face transformers on torch, the reference implementation, as an engine: padded batches
(the shape of `generate`) or transformers' own continuous batching, on a CUDA GPU or the CPU.

It needs nothing but torch and transformers, which every stock GPU image holds, so a node measures
the minute the harness is installed. This file is the load (options, model, what ran); its parts are
in engines/parts/: hf_padded.py (the padded decode loop) and hf_continuous.py (a batch through
transformers' continuous-batching manager).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from harness.core.cpus import usable_cpus
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
    Unsupported,
    template_sha256,
)
from harness.engines.parts.hf_continuous import CONTINUOUS_FLOOR, HfContinuous
from harness.engines.parts.hf_padded import HfPadded
from harness.engines.parts.hf_trace import HfTrace
from harness.models import catalog as models

#: dtype axis -> torch dtype name ('auto': the checkpoint's own)
_DTYPES = {"auto": "auto", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}
#: cuBLAS's workspace setting that torch's deterministic algorithms require on CUDA (torch's docs)
_CUBLAS_DETERMINISTIC = ":4096:8"


class TransformersOptions(EngineOptions):
    batching: Literal["padded", "continuous"] = Field(
        "padded", description="padded: the batch left-padded into one tensor, one forward pass per step (the shape "
                              "of generate); continuous: the requests submitted together to transformers' "
                              "continuous-batching manager (paged KV cache, its own scheduler; greedy only)")
    attn_implementation: str | None = Field(
        None, description="eager, sdpa, flash_attention_2, paged|sdpa, ... (what the installed transformers "
                          "offers); default: transformers' choice. The one in effect is recorded")
    tf32: AutoOnOff = Field("auto", description="TF32 for float32 matrix products and convolutions on a GPU: on, "
                                                "off, or auto (torch's setting as found); the state in force is recorded")
    deterministic_algorithms: bool = Field(
        False, description="torch.use_deterministic_algorithms(True), with CUBLAS_WORKSPACE_CONFIG=:4096:8")
    n_threads: int | None = Field(None, ge=1, description="torch's CPU threads; default: torch's")
    ignore_eos: bool = False
    trust_remote_code: bool = False


_NO_CACHE_REUSE = "the transformers engine keeps no KV between requests"
_NO_LOGITS = "batching continuous: transformers' manager hands out no logits (batching padded has the probe)"


class TransformersEngine(HfPadded, HfContinuous, HfTrace, Engine):
    name = "transformers"
    Options = TransformersOptions
    logit_probe_unavailable = None  # padded batching only (the continuous manager hands out no logits)
    axes = {
        "model": HONOUR,
        "engine": HONOUR,
        "dtype": HONOUR,
        "gpu": HONOUR,
        "batch_invariant": Refuse("transformers has no batch-invariant mode (vLLM's batch_invariant kernels are "
                                  "vLLM's own)"),
        "batch_size": HONOUR,
        "seed": HONOUR,
        "temperature": HONOUR,
        "top_p": HONOUR,
        "top_k": HONOUR,
        "prefix_cache": Refuse(_NO_CACHE_REUSE),
        "context_tokens": HONOUR,
        "prefill_chunk": Refuse("the padded loop prefills each batch in one forward pass; its continuous "
                                "manager chunks by its own rules"),
        "kv_cache_dtype": Refuse("the KV cache is the model's dtype here"),
        "kv_cache_tokens": Refuse("the padded loop keeps every sequence's KV to the end and preempts nothing; "
                                  "preemption is measured on vLLM"),
        "draft_tokens": Refuse("speculative decoding is not run through this engine"),
        "filler_tokens": HONOUR,
        "environment": HONOUR,  # the worker's interpreter: any engine runs in another venv
    }
    rehearsed = True
    install = 'pip install -e ".[transformers]"   (on a GPU image torch and transformers are already there)'

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        if spec.dtype not in _DTYPES:
            return f"the transformers engine cannot use dtype '{spec.dtype}'; allowed: {', '.join(_DTYPES)}"
        return None

    @classmethod
    def environment(cls, spec: LoadSpec) -> dict[str, str]:
        if spec.options.get("deterministic_algorithms"):
            return {"CUBLAS_WORKSPACE_CONFIG": _CUBLAS_DETERMINISTIC}
        return {}

    @classmethod
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        from harness.engines.parts.child_probe import probe_in_child

        return probe_in_child(_PROBE, timeout_s=120)

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        where = f"CUDA {facts.get('cuda')} on {facts.get('device')}" if facts.get("device") else "no CUDA device (CPU)"
        gap = facts.get("continuous_gap", "" if facts.get("continuous") else "not in this transformers")
        return (f"transformers {facts.get('transformers')}, torch {facts.get('torch')}, {where}; continuous batching "
                f"{gap or 'available'}")

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        """A continuous-batching cell where this transformers has none (GPU types not here are doctor's own
        finding: their cells are skipped on this machine)."""
        found = []
        batchings = {c.get(f"{cls.name}.batching") or options.get("batching", "padded") for c in cells}
        gap = facts.get("continuous_gap", "" if facts.get("continuous") else "no continuous batching")
        if "continuous" in batchings and gap:
            found.append(Finding(cls.name, f"continuous batching: {gap}: those cells will be unsupported", False,
                                 f"pip install 'transformers>={CONTINUOUS_FLOOR}'"))
        return found

    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        import torch
        import transformers

        self.torch, self.spec, self._transformers = torch, spec, transformers
        self.opts = TransformersOptions.model_validate(spec.options)
        self.device = self._device(torch, spec.gpu)
        usable = usable_cpus()  # torch's default counts the node's cores, not the job's
        if self.opts.n_threads or usable < torch.get_num_threads():
            torch.set_num_threads(self.opts.n_threads or usable)
        if self.opts.tf32 != "auto":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.opts.tf32 == "on"
        if self.opts.deterministic_algorithms:
            torch.use_deterministic_algorithms(True)
        self.model_path, self.model_sha256 = models.hf_model(spec.model, base, log)
        # a hub id is read from the hub cache only: a run never downloads weights mid-matrix
        where = {"trust_remote_code": self.opts.trust_remote_code,
                 **({} if Path(self.model_path).is_dir() else {"local_files_only": True})}
        kwargs: dict[str, Any] = {**where, "dtype": "auto" if spec.dtype == "auto" else getattr(torch, _DTYPES[spec.dtype])}
        if self.opts.attn_implementation:
            kwargs["attn_implementation"] = self.opts.attn_implementation
        log(f"loading {self.model_path} with transformers {transformers.__version__} on {self.device} "
            f"({spec.dtype}, {self.opts.batching} batching)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs).to(self.device).eval()
        except (ValueError, ImportError) as exc:  # an attention implementation or dtype this install lacks
            if self.opts.attn_implementation and any(w in str(exc).lower() for w in ("attention", "attn")):
                raise Unsupported(f"attn_implementation {self.opts.attn_implementation}: {exc}") from exc
            raise
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **where)
        self._forward_arguments()
        self._eos = self._end_ids()
        self.pad_id = self._pad_id()
        self._prompt_cache: dict[str, list[int]] = {}
        if self.opts.batching == "continuous":
            self.logit_probe_unavailable = _NO_LOGITS
            self._open_continuous()

    @staticmethod
    def _device(torch: Any, gpu: str) -> Any:
        """The CPU for gpu: cpu (and for any on a node without CUDA); else the first visible CUDA device,
        which the worker's CUDA_VISIBLE_DEVICES has narrowed to the cell's GPU type."""
        if gpu == "cpu":
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if gpu == "any":
            return torch.device("cpu")
        raise RuntimeError(f"asked gpu {gpu}; torch {torch.__version__} sees no CUDA device here "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")

    def _end_ids(self) -> set[int]:
        """The end-of-generation set: the tokenizer's EOS and the generation config's stop ids, as vLLM
        reads them from the same folder (so the two engines stop on the same tokens)."""
        ends = {t for t in [getattr(self.tokenizer, "eos_token_id", None)] if t is not None}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if configured is not None:
            ends |= set(configured) if isinstance(configured, (list, tuple)) else {configured}
        return {int(t) for t in ends}

    def _pad_id(self) -> int:
        """The id fed to padding positions (masked out) and to finished rows: the tokenizer's pad, else an
        end-of-generation id, as generate does."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.generation_config, "pad_token_id", None)
        return int(pad if pad is not None else min(self._eos, default=0))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, text: str) -> list[int]:
        """The model's chat template applied to one user message, then tokenized, as the vLLM engine
        does with the same folder; cached."""
        ids = self._prompt_cache.get(text)
        if ids is None:
            chat = text
            if getattr(self.tokenizer, "chat_template", None):
                chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True, tokenize=False)
            ids = self._prompt_cache[text] = list(self.tokenizer.encode(chat, add_special_tokens=False))
        return ids

    def decode_tokens(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: StepObserver | None = None,
        cache: str = "off", members: bool = False,
    ) -> BatchOutput:
        if cache != "off":
            raise Unsupported(f"prefix_cache {cache}: {_NO_CACHE_REUSE}")
        if self.opts.batching == "continuous":
            return self._continuous(prompts, target, sampling, observe, members)
        return self._padded(prompts, target, sampling, observe, members)

    def warm_up(self, prompts: list[str], target: int, sampling: Sampling) -> None:
        """The batch itself, two tokens long: the first forward of a shape (kernel choice, allocator,
        the continuous manager's start) is not in any row's timing."""
        from dataclasses import replace

        self.generate(prompts, target, replace(sampling, max_tokens=2, temperature=0.0))

    def probe_scope(self) -> str:
        return "full float32 logit vectors (padded batching)"

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        cuda = self.device.type == "cuda"
        return {
            "engine_version": f"transformers {self._transformers.__version__}",
            "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda,
            "cudnn_version": torch.backends.cudnn.version() if cuda else None,
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "batching": self.opts.batching,
            "attn_implementation": self._attention(),
            "dtype_in_force": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
            "n_threads": torch.get_num_threads(),
            "end_ids": sorted(self._eos),
            "chat_template_sha256": template_sha256(getattr(self.tokenizer, "chat_template", None)),
            "model_file": self.model_path,
            "model_sha256": self.model_sha256,
        }

    def _attention(self) -> str:
        """The attention implementation the loaded model runs with, read back from its config."""
        config = self.model.config
        return str(getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", "unknown"))

    def in_force(self) -> dict[str, Any]:
        on = next(self.model.parameters()).device
        return {
            "device_kind": "gpu" if on.type == "cuda" else "cpu",
            "device_note": f"the model's weights are on {on}",
            "backend": on.type,
            "attention_backend": self._attention(),
        }

    def close(self) -> None:
        self._close_continuous()
        model = getattr(self, "model", None)
        if model is not None:
            self.model = None
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()


_PROBE = """
import json
import torch, transformers
from harness.engines.parts.hf_continuous import continuous_gap
gap = continuous_gap(transformers)
out = {"transformers": transformers.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
       "continuous": gap is None, "continuous_gap": gap or ""}
if torch.cuda.is_available():
    out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out))
"""


ENGINE = TransformersEngine
