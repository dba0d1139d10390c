"""How many CPUs this process may use: a cluster job given 4 of a node's 64 cores must run 4 threads,
not 64 (`os.cpu_count()` is the node's). The smallest of the CPU affinity mask, the cgroup's CPU quota
(v2 `cpu.max`, v1 `cpu.cfs_quota_us`) and SLURM's `SLURM_CPUS_PER_TASK` where set; never below 1."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: where the cgroup file system is mounted (a parameter for tests, which give a folder of their own)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _own_cgroup(root: Path) -> list[Path]:
    """The folders of this process's cgroups (v2's one path, v1's cpu controller), deepest first, then
    their parents: a quota set on a parent limits the child too."""
    found: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" or "cpu" in controllers.split(","):
            base = root if controllers == "" else root / ("cpu,cpuacct" if (root / "cpu,cpuacct").is_dir() else "cpu")
            here = base / path.lstrip("/")
            while True:
                found.append(here)
                if here == base:
                    break
                here = here.parent
    return found + [root]


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs' worth of time the cgroup allows (quota / period), the smallest along the path; None
    where no quota is set or none can be read."""
    limits = []
    for folder in _own_cgroup(root):
        try:
            text = (folder / "cpu.max").read_text().split()
            if text and text[0] != "max":
                limits.append(int(text[0]) / int(text[1]))
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
            if quota > 0 and period > 0:
                limits.append(quota / period)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def usable_cpus(environ: dict[str, str] | None = None, root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may run threads on (see the module's doc)."""
    environ = os.environ if environ is None else environ
    counts = [_affinity()]
    quota = cgroup_quota(root)
    if quota is not None:
        counts.append(max(1, math.ceil(quota - 1e-9)))
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        counts.append(int(slurm))
    return max(1, min(counts))


def fewer_than_node() -> int | None:
    """usable_cpus() where it is below the node's count, None where the whole node may be used: what to
    pass to an engine whose own default counts the node's cores (llama-server's -t, torch's threads)."""
    usable = usable_cpus()
    return usable if usable < (os.cpu_count() or usable) else None
