"""`harness doctor`: what will really run on this machine, found before any GPU hour is spent.

Each engine is probed by its own class (`Engine.probe`: a library that may crash is asked in a child
process, with a time limit, so it cannot take the doctor down) and says what an experiment's cells
need of it (`Engine.needs`). With an
experiment, every piece it needs is checked, and each missing one comes with how to get it.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness.core import gpu_names
from harness.engines.base import Finding, LoadSpec
from harness.engines.registry import engine_class, engine_names
from harness.experiment.matrix import Cell, expand, refused_setting
from harness.experiment.schema import LoadedExperiment
from harness.models import catalog as models
from harness.results import provenance


@dataclass
class Report:
    facts: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def missing(self) -> list[Finding]:
        return [f for f in self.findings if f.ok is False]

    def as_data(self) -> dict[str, Any]:
        """The report as plain data: what --format json prints and what the views read."""
        return {"facts": self.facts, "findings": [asdict(f) for f in self.findings], "ok": not self.missing}

    def as_json(self) -> str:
        return json.dumps(self.as_data(), indent=1, default=str)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def collect(engines: tuple[str, ...] | None = None, options: dict[str, dict[str, Any]] | None = None) -> Report:
    """Facts about this machine, for the engines named (default: every engine), each probed by its
    own class with its experiment options."""
    report = Report()
    gpus = provenance.detect_gpus()
    cache = models.cache_dir()
    report.facts = {
        "python": platform.python_version(),
        "harness": harness.__version__,
        "gpus": gpus,
        "cuda_version": provenance.cuda_version(),
        "schedulers": {tool: shutil.which(tool) or "" for tool in ("sbatch", "qsub")},
        "cache": {"path": str(cache), "bytes": _size(cache)},
        "engines": {},
    }
    for engine in engines if engines is not None else engine_names():
        report.facts["engines"][engine] = engine_class(engine).probe((options or {}).get(engine, {}))
    gpu_text = "; ".join(f"{g.get('name')} ({g.get('memory.total', '?')}, compute capability "
                         f"{g.get('compute_cap', '?')}, driver {g.get('driver_version', '?')})" for g in gpus)
    report.findings.append(Finding("GPU", gpu_text + (f"; CUDA {report.facts['cuda_version']}" if gpus else "")
                                   if gpus else "no NVIDIA GPU found (nvidia-smi absent or reports none)"))
    for engine, facts in report.facts["engines"].items():
        report.findings.append(_engine_finding(engine, facts))
    return report


def _engine_finding(engine: str, facts: dict[str, Any]) -> Finding:
    cls = engine_class(engine)
    if "error" in facts:
        return Finding(engine, f"not usable: {facts['error']}", None, cls.install)
    return Finding(engine, cls.probe_summary(facts))


def check_experiment(loaded: LoadedExperiment, server_binary: str | None = None) -> Report:
    """The facts for the engines an experiment uses, and one finding per piece it needs."""
    cells = expand(loaded)
    engines = tuple(e for e in engine_names() if any(c["engine"] == e for c in cells))
    options = {e: dict(loaded.engine_options.get(e, {})) for e in engines}
    if server_binary is not None:
        options.setdefault("llama-server", {})["binary"] = server_binary
    report = collect(engines, options)
    facts = report.facts["engines"]
    names = [g.get("name", "") for g in report.facts["gpus"]]
    wanted_gpus = sorted({c["gpu"] for c in cells} - {"any", "cpu"})
    for wanted in wanted_gpus:
        here = [n for n in names if gpu_names.matches(wanted, n)]
        report.findings.append(Finding(
            f"gpu {wanted}", f"present: {here[0]}" if here else
            f"not on this machine ({', '.join(names) or 'no GPU'}): its cells will be skipped here",
            True if here else None))
    if wanted_gpus and not any(gpu_names.matches(w, n) for w in wanted_gpus for n in names):
        report.findings.append(Finding("gpu", f"none of the experiment's GPU types ({', '.join(wanted_gpus)}) is here: "
                                              "every GPU cell would be skipped", False,
                                       "run on a node with one of them (harness submit routes each type)"))
    wants_gpu = bool(wanted_gpus) or (bool(names) and any(c["gpu"] != "cpu" for c in cells))
    for engine in engines:
        cls = engine_class(engine)
        if "error" in facts[engine]:
            report.findings.append(Finding(engine, f"needed by the experiment, not usable: {facts[engine]['error']}",
                                           False, cls.install))
            continue
        mine = [c.as_dict for c in cells if c["engine"] == engine]
        report.findings.extend(cls.needs(facts[engine], mine, options.get(engine, {}), wants_gpu, loaded.base))
        if cls.rehearsed:
            report.findings.extend(_rehearsals(loaded, [c for c in cells if c["engine"] == engine],
                                               report.facts["gpus"], names))
    return report


def _rehearsals(loaded: LoadedExperiment, cells: list[Cell], gpus: list[dict[str, str]],
                names: list[str]) -> list[Finding]:
    """One rehearsal of a run's worker (harness.run.rehearsal) per distinct load of `cells` that would run
    here: each model, dtype, GPU choice and set of options once."""
    from harness.run.ahead import group_environment
    from harness.run.rehearsal import rehearse

    seen: dict[str, LoadSpec] = {}
    for cell in cells:
        spec = cell.load_spec()
        runs_here = spec.gpu in ("any", "cpu") or any(gpu_names.matches(spec.gpu, n) for n in names)
        if runs_here and not refused_setting(cell) and engine_class(spec.engine).refusal(spec) is None:
            seen.setdefault(json.dumps([spec.model, spec.dtype, spec.gpu, spec.options], sort_keys=True, default=str),
                            spec)
    with tempfile.TemporaryDirectory(prefix="harness-doctor-") as tmp:
        log = Path(tmp) / "rehearsal.log"
        return [rehearse(spec, loaded.base, group_environment(spec, gpus, log)) for spec in seen.values()]

