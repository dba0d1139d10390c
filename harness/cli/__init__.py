"""The command line, one module per command group (as asv's `commands/`): `running` (plan, run,
submit), `statistics` (summarize, rescore, compare, check), `replaying` (replay, locate), `figures`
(report, plot), `folders` (status, merge) and `machine` (doctor, models); `common` holds the apps
and shared options.

Each command only parses its options, calls one function of the package and prints what comes
back; statistics, file writes and loops over rows live below. May import the whole package.
"""

from __future__ import annotations

import sys
from typing import Any, Optional


def application() -> Any:
    """The Typer app, every command registered. Imported when first asked for, not with this package:
    `harness run` starts its spare worker (harness.run.start) before typer, rich and the commands load."""
    # imported in the order `harness --help` lists their commands: the pipeline's
    from harness.cli import running  # noqa: F401, I001 - registers plan, run, submit
    from harness.cli import statistics  # noqa: F401 - summarize, rescore, compare, check
    from harness.cli import replaying  # noqa: F401 - replay, locate
    from harness.cli import figures  # noqa: F401 - report, plot
    from harness.cli import folders  # noqa: F401 - status, merge
    from harness.cli import machine  # noqa: F401 - doctor, models
    from harness.cli.common import app

    return app


def main(argv: Optional[list[str]] = None, start: Any = None) -> Any:
    """Entry point: user errors print one clear message and exit 1 (2 for bad input). `start`: the
    start-up of `run` (harness.run.start.RunStart), begun already; the commands find it as their
    context's obj."""
    import typer
    from rich.console import Console
    from rich.markup import escape

    from harness.core.errors import HarnessError, describe_os_error
    from harness.core.redaction import redact_standard_streams

    redact_standard_streams()  # whatever a command prints leaves through one redaction
    app = application()
    try:
        # without standalone mode, Exit(n) returns n
        code = app(args=argv, standalone_mode=False, obj=start)
        if isinstance(code, int) and code:
            sys.exit(code)
        return None
    except HarnessError as exc:
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except OSError as exc:  # a file that cannot be written or read: its path and cause, not a traceback
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(describe_os_error(exc))}",
                                                    soft_wrap=True)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:
        # Usage errors (missing argument, bad option). Newer typer releases carry their own copy
        # of click, so the class is recognised by name rather than by click's import path.
        if any(cls.__name__ == "ClickException" for cls in type(exc).__mro__):
            exc.show()  # type: ignore[attr-defined]
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        raise


def _loads_engines_here(args: list[str]) -> bool:
    """The commands that load llama.cpp in their own process: replay, rescore, compare --score."""
    return args[:1] in (["replay"], ["rescore"]) or (args[:1] == ["compare"] and "--score" in args)


def entry() -> None:
    """The `harness` command (and `python -m harness`): main(), then an exit without the interpreter's
    teardown of pandas, pyarrow and the rest (a tenth of a second and more of every command). Every
    file a command writes is closed by then; only the standard streams are flushed here."""
    import os

    from harness.core.native_preload import ensure
    from harness.run.start import RunStart

    if _loads_engines_here(sys.argv[1:]):  # before anything native loads (harness.core.native_preload)
        ensure()
    start = RunStart.for_argv(sys.argv[1:])  # `harness run`: its worker starts now, overlapping this process's imports
    try:
        main(start=start)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    finally:
        if start is not None:  # run releases it itself; this is for `run --help`, a bad option, a crash
            start.release()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe (harness ... | head): nothing more can be shown
        code = code or 1
    os._exit(code)
