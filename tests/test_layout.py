"""The package's shape: imports run one way down the pipeline, every engine says what it does with
every axis, and an engine is one file (a plugin found through its package metadata)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.engines.base import Honour, Ignore, Refuse
from harness.engines.registry import engine_class, engine_names
from harness.experiment.axes import AXES

PACKAGE = Path(__file__).resolve().parent.parent / "harness"
#: the packages from the ground up: a module may import its own package and those before it
LAYERS = ("core", "models", "engines", "install", "experiment", "results", "run", "analysis", "report", "cli")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[0] == "harness" and parts[1] in LAYERS else None


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every harness module `path` imports, wherever the import sits (function bodies and
    TYPE_CHECKING blocks count: a lazy import is still a dependency), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level] if path.name != "__init__.py" else \
                    module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if _layer(base) is None or base.count(".") == 1 else [base]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in out if name.startswith("harness.")]


def _modules() -> list[tuple[Path, str]]:
    return [(p, ".".join(("harness",) + p.relative_to(PACKAGE).with_suffix("").parts))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_sits_in_a_layer():
    loose = [m for p, m in _modules() if _layer(m) is None and m not in ("harness.__init__", "harness.__main__")]
    assert loose == [], f"modules outside the layered packages {LAYERS}: {loose}"


def test_imports_run_down_the_pipeline():
    upward = []
    for path, module in _modules():
        mine = _layer(module)
        if mine is None:
            continue
        for line, name in _imports(path, module):
            theirs = _layer(name)
            if theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} ({LAYERS[mine]} -> {LAYERS[theirs]})")
    assert upward == [], "imports that run back up the pipeline:\n" + "\n".join(upward)


#: the lower stages each stage may use (core, the ground floor, is open to all); anything else, even lower
#: down, is a module in the wrong room. Statistics read rows and the experiment, never an engine or a run;
#: the views read statistics and get machine facts as data; only the CLI wires every stage together.
STAGE_USES = {
    "core": set(),
    "models": set(),
    "engines": {"models"},
    "install": {"models", "engines"},  # a wheel folder: the model package and the vLLM that pins a torch
    "experiment": {"engines"},  # what each engine declares about the axes and its options
    "results": {"engines", "experiment"},  # rows from engine outputs, columns from the axes
    "run": {"models", "engines", "experiment", "results"},
    "analysis": {"experiment", "results"},
    "report": {"models", "experiment", "results", "analysis"},
    "cli": {"models", "engines", "install", "experiment", "results", "run", "analysis", "report"},
}


def _stage_breaches(modules: list[tuple[Path, str]]) -> list[str]:
    out = []
    for path, module in modules:
        mine = _layer(module)
        if mine is None:
            continue
        for line, name in _imports(path, module):
            theirs = _layer(name)
            if theirs is not None and theirs != mine and LAYERS[theirs] != "core" \
                    and LAYERS[theirs] not in STAGE_USES[LAYERS[mine]]:
                out.append(f"{path.name}:{line} imports {name} ({LAYERS[mine]} -> {LAYERS[theirs]})")
    return out


def test_each_stage_uses_only_the_stages_it_is_allowed():
    assert set(STAGE_USES) == set(LAYERS)
    assert all(LAYERS.index(used) < LAYERS.index(stage) for stage, uses in STAGE_USES.items() for used in uses)
    breaches = _stage_breaches(_modules())
    assert breaches == [], "imports of a stage this stage does not use (STAGE_USES):\n" + "\n".join(breaches)


def test_the_stage_test_sees_a_lower_stage_that_is_not_allowed(tmp_path):
    """The check itself can fail: statistics that load an engine are in the wrong room."""
    module = tmp_path / "mod.py"
    module.write_text("from harness.engines.registry import engine_class\nfrom harness.results.columns import keys_of\n")
    assert _stage_breaches([(module, "harness.analysis.mod")]) == \
        ["mod.py:1 imports harness.engines.registry (analysis -> engines)"]


def _layout_map() -> dict[str, str]:
    """docs/development.md's layout block, cut into its folders' paragraphs."""
    block = (PACKAGE.parent / "docs" / "development.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        start = re.match(r"(harness/[\w/]+/)\s", line)
        folder = start.group(1) if start else (None if line[:1].strip() else folder)
        if folder:
            sections[folder] = sections.get(folder, "") + line + "\n"
    return sections


def test_the_layout_map_names_every_module():
    """Every module is named in its folder's paragraph of the map, and every name there exists."""
    sections = _layout_map()
    unnamed, stale = [], []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}):
        key = f"harness/{folder.relative_to(PACKAGE).as_posix()}/"
        text = sections.get(key, "")
        names = {p.stem for p in folder.glob("*.py")} - {"__init__"}
        unnamed += [f"{key}{n}.py" for n in sorted(names) if not re.search(rf"\b{n}\.py\b", text)]
        stale += [f"{key}{n}" for n in re.findall(r"\b(\w+)\.py\b", text) if n not in names]
    assert unnamed == [], f"modules docs/development.md's layout map does not name: {unnamed}"
    assert stale == [], f"the layout map names modules that are not there: {stale}"


def test_the_direction_test_sees_a_lazy_upward_import(tmp_path):
    """The check itself can fail: an import inside a function body, of a higher layer, is found."""
    module = tmp_path / "mod.py"
    module.write_text("def f():\n    from harness.report import table\n")
    assert [n for _, n in _imports(module, "harness.engines.mod")] == ["harness.report.table"]


@pytest.mark.parametrize("name", engine_names())
def test_every_engine_declares_every_axis(name):
    cls = engine_class(name)
    missing = [a for a in AXES if a not in cls.axes]
    unknown = [a for a in cls.axes if a not in AXES]
    assert not missing, f"{cls.__name__}.axes does not say what {name} does with: {', '.join(missing)}"
    assert not unknown, f"{cls.__name__}.axes names axes that do not exist: {', '.join(unknown)}"
    for axis, support in cls.axes.items():
        assert isinstance(support, (Honour, Ignore, Refuse)), (axis, support)
        assert isinstance(support, Honour) or support.why.strip(), f"{name}: {axis} is ignored or refused without why"


ECHO_ENGINE = '''
"""A stand-in engine in one file: each prompt's characters, as token ids. Not an inference engine."""
import time
from harness.engines.base import (HONOUR, BatchOutput, Engine, EngineOptions, Refuse, SequenceOutput)


class EchoOptions(EngineOptions):
    shift: int = 0


class EchoEngine(Engine):
    name = "echo"
    Options = EchoOptions
    install = "pip install echo-engine (a test stand-in)"
    axes = {axis: HONOUR for axis in (
        "model", "engine", "dtype", "gpu", "batch_size", "seed", "temperature", "top_p", "top_k", "prefix_cache",
        "context_tokens", "prefill_chunk", "kv_cache_dtype", "filler_tokens")}
    axes["batch_invariant"] = Refuse("echo has no batch-invariant mode")

    @classmethod
    def probe(cls, options):
        return {"version": "0.1", "note": "echoes characters"}

    def __init__(self, spec, log, base=None):
        self.spec, self.shift = spec, EchoOptions.model_validate(spec.options).shift

    def generate(self, prompts, target, sampling, observe=None, cache="off", members=False):
        start = time.perf_counter()
        text = prompts[target][: sampling.max_tokens]
        ids = [ord(c) + self.shift for c in text]
        out = SequenceOutput(ids, text, "length", [0.0] * len(ids), [5.0] * len(ids), list(text))
        wall = time.perf_counter() - start
        return BatchOutput(out, len(ids), None, None, wall, wall, len(ids) * len(prompts))

    def describe(self):
        return {"engine_version": "echo 0.1", "model_sha256": "0" * 64}

    def close(self):
        pass


ENGINE = EchoEngine
'''


def test_an_engine_added_from_one_file_is_seen_by_plan_doctor_and_run(tmp_path):
    """A plugin package: one module and the metadata that names it in the harness.engines group."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "echo_engine.py").write_text(ECHO_ENGINE)
    meta = site / "echo_engine-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-engine\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[harness.engines]\necho = echo_engine\n")
    (tmp_path / "prompts.yaml").write_text("prompts:\n  - {id: a, text: abc}\n  - {id: b, text: hello}\n"
                                           "fillers: [xyz, pqrs]\n")
    (tmp_path / "exp.yaml").write_text(textwrap.dedent("""
        name: echoed
        prompts: prompts.yaml
        repeats: 2
        max_tokens: 8
        matrix:
          model: [anything]
          engine: [echo]
          batch_size: [1, 2]
          batch_invariant: [false, true]
        engine_options:
          echo: {shift: 1}
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    def harness(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=tmp_path,
                              env=env)

    planned = harness("plan", "exp.yaml")
    assert planned.returncode == 0, planned.stderr
    assert "4 cells" in planned.stdout and "engine=echo" in planned.stdout
    doctor = harness("doctor", "--engine", "echo", "--format", "json")
    assert doctor.returncode == 0, doctor.stderr
    assert json.loads(doctor.stdout)["facts"]["engines"]["echo"] == {"version": "0.1", "note": "echoes characters"}
    ran = harness("run", "exp.yaml", "--out", "out")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    status = json.loads(harness("status", "out", "--format", "json").stdout)
    by_invariant = {}
    for state in status["states"]:
        by_invariant.setdefault(state["settings"]["batch_invariant"], set()).add(state["state"])
    assert by_invariant == {False: {"done"}, True: {"unsupported"}}
    assert any("echo has no batch-invariant mode" in s["error"] for s in status["states"])
    # without the plugin on the path the engine is unknown, and the error lists the known ones
    alone = subprocess.run([sys.executable, "-m", "harness", "plan", "exp.yaml"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert alone.returncode != 0 and "unknown engine 'echo'" in alone.stderr and "llamacpp" in alone.stderr


def test_an_axis_an_engine_does_not_declare_refuses_its_cells(monkeypatch):
    """A new axis that an engine has not been taught about: cells that set it are refused with the
    reason, never run under a label only."""
    from harness.experiment import matrix

    cls = engine_class("llamacpp")
    monkeypatch.setattr(cls, "axes", {k: v for k, v in cls.axes.items() if k != "top_k"})

    class FakeCell(dict):
        pass

    cell = FakeCell({a: d for a, d in ((ax.name, ax.default) for ax in matrix.AXES_DECLARED)})
    cell.update(model="m", engine="llamacpp")
    assert matrix.refused_setting(cell) is None  # top_k at its default: nothing asked of the engine
    cell["top_k"] = 40
    assert "does not declare what it does with top_k" in matrix.refused_setting(cell)


MOST_LINES = 400


def test_no_module_is_over_the_line_limit():
    """A module over MOST_LINES lines holds more than one job: split it by job (docs/development.md)."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert long == {}, f"modules over {MOST_LINES} lines: {long}"
