"""Array jobs for SLURM and PBS: one array task per shard, one job per GPU type.

Every task runs `harness run` on its shard into one shared results folder; cells are written
atomically and skipped when done, so a requeued or resubmitted task resumes without duplicates.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from harness.core.errors import HarnessError, UsageError
from harness.core.redaction import redact_text, secret_values
from harness.experiment.matrix import Cell, expand, group
from harness.experiment.schema import Cluster, GpuResources, LoadedExperiment
from harness.experiment.selection import Selection, apply, units

SCHEDULERS = ("slurm", "pbs")


@dataclass
class ArrayJob:
    gpu: str
    shards: int
    cells: int
    script: str
    scheduler: str
    job_id: str = ""
    #: the script's text (written to `script` by write_jobs)
    text: str = ""


def job_name(*parts: str) -> str:
    """A job name both schedulers take: letters, digits, '.', '_' and '-' only (GPU types such as
    'RTX 4090' hold spaces, which break #SBATCH and #PBS lines)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)).strip("_")


def _gpu_count(gpu: str, res: GpuResources | None) -> int:
    """GPUs a task of this type asks for: none for cpu and any, else the type's count (default 1)."""
    return 0 if gpu in ("cpu", "any") else (res.count if res is not None else 1)


def _command(out: Path, gpu: str, shards: int, index_expr: str,
             cell_ids: list[str] | None, python: str) -> str:
    # The task runs the experiment snapshot kept in the folder, so an edit of the YAML file
    # between submission and a task's start cannot change what the task runs.
    args = [python, "-m", "harness", "run", str(out.resolve()), "--out", str(out.resolve()),
            "--where", f"gpu={gpu}", "--no-summary"]
    if cell_ids:
        args += ["--cells", ",".join(cell_ids)]
    return " ".join(shlex.quote(a) for a in args) + f" --shard \"{index_expr}/{shards}\""


def render_slurm(name: str, gpu: str, shards: int, cluster: Cluster, command: str, logs: Path) -> str:
    res = cluster.gpus.get(gpu)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name('harness', name, gpu)}",
        f"#SBATCH --array=0-{shards - 1}",
        f"#SBATCH --time={cluster.time}",
        f"#SBATCH --mem={cluster.mem}",
        f"#SBATCH --cpus-per-task={cluster.cpus}",
        f"#SBATCH --output={logs}/%x-%A_%a.out",
        "#SBATCH --requeue",
    ]
    if cluster.account:
        lines.append(f"#SBATCH --account={cluster.account}")
    if res is not None:
        for key in ("partition", "gres", "constraint"):
            value = getattr(res, key)
            if value:
                lines.append(f"#SBATCH --{key}={value}")
    if not (res is not None and res.gres) and _gpu_count(gpu, res):
        lines.append(f"#SBATCH --gres=gpu:{_gpu_count(gpu, res)}")  # a GPU cell on a node without one is skipped
    lines += ["set -euo pipefail", *_setup(cluster), f"exec {command}", ""]
    return "\n".join(lines)


def pbs_memory(mem: str) -> str:
    """`cluster.mem` as PBS writes it: a number without a unit means megabytes, as it does to SLURM
    (PBS would read '16000' as bytes)."""
    text = mem.strip().lower().rstrip("b")
    return f"{text}mb" if text.isdigit() else f"{text}b"


def render_pbs(name: str, gpu: str, shards: int, cluster: Cluster, command: str, logs: Path) -> str:
    res = cluster.gpus.get(gpu)
    count = _gpu_count(gpu, res)
    select = res.select if res is not None and res.select else (
        f"select=1:ncpus={cluster.cpus}:mem={pbs_memory(cluster.mem)}" + (f":ngpus={count}" if count else "")
    )
    lines = [
        "#!/bin/bash",
        f"#PBS -N {job_name('h', name, gpu)}"[:236],
        f"#PBS -l {select}",
        f"#PBS -l walltime={_pbs_walltime(cluster.time)}",
        "#PBS -j oe",
        f"#PBS -o {logs}/",
        "#PBS -r y",
    ]
    lines.append("#PBS -V")  # the submitting shell's environment, as sbatch passes it: credentials come from there
    if shards > 1:
        lines.insert(2, f"#PBS -J 1-{shards}")
    if res is not None and res.queue:
        lines.append(f"#PBS -q {res.queue}")
    if cluster.account:
        lines.append(f"#PBS -A {cluster.account}")
    lines += ["set -euo pipefail", *_setup(cluster), f"exec {command}", ""]
    return "\n".join(lines)


def _setup(cluster: Cluster) -> list[str]:
    """The setup lines as a job script holds them: without an inline credential (refused at submit)."""
    return [redact_text(line) for line in cluster.setup]


def _pbs_walltime(slurm_time: str) -> str:
    """SLURM's [D-]HH:MM:SS as PBS hours: (24*D+HH):MM:SS."""
    days, _, rest = slurm_time.rpartition("-")
    days = days or "0"
    hours, minutes, seconds = rest.split(":")
    return f"{int(days) * 24 + int(hours)}:{minutes}:{seconds}"


def inline_secrets(loaded: LoadedExperiment) -> list[str]:
    """Where the experiment holds a credential inline that its jobs would need: each place, said
    with how to pass it instead. A job runs the folder's stored snapshot, where every inline
    credential is '<redacted>' (harness.core.redaction), so such a job could only fail."""
    places: list[str] = []
    for grp in group(expand(loaded)):
        for key, value in grp.spec.options.items():
            place = f"engine_options.{grp.spec.engine}.{key}"
            if secret_values({key: value}) and place not in places:
                places.append(place)
    found = [f"{p}: write the credential as ${{NAME}} (a URL: http://user:${{NAME}}@host/v1; a key: "
             f"api_key_env: NAME where the engine has it)" for p in places]
    for index, line in enumerate(loaded.experiment.cluster.setup):
        if redact_text(line) != line:
            found.append(f"cluster.setup[{index}] '{redact_text(line)}': write the value as a reference, e.g. "
                         "export HF_TOKEN=\"$HF_TOKEN\"")
    return found


def refuse_inline_secrets(loaded: LoadedExperiment) -> None:
    """A UsageError listing the inline credentials a job would need (inline_secrets), if any."""
    found = inline_secrets(loaded)
    if found:
        raise UsageError(
            "the experiment holds credentials inline, which its jobs cannot use: a job runs the results folder's "
            "stored snapshot, where they are '<redacted>'. Pass each from the environment instead and export it in "
            "the shell you submit from (sbatch passes the environment to the job; the PBS script asks for it "
            "with -V):\n  " + "\n  ".join(found))


def plan_jobs(loaded: LoadedExperiment, cell_ids: list[str] | None) -> dict[str, list[Cell]]:
    """Cells per GPU type (the value of the gpu axis), after an optional --cells filter."""
    chosen = apply(group(expand(loaded)), Selection(cell_ids=frozenset(cell_ids) if cell_ids else None))
    by_gpu: dict[str, list[Cell]] = {}
    for _, cells in chosen:
        for cell in cells:
            by_gpu.setdefault(cell["gpu"], []).append(cell)
    return by_gpu


def write_jobs(loaded: LoadedExperiment, out: Path, scheduler: str, cell_ids: list[str] | None) -> list[ArrayJob]:
    """Write one array-job script per GPU type under OUT/jobs; nothing is submitted here."""
    jobs = render_jobs(loaded, out, scheduler, cell_ids)
    (out / "jobs" / "logs").mkdir(parents=True, exist_ok=True)
    for job in jobs:
        Path(job.script).write_text(job.text)
    return jobs


def render_jobs(loaded: LoadedExperiment, out: Path, scheduler: str, cell_ids: list[str] | None) -> list[ArrayJob]:
    """One array-job script per GPU type, as text with the path it goes to; nothing is written."""
    if scheduler not in SCHEDULERS:
        raise UsageError(f"--scheduler '{scheduler}': allowed: {', '.join(SCHEDULERS)}")
    cluster = loaded.experiment.cluster
    jobs_dir = (out / "jobs").resolve()
    logs = jobs_dir / "logs"
    python = cluster.python or sys.executable
    jobs = []
    for gpu, cells in plan_jobs(loaded, cell_ids).items():
        shards = min(len(units(group(cells))), cluster.shards or len(cells))  # see harness.experiment.selection
        index = "${SLURM_ARRAY_TASK_ID}" if scheduler == "slurm" else (
            "$((PBS_ARRAY_INDEX - 1))" if shards > 1 else "0")
        command = _command(out, gpu, shards, index, cell_ids, python)
        render = render_slurm if scheduler == "slurm" else render_pbs
        text = render(loaded.experiment.name, gpu, shards, cluster, command, logs)
        path = jobs_dir / f"{job_name(loaded.experiment.name, gpu)}.{scheduler}"
        jobs.append(ArrayJob(gpu, shards, len(cells), str(path), scheduler, text=text))
    return jobs


def submit(jobs: list[ArrayJob], out: Path) -> list[ArrayJob]:
    """Hand each script to sbatch / qsub; record the job ids in OUT/jobs/submitted.jsonl."""
    for job in jobs:
        tool = "sbatch" if job.scheduler == "slurm" else "qsub"
        if shutil.which(tool) is None:
            raise HarnessError(f"{tool} not found on PATH: run on a login node, or use --dry-run")
        args = [tool, "--parsable", job.script] if tool == "sbatch" else [tool, job.script]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise HarnessError(f"{tool} refused {job.script}: {proc.stderr.strip() or proc.stdout.strip()}")
        job.job_id = proc.stdout.strip().split(";")[0]
        with open(out / "jobs" / "submitted.jsonl", "a") as log:
            record = {k: v for k, v in asdict(job).items() if k != "text"}
            log.write(json.dumps(record | {"at": datetime.now(timezone.utc).isoformat()}) + "\n")
    return jobs
