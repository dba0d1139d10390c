"""Which vLLM fits a node's torch: vLLM pins torch exactly, one version per release, so an image
that brings its own torch can take only the releases that pin it. The table is read from the
releases' own package metadata by scripts/vllm_torch_pins.py (vllm_torch_pins.json beside this
file), never typed by hand (a part of harness.engines.vllm's doctor)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("vllm_torch_pins.json")


@cache
def table() -> dict[str, dict[str, dict[str, str]]]:
    """package -> release -> {'torch': pin, 'torchvision': ..., 'torchaudio': ...}."""
    return json.loads(TABLE.read_text())["releases"]


#: PINNED packages' names, as a requirement names them
PINNED = ("torch", "torchvision", "torchaudio")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*\(?([^;)]*)\)?")


def requirement_pin(requirement: str) -> tuple[str, str] | None:
    """('torch', '2.11.0') from 'torch==2.11.0; extra == ...' (a range is kept as written, no range is
    ''); None for a package other than PINNED."""
    found = _REQUIREMENT.match(requirement)
    if not found or found.group(1).lower() not in PINNED:
        return None
    spec = found.group(2).strip()
    return found.group(1).lower(), spec[2:] if spec.startswith("==") and "," not in spec else spec


def _base(version: str) -> str:
    return version.split("+")[0]


def pins_it(pin: str, torch_version: str) -> bool:
    """Whether an exact pin admits this torch: '2.11.0' admits 2.11.0+cu130 (a local label is the
    build, PEP 440 ignores it against a pin without one); '2.11.0+cpu' admits only that build."""
    if not pin:
        return True
    return pin == torch_version if "+" in pin else pin == _base(torch_version)


def releases_for(torch_version: str, package: str = "vllm") -> list[str]:
    """The releases of `package` whose torch pin this torch satisfies, oldest first."""
    return [v for v, p in table().get(package, {}).items() if "torch" in p and pins_it(p["torch"], torch_version)]


def install_advice(torch_version: str, package: str = "vllm") -> str:
    """What to install on a node with this torch, keeping it: the newest release that pins it, with the
    node's torch held by a constraint (or --no-deps plus what the release needs)."""
    fits = releases_for(torch_version, package)
    if not fits:
        known = sorted({p.get("torch", "?") for p in table().get(package, {}).values()})
        return (f"no {package} release from {min(table().get(package, {'?': 0}))} on pins torch {torch_version} "
                f"(they pin {', '.join(known)}): install the torch one of them pins, or use another environment")
    newest = fits[-1]
    return (f"{package} {', '.join(fits)} pin{'s' if len(fits) == 1 else ''} this torch ({torch_version}); keep it with "
            f"`echo torch=={_base(torch_version)} > keep-torch.txt && pip install {package}=={newest} -c keep-torch.txt`"
            f", or `pip install --no-deps {package}=={newest}` plus the requirements the node lacks")


def mismatch(facts: dict[str, Any]) -> str | None:
    """Why the installed vLLM cannot run on the installed torch (its own metadata's pin against the
    torch found), None where they agree or a side is unknown."""
    pin, torch_version = facts.get("torch_pin"), facts.get("torch")
    if not pin or not torch_version or pins_it(pin, torch_version):
        return None
    return (f"{facts.get('distribution', 'vllm')} {facts.get('version', '')} pins torch=={pin}, and torch here is "
            f"{torch_version}: it will not load, or not as released. "
            f"{install_advice(torch_version, facts.get('distribution', 'vllm'))}")
