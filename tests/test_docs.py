"""The documentation stays true: the pages build in strict mode (a broken link or anchor fails),
README's links resolve, and every command example runs.

Command examples are of two kinds. Lines `$ harness ...` in `console` blocks run for real, in order,
in a fresh copy of configs/ and prompts/ where README's own example (the quickstart) runs first;
each must exit 0, or the code its line declares (`# exit N`). Lines `harness ...` in `bash` blocks
are recipes for GPUs and clusters that cannot run on a CPU-only machine: each is parsed by the real
command-line parser (its command, options and their values must exist and convert), and every
experiment file it names is loaded and checked.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import needs_llama

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"(?ms)^```{language}\n(.*?)^```", path.read_text())


def _examples(prefix: str, language: str) -> list[tuple[str, str]]:
    """(page, command line) for each line of `language` blocks that starts with `prefix`."""
    return [(page.name, line.removeprefix("$ ").strip()) for page in PAGES
            for block in _blocks(page, language) for line in block.splitlines() if line.startswith(prefix)]


def test_the_pages_build_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
    return re.sub(r"[\s]+", "-", text)


def test_every_relative_link_of_the_readme_resolves():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) >= 10
    for target, anchor in links:
        if "://" in target:
            continue
        path = ROOT / target
        assert path.is_file(), target
        if anchor:
            slugs = {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", path.read_text())}
            assert anchor in slugs, f"{target}#{anchor}"


def test_readme_is_short_and_every_page_is_in_the_site_navigation():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page.name in nav for page in PAGES[1:])


def _recipe_args(line: str) -> list[str]:
    line = re.sub(r"\$\([^)]*\)", "CELLS", line.split("  #", 1)[0])  # a shell substitution stands for its output
    line = re.split(r"\s[>|]\s", line)[0]  # what the shell redirects or pipes is not the command's
    return shlex.split(line)[1:]


RECIPES = _examples("harness ", "bash")


@pytest.mark.parametrize(("page", "line"), RECIPES, ids=[f"{p}: {recipe[:60]}" for p, recipe in RECIPES])
def test_a_recipe_parses_and_its_experiment_loads(page, line):
    import typer

    from harness.cli import application
    from harness.experiment.config import load_experiment

    args = _recipe_args(line)
    command = typer.main.get_command(application())
    ctx = command.context_class(command, info_name="harness")
    while hasattr(command, "get_command") and args:  # a group: descend to the subcommand
        command = command.get_command(ctx, args[0])
        assert command is not None, f"{page}: unknown command in {line!r}"
        ctx = command.context_class(command, info_name=args[0], parent=ctx)
        args = args[1:]
    command.make_context(ctx.info_name, args, parent=ctx.parent)  # raises on an unknown option or a bad value
    for arg in args:
        if arg.endswith(".yaml") and (ROOT / arg).is_file():
            load_experiment(ROOT / arg, model_files=False)


CONSOLE = _examples("$ harness ", "console")


@needs_llama
def test_every_console_example_runs(tmp_path):
    """In page order, README first: its quickstart makes results/quickstart for the pages after it."""
    assert CONSOLE and CONSOLE[0] == ("README.md", "harness run configs/quickstart.yaml")
    for folder in ("configs", "prompts"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    for page, line in CONSOLE:
        declared = re.search(r"#\s*exit (\d+)", line)
        command = line.split("#", 1)[0]
        done = subprocess.run([sys.executable, "-m", *shlex.split(command)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        expected = int(declared.group(1)) if declared else 0
        assert done.returncode == expected and "Traceback" not in done.stderr, (page, line, done.stdout, done.stderr)
