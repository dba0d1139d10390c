"""The batch-invariant mode's evidence per setting of a results folder: the mode asked for beside what
vLLM reported in force (the kernels on in its model worker, the attention backend it chose, CUDA graphs,
the module the switch was found in) and the start-up it cost. pandas only, so it runs on a node's own
Python; the outcome control (batched runs bitwise equal to the prompt alone) is `harness summarize`'s.

    python3 scripts/vllm_mode_evidence.py RESULTS_DIR
"""

from __future__ import annotations

import glob
import json
import sys

import pandas as pd

ASKED = ["batch_invariant", "batch_size"]
#: settings that split the table too where the folder sweeps them
SWEPT = ["environment", "gpu", "dtype", "model"]
IN_FORCE = ["batch_invariant_active", "attention_backend", "cuda_graphs", "device"]
START_UP = ["load_s", "warmup_s"]


def _reported(info: str) -> dict[str, object]:
    """engine_info's facts about the mode and the attention backend (what vLLM said, read back)."""
    try:
        found = json.loads(info or "{}")
    except ValueError:
        return {}
    return {key: value for key, value in found.items() if "batch_invariant" in key or "attention" in key}


def evidence(folder: str) -> pd.DataFrame:
    """One line per setting: asked, in force (first run's; differing values across runs are listed)."""
    files = sorted(glob.glob(f"{folder}/cells/*.parquet"))
    if not files:
        raise SystemExit(f"{folder}: no cell files under cells/ (has the run written rows?)")
    rows = pd.concat([pd.read_parquet(path) for path in files], ignore_index=True)
    rows = rows[rows["engine"] == "vllm"] if "engine" in rows else rows
    keys = [c for c in SWEPT if c in rows and rows[c].nunique() > 1] + [c for c in ASKED if c in rows]
    out = []
    for key, part in rows.groupby(keys, dropna=False):
        line = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        line["runs"] = len(part)
        line["ok"] = int((part["status"] == "ok").sum()) if "status" in part else len(part)
        for column in IN_FORCE:
            if column in part:
                seen = sorted({str(v) for v in part[column].dropna()})
                line[column] = " | ".join(seen) if seen else "-"
        for column in START_UP:
            if column in part and part[column].notna().any():
                line[column] = round(float(part[column].dropna().iloc[0]), 1)
        if "engine_info" in part:
            for name, value in _reported(part["engine_info"].dropna().iloc[0] if part["engine_info"].notna().any()
                                         else "").items():
                line[name] = value
        out.append(line)
    return pd.DataFrame(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(evidence(sys.argv[1]).to_string(index=False))
