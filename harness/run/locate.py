"""`harness locate`: why a run split from its reference, as the first operation whose output differs.

For each setting whose runs moved against their reference (tokens departed, or a step's
log-probability is not bitwise the reference's), one run is taken (the earliest split) with its
reference run, and the forward pass of each is rebuilt exactly as it ran: its own batch (batch-mates
and position read from the row), its load and environment, the tokens it had fed back in. Two steps
are traced: the prefill, and the step where the run split (the first token that differs, or the
first log-probability that does). Each pass records every module's output on the target's own
elements (Engine.trace); the two passes are compared op by op (harness.run.trace_diff), and the first
module (llama.cpp: graph tensor) whose output differs is named, with the one before it that agreed.
Where the engine has a level below its modules (transformers), a second round goes one level down,
into the module holding that one (its parent: the first module that differs may only receive what
an un-hooked function computed), and compares every torch op it runs; where the two passes call
different ops (an attention kernel with a padding mask in the batch, without one alone) the place is
named on both sides.

Truth first: each rebuilt pass's log-probability of the token the run took at that step must be
bitwise the row's; where it is not, the step was not rebuilt as it ran, and the finding says "could
not rebuild this step" with the mismatch instead of naming an op. An op-level trace whose last op is
not bitwise the module's own output (tracing changed the kernels) is withheld, saying so.

Each side is traced in a process of its own (harness.run.trace_worker) under its environment's
interpreter and variables, so two kernel paths (`ATEN_CPU_CAPABILITY`) or two vLLM releases compare
as two environments. Results land in RESULTS/located/<locator id>/<cell id>.parquet (one record per
op: trace_diff.COLUMNS, the sides' digests among them, so that `harness compare` of two folders can
name the first op whose digest differs between two machines) and RESULTS/located_steps/ (one record
per traced step: what was found).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from harness.core.native_preload import flag
from harness.core.op_recording import is_logits
from harness.engines.registry import engine_class
from harness.experiment.matrix import digest, expand
from harness.results.folder_rows import Results
from harness.run import environments, trace_diff
from harness.run.replay import ROW_COLUMNS, run_batch
from harness.run.rescore import misplaced, read_side, scoring_machine, side_path

FOLDER, STEPS_FOLDER = "located", "located_steps"
STEP_KINDS = ("prefill", "split")
_RUN = [("cell_id", pa.string()), ("prompt_id", pa.string()), ("repeat", pa.int64()), ("reference_cell", pa.string()),
        ("reference_repeat", pa.int64()), ("step", pa.int64()), ("step_kind", pa.string())]
OPS_SCHEMA = pa.schema(_RUN + [
    ("level", pa.string()), ("inside", pa.string()), ("order", pa.int64()), ("name", pa.string()), ("layer", pa.int64()),
    ("op", pa.string()), ("elements", pa.int64()), ("differ_share", pa.float64()), ("max_abs_diff", pa.float64()),
    ("max_rel_diff", pa.float64()), ("digest_a", pa.string()), ("digest_b", pa.string()), ("absmax_a", pa.float64()),
    ("absmax_b", pa.float64()), ("mean_a", pa.float64()), ("mean_b", pa.float64()), ("locator_id", pa.string())])
STEPS_SCHEMA = pa.schema(_RUN + [
    ("setting", pa.string()), ("rebuilt", pa.bool_()), ("rebuilt_detail", pa.string()), ("first_name", pa.string()),
    ("first_op", pa.string()), ("before_name", pa.string()), ("parted", pa.string()), ("op_first", pa.string()),
    ("op_parted", pa.string()), ("logits_max_abs_diff", pa.float64()), ("layer0_max_abs_diff", pa.float64()),
    ("finding", pa.string()), ("locator", pa.string()), ("locator_id", pa.string())])
TRACE_TIMEOUT_S = 1800


def _label(cell: Any, keys: list[str]) -> str:
    """The setting as the summary names it: the axes that vary in the folder."""
    return " ".join(f"{k}={cell[k]}" for k in keys if k in cell.as_dict) or cell.id


class _Side:
    """One run to rebuild: its row, cell, experiment and the passes asked of it."""

    def __init__(self, row: Any, cell: Any, loaded: Any, tokens: list[int], logprobs: Any) -> None:
        self.row, self.cell, self.loaded, self.tokens = row, cell, loaded, list(tokens)
        self.logprobs = None if logprobs is None else np.asarray(logprobs, dtype=np.float32)
        exp = loaded.experiment
        self.batch = run_batch(loaded, row, None)
        self.sampling = cell.sampling(max(exp.max_tokens, len(tokens)), exp.unseeded_fillers, exp.batch_fill == "copies")
        self.environment = str(cell["environment"]) if "environment" in cell.as_dict else environments.CURRENT_ENVIRONMENT
        #: whether its engine traces one level further down, inside a module (llama.cpp's graph is all ops already)
        self.goes_inside = engine_class(cell.load_spec().engine).trace_inside

    def request(self, key: str, step: int, inside: str | None = None) -> dict[str, Any]:
        return {"key": key, "texts": [p.text for p in self.batch.prompts], "target": self.batch.target_position,
                "sampling": self.sampling, "forced": self.tokens, "step": step, "inside": inside}

    def load(self) -> tuple[Any, str]:
        return self.cell.load_spec(), self.environment

    def check(self, logprobs: np.ndarray, step: int) -> str | None:
        """Why the rebuilt pass is not the run's (None where it is, bitwise): its log-probability of the
        token the run took at this step against the row's."""
        if self.logprobs is None or step >= len(self.logprobs):
            return f"{self.cell.id} repeat {int(self.row.repeat)}: no log-probability recorded at step {step} to check"
        chosen = self.tokens[step] if step < len(self.tokens) else int(np.argmax(logprobs))
        rebuilt, recorded = np.float32(logprobs[chosen]), np.float32(self.logprobs[step])
        if rebuilt.view(np.uint32) == recorded.view(np.uint32):
            return None
        return (f"{self.cell.id} repeat {int(self.row.repeat)} step {step}: rebuilt log-probability {float(rebuilt):.9g}, "
                f"the row's {float(recorded):.9g} (|d| {abs(float(rebuilt) - float(recorded)):.3g})")


def _run_passes(jobs: dict[tuple, list[dict[str, Any]]], sides: dict[tuple, _Side], out: Path,
                log: Callable[[str], None]) -> None:
    """Each load's passes in a trace worker of its own, under its environment (see the module's doc)."""
    for (spec_key, environment), passes in jobs.items():
        side = sides[(spec_key, environment)]
        python = environments.interpreter(side.loaded, environment) or sys.executable
        try:
            chosen = environments.variables(side.loaded, environment)
        except ValueError as exc:  # a ${NAME} not set here
            for request in passes:
                (out / f"{request['key']}.error").write_text(str(exc))
            continue
        env = {**os.environ, **environments.worker_env(environments.interpreter(side.loaded, environment)), **chosen}
        job = {"spec": side.cell.load_spec(), "base": side.loaded.base, "passes": passes, "out": str(out)}
        log(f"tracing {len(passes)} pass(es) with {side.cell.load_spec().label()}"
            + (f" in environment {environment}" if environment != environments.CURRENT_ENVIRONMENT else ""))
        native = engine_class(side.cell.load_spec().engine).native_package  # preloaded first, as in a run's worker
        done = subprocess.run([python, "-m", "harness.run.trace_worker", *flag(native)], input=pickle.dumps(job),
                              capture_output=True, env=env, timeout=TRACE_TIMEOUT_S)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
            for request in passes:
                (out / f"{request['key']}.error").write_text(f"the trace worker ended with {done.returncode}: "
                                                             + " / ".join(tail))


def _loaded_pass(out: Path, key: str) -> tuple[trace_diff.Recording | None, np.ndarray | None, str | None]:
    error = out / f"{key}.error"
    if error.exists():
        return None, None, error.read_text()
    return trace_diff.Recording.load(out / f"{key}.bin"), np.load(out / f"{key}.lp.npy"), None


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def locate(results: Results, moved: pd.DataFrame, keys: list[str], steps: tuple[str, ...] = STEP_KINDS,
           log: Callable[[str], None] = print, any_device: bool = False) -> tuple[list[Path], list[str]]:
    """Trace the runs of `results` that moved (`moved`: one per setting, analysis.divergence.earliest_moved;
    `keys`: the axes that name a setting), see the module's doc. Returns (the files written, the settings
    that could not be traced, each with its reason)."""
    from harness.results.store import Store

    if moved.empty:
        log("no setting's runs moved against their reference: nothing to locate")
        return [], []
    here = scoring_machine()
    cells = {c.id: (c, loaded) for loaded in results.experiments for c in expand(loaded)}
    rows = results.read_rows(columns=list(dict.fromkeys(ROW_COLUMNS + ["repeat"])))
    rows = rows[rows["status"] == "ok"].set_index(["cell_id", "prompt_id", "repeat"], drop=False)
    refused: list[str] = []
    chosen: list[tuple[Any, _Side, _Side, list[tuple[str, int]]]] = []
    for target in moved.itertuples(index=False):
        ref_key = (str(target.reference_cell), str(target.prompt_id), int(target.reference_repeat))
        run_key = (str(target.cell_id), str(target.prompt_id), int(target.repeat))
        if run_key[0] not in cells or ref_key[0] not in cells or ref_key not in rows.index or run_key not in rows.index:
            refused.append(f"cell {target.cell_id}: its run or its reference run is not in the current experiment")
            continue
        pair = rows.loc[[ref_key, run_key]]
        # each side is traced under its own environment's interpreter: only the device must be here
        why = None if any_device else misplaced(pair["device"].unique(), here)
        if why is not None:
            refused.append(f"cell {target.cell_id}: {why}")
            continue
        if (pair["context_tokens"].fillna(0) > 0).any() or (pair["filler_tokens"].fillna(0) > 0).any():
            refused.append(f"cell {target.cell_id}: a shared context or padded batch-mates: those texts are not stored")
            continue
        tokens = results.tokens_for(set(pair["output_hash"]))
        lps = results.folder.store.values_at("logprobs", pair.reset_index(drop=True)).tolist()
        sides = [_Side(r, cells[r.cell_id][0], cells[r.cell_id][1], tokens[r.output_hash], lp)
                 for r, lp in zip(pair.itertuples(index=False), lps)]
        split = int(target.split)
        wanted = [(kind, step) for kind, step in (("prefill", 0), ("split", split))
                  if kind in steps and not (kind == "split" and step == 0 and "prefill" in steps)]
        chosen.append((target, sides[0], sides[1], wanted))
    written: list[Path] = []
    if not chosen:
        return written, refused
    store = Store(results.root)
    locator = {"machine": here}
    locator_id = digest(locator, 12)
    found_at: dict[tuple[int, str], dict[str, Any]] = {}  # (target, step kind) -> what its comparison found
    with tempfile.TemporaryDirectory(prefix="harness-locate-") as tmp:
        out = Path(tmp)
        for level in ("module", "op"):  # the op level goes into what the module level found
            jobs: dict[tuple, list[dict[str, Any]]] = {}
            loads: dict[tuple, _Side] = {}
            for index, (target, reference, run, wanted) in enumerate(chosen):
                for kind, step in wanted:
                    inside = None
                    if level == "op":
                        found = found_at[(index, kind)]
                        if found["first"] is None or not all(s.goes_inside for s in (reference, run)):
                            continue
                        inside = _parent(found["first"]["name"])
                    for side_name, side in (("a", reference), ("b", run)):
                        load = (repr(side.load()[0]), side.environment)
                        loads.setdefault(load, side)
                        jobs.setdefault(load, []).append(side.request(f"{level}-{index}-{kind}-{side_name}", step, inside))
            if jobs:
                _run_passes(jobs, loads, out, log)
            for index, (target, reference, run, wanted) in enumerate(chosen):
                for kind, step in wanted:
                    if level == "module":
                        found_at[(index, kind)] = _compare_module(out, index, kind, step, reference, run)
                    elif found_at[(index, kind)]["first"] is not None and reference.goes_inside and run.goes_inside:
                        found_at[(index, kind)]["op"] = _compare_ops(out, index, kind, found_at[(index, kind)])
        by_cell: dict[str, tuple[list[dict], list[dict]]] = {}
        for index, (target, reference, run, wanted) in enumerate(chosen):
            for kind, step in wanted:
                found = found_at[(index, kind)]
                base = {"cell_id": str(target.cell_id), "prompt_id": str(target.prompt_id), "repeat": int(target.repeat),
                        "reference_cell": str(target.reference_cell), "reference_repeat": int(target.reference_repeat),
                        "step": step, "step_kind": kind}
                ops, steps_found = by_cell.setdefault(str(target.cell_id), ([], []))
                for level, inside, records in found["records"]:
                    ops += [base | r | {"level": level, "inside": inside, "locator_id": locator_id} for r in records]
                steps_found.append(base | _step_record(found, _label(run.cell, keys)) | {
                    "locator": str(locator), "locator_id": locator_id})
        for cell_id, (ops, steps_found) in by_cell.items():
            for folder, schema, records in ((FOLDER, OPS_SCHEMA, ops), (STEPS_FOLDER, STEPS_SCHEMA, steps_found)):
                path = side_path(results.root, folder, locator_id, cell_id)
                table = pa.Table.from_pylist(records, schema=schema)
                store.atomic_write(path, lambda tmp_path, t=table: pq.write_table(t, tmp_path))
                written.append(path)
    return written, refused


def _compare_module(out: Path, index: int, kind: str, step: int, reference: _Side, run: _Side) -> dict[str, Any]:
    """The module-level comparison of one traced step, with the truth check of both rebuilt passes."""
    found: dict[str, Any] = {"first": None, "before": None, "parted": None, "records": [], "rebuilt": False,
                             "rebuilt_detail": "", "op": None, "module_digests": {}}
    a, lp_a, error_a = _loaded_pass(out, f"module-{index}-{kind}-a")
    b, lp_b, error_b = _loaded_pass(out, f"module-{index}-{kind}-b")
    if error_a or error_b:
        found["rebuilt_detail"] = f"could not trace: {error_a or error_b}"
        return found
    mismatches = [why for why in (reference.check(lp_a, step), run.check(lp_b, step)) if why]
    compared = trace_diff.compare_recordings(a, b)
    a.close(), b.close()
    result = trace_diff.finding(compared)
    found["records"].append(("module", "", compared.rows))
    found["module_digests"] = {r["name"]: (r["digest_a"], r["digest_b"]) for r in compared.rows}
    if mismatches:
        found["rebuilt_detail"] = "could not rebuild this step: " + "; ".join(mismatches)
        return found
    found.update(rebuilt=True, first=result.first, before=result.before, parted=result.parted, line=result.line(),
                 rows=compared.rows)
    return found


def _compare_ops(out: Path, index: int, kind: str, found: dict[str, Any]) -> dict[str, Any]:
    """The op-level comparison inside the first differing module's parent, with its faithfulness check."""
    inside = _parent(found["first"]["name"])
    a, _, error_a = _loaded_pass(out, f"op-{index}-{kind}-a")
    b, _, error_b = _loaded_pass(out, f"op-{index}-{kind}-b")
    if error_a or error_b:
        return {"line": f"inside {inside}: could not trace its ops: {error_a or error_b}", "first": None, "parted": None}
    own = found["module_digests"].get(inside)
    last = [trace_diff.digest(r.values(len(r.ops) - 1)) if r.ops else "" for r in (a, b)]
    compared = trace_diff.compare_recordings(a, b)
    a.close(), b.close()
    result = trace_diff.finding(compared)
    if own is not None and tuple(last) != tuple(own):
        return {"line": f"inside {inside}: the op-level trace withheld: its last op is not bitwise the module's own "
                        "output (tracing changed the kernels)", "first": None, "parted": None}
    found["records"].append(("op", inside, compared.rows))
    return {"line": f"inside {inside}: {result.line()}", "first": result.first, "parted": result.parted}


def _step_record(found: dict[str, Any], setting: str) -> dict[str, Any]:
    """One traced step's record (STEPS_SCHEMA's finding columns)."""
    rows = found.get("rows") or []
    logits = [r["max_abs_diff"] for r in rows if is_logits(r["name"])]
    layer0 = [r["max_abs_diff"] for r in rows if r["layer"] == 0]
    first, before, parted, op = found["first"], found["before"], found["parted"], found.get("op") or {}
    if not found["rebuilt"]:
        line = found["rebuilt_detail"]
    else:
        line = found["line"] + (f"; {op['line']}" if op.get("line") else "")
        if logits and layer0 and first is not None:
            line += f"; max |d| {max(layer0):.3g} at layer 0, {max(logits):.3g} at the logits"
    return {"setting": setting, "rebuilt": bool(found["rebuilt"]), "rebuilt_detail": found["rebuilt_detail"],
            "first_name": first["name"] if first else None, "first_op": first["op"] if first else None,
            "before_name": before["name"] if before else None, "parted": " | ".join(map(str, parted)) if parted else None,
            "op_first": f"{op['first']['op']} (op {op['first']['order']})" if op.get("first") else None,
            "op_parted": " | ".join(map(str, op["parted"])) if op.get("parted") else None,
            "logits_max_abs_diff": max(logits) if logits else None, "layer0_max_abs_diff": max(layer0) if layer0 else None,
            "finding": line}


def read_steps(root: Path) -> pd.DataFrame:
    """Every traced step of a results folder (STEPS_SCHEMA)."""
    return read_side(root, STEPS_FOLDER, STEPS_SCHEMA)


def located_steps(results: Results) -> pd.DataFrame:
    """The traced steps of the cells read (STEPS_SCHEMA), in setting, prompt and step order: what
    `summarize --what locate`, `locate --stats-only` and the report show."""
    steps = read_steps(results.root)
    if steps.empty:
        return steps
    steps = steps[steps["cell_id"].isin(set(results.cell_ids))]
    return steps.sort_values(["setting", "prompt_id", "step"], kind="stable").reset_index(drop=True)


#: the columns of located_by_module
BY_MODULE = ["setting", "prompt_id", "step_kind", "step", "order", "name", "layer", "max_abs_diff"]


def located_by_module(results: Results) -> pd.DataFrame:
    """Per traced step of the cells read, each module's largest difference from the reference run's pass
    (BY_MODULE), in setting, prompt, step and pass order: how a difference grows layer by layer."""
    ops = read_ops(results.root)
    if ops.empty:
        return pd.DataFrame(columns=BY_MODULE)
    ops = ops[ops["cell_id"].isin(set(results.cell_ids)) & (ops["level"] == "module")]
    labels = read_steps(results.root)[["cell_id", "step", "setting"]].drop_duplicates(["cell_id", "step"])
    out = ops.merge(labels, on=["cell_id", "step"], how="left")
    return out.sort_values(["setting", "prompt_id", "step", "order"], kind="stable")[BY_MODULE].reset_index(drop=True)


def read_ops(root: Path) -> pd.DataFrame:
    """Every traced op of a results folder (OPS_SCHEMA)."""
    return read_side(root, FOLDER, OPS_SCHEMA)


def across(a: Results, b: Results, ignore: tuple[str, ...]) -> list[str]:
    """Between two folders (two machines, two environments): for each traced step whose setting (but
    the `ignore`d axes), prompt and step are in both, the first op whose output digest differs, on the
    run's pass and on its reference's: no activation needs to travel between the machines. Where both
    folders traced one level further down inside the same module (the op level), the first op there too."""
    from harness.results.columns import KEY_COLUMNS

    keys = [k for k in KEY_COLUMNS if k not in ignore]
    sides = []
    for results in (a, b):
        ops = read_ops(results.root)
        ops = ops[ops["cell_id"].isin(set(results.cell_ids))]
        settings = results.read_rows(columns=["cell_id"] + keys).drop_duplicates("cell_id").astype(str)
        labels = read_steps(results.root)[["cell_id", "step", "setting"]].drop_duplicates(["cell_id", "step"])
        sides.append(ops.merge(settings, on="cell_id").merge(labels, on=["cell_id", "step"], how="left"))
    if sides[0].empty or sides[1].empty:
        return []
    by = keys + ["prompt_id", "step_kind", "step"]
    lines = []
    for key, ops_a in sides[0].groupby(by, sort=True):
        match = sides[1]
        for column, value in zip(by, key):
            match = match[match[column].astype(str) == str(value)]
        if match.empty:
            continue
        setting = str(ops_a["setting"].iloc[0])  # as folder A's own `locate` names it
        for side, who in (("b", "the run"), ("a", "its reference")):
            head = f"{setting or 'every setting'} / {key[len(keys)]} {key[-2]} (step {key[-1]}), {who}'s pass"
            modules_a, modules_b = (f[f["level"] == "module"].sort_values("order") for f in (ops_a, match))
            if modules_a.empty or modules_b.empty:
                continue
            lines.append(f"{head}: " + _first_digest_apart(modules_a, modules_b, f"digest_{side}"))
            inner_a, inner_b = (f[f["level"] == "op"].sort_values("order") for f in (ops_a, match))
            inside = set(inner_a["inside"].dropna()) & set(inner_b["inside"].dropna())
            for module in sorted(inside):
                lines.append(f"{head} inside {module}: " + _first_digest_apart(
                    inner_a[inner_a["inside"] == module], inner_b[inner_b["inside"] == module], f"digest_{side}"))
    return lines


def _first_digest_apart(a: pd.DataFrame, b: pd.DataFrame, column: str) -> str:
    """Where two folders' traces of one pass first part: an op whose digest differs, or ops that differ."""
    for (name_a, op_a, digest_a), (name_b, op_b, digest_b) in zip(
            a[["name", "op", column]].itertuples(index=False), b[["name", "op", column]].itertuples(index=False)):
        if (name_a, op_a) != (name_b, op_b):
            return f"the two folders' passes call different ops: {name_a} ({op_a}) in A, {name_b} ({op_b}) in B"
        if digest_a != digest_b:
            return f"first differs between the folders at {name_a} ({op_a})"
    if len(a) != len(b):
        return f"the passes hold {len(a)} and {len(b)} ops, equal as far as both go"
    return f"every op's output bitwise equal in both folders ({len(a)} ops)"
