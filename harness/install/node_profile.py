"""What a node's Python is and holds: the facts a wheel folder is built for. Standard library only and
free of the harness's imports, so the file can be copied to a node that has nothing else and run there:

    python3 node_profile.py > node.json

(`harness wheels --node node.json` reads it). Distributions are read from the interpreter's own
metadata (what `pip freeze` lists, editable and unpinned ones included by name and version).
"""

from __future__ import annotations

import json
import platform
import sys
import sysconfig
from importlib import metadata


def _libc() -> list[int]:
    """glibc's version as [major, minor] ([] on a libc without one, e.g. musl): manylinux tags follow it."""
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return []
    return [int(part) for part in version.split(".")[:2]]


def _distributions() -> dict[str, str]:
    """Normalized name -> version of every distribution this interpreter can import."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            found.setdefault(normalized(name), dist.version)  # the first on sys.path is the one imported
    return dict(sorted(found.items()))


def normalized(name: str) -> str:
    """A project name as package indexes compare it (PEP 503)."""
    out = "".join("-" if ch in "_." else ch for ch in name.lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out


def profile() -> dict[str, object]:
    """This interpreter's profile: version, implementation, ABI, platform, glibc and distributions."""
    return {
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "python_full": platform.python_version(),
        "implementation": sys.implementation.name,
        "abi": f"cp{sys.version_info.major}{sys.version_info.minor}",
        "free_threaded": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "machine": platform.machine(),
        "system": platform.system().lower(),
        "glibc": _libc(),
        "executable": sys.executable,
        "distributions": _distributions(),
    }


if __name__ == "__main__":
    json.dump(profile(), sys.stdout, indent=1)
    sys.stdout.write("\n")
