"""The environment axis: which Python interpreter runs a cell's worker, and whether it can.

'current' is the interpreter running the harness. Another environment is one the experiment names
under `environments:` (another venv, with another vLLM or llama-cpp-python). Its worker imports
this harness's own code, put first on its path, so every environment runs the same harness and
only the libraries differ. Before a load group runs there, the interpreter is asked to import the
harness's worker and report its library versions; what it cannot do is named, with the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import harness
from harness.core.redaction import expand
from harness.experiment.schema import CURRENT_ENVIRONMENT, LoadedExperiment

#: the folder holding the `harness` package: what another interpreter gets on its path
SOURCE_ROOT = str(Path(harness.__file__).resolve().parent.parent)
CHECK_TIMEOUT_S = 120
_CHECK = ("import json, harness.run.worker; from harness.results.provenance import library_versions; "
          "print(json.dumps(library_versions()))")


def interpreter(loaded: LoadedExperiment, name: str) -> str:
    """The interpreter of environment `name` ('' for the current one); a relative path is taken
    from the experiment file's folder, and `~` is expanded."""
    if name == CURRENT_ENVIRONMENT or not loaded.experiment.environments[name].python:
        return ""
    python = Path(os.path.expanduser(loaded.experiment.environments[name].python))
    return str(python if python.is_absolute() else loaded.base / python)


def variables(loaded: LoadedExperiment, name: str) -> dict[str, str]:
    """The environment variables environment `name` sets for its workers (none for the current one), a
    `${NAME}` in a value filled in from this process's environment (a credential is never stored)."""
    if name == CURRENT_ENVIRONMENT:
        return {}
    return expand(dict(loaded.experiment.environments[name].env), dict(os.environ), f"environments.{name}.env")


def worker_env(python: str) -> dict[str, str]:
    """What a worker under `python` needs in its environment: this harness's code first on its path."""
    if not python:
        return {}
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else "")}


def refusal(name: str, python: str) -> str | None:
    """Why environment `name` cannot run a worker here (None where it can): the interpreter is
    missing, cannot import the harness (its dependencies), or cannot report its library versions."""
    if not python:
        return None
    where = f"environment '{name}' ({python})"
    if not Path(python).exists():
        return f"{where}: no such interpreter here; create the venv or fix environments.{name}.python"
    try:
        done = subprocess.run([python, "-c", _CHECK], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                              env={**os.environ, **worker_env(python)})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{where}: could not be started ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        return (f"{where} cannot import the harness: {last}; install its dependencies there "
                f"(pip install pydantic pyarrow pyyaml numpy typer rich) beside the engine")
    try:
        versions = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"{where}: its library versions could not be read (it printed {done.stdout.strip()[:200]!r})"
    if not isinstance(versions, dict):
        return f"{where}: its library versions could not be read"
    return None


def _environment_of(python: str) -> str:
    """What a Python runs with: the venv its path lies in (a venv's bin/python is a link to the base
    interpreter, so two venvs of one Python resolve to one file yet see other packages), else the
    interpreter file itself."""
    path = Path(os.path.abspath(python))
    if (path.parent.parent / "pyvenv.cfg").is_file():
        return str(path.parent.parent.resolve())
    return os.path.realpath(path)


def is_foreign(python: str) -> bool:
    """Whether `python` runs in another environment than this process (a spare worker of this one
    cannot serve it)."""
    return bool(python) and _environment_of(python) != _environment_of(sys.executable)
