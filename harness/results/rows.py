"""Rows in the store's schema: one per target generation, or per prompt and repeat of a cell that did not run."""

from __future__ import annotations

import hashlib
import json
import traceback
from datetime import datetime, timezone
from typing import Any, Iterable

import numpy as np

from harness.core.redaction import redact
from harness.engines.base import BatchOutput
from harness.experiment.matrix import Cell
from harness.experiment.schema import LoadedExperiment
from harness.results.schema import SCHEMA_VERSION


def output_hash(token_ids: list[int]) -> str:
    """Hash of the token-id sequence; equal hashes mean identical outputs."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int32).tobytes(), digest_size=12).hexdigest()


def recorded(values: list[float] | None) -> list[float] | None:
    """Per-step values as the row keeps them: None (null) where the engine gave none at any step (a NaN
    stands for "not given"), never a list of NaNs that later reads as numbers; a step left NaN among
    given ones stays unknown, and readers skip it."""
    if not values or all(v != v for v in values):
        return None
    return values


def logprobs_hash(logprobs: list[float] | None) -> str | None:
    """Hash of the per-step chosen-token log-probabilities as float32 bytes: equal hashes mean
    bitwise-equal log-probabilities. None when the engine gave none, or not at every step: equality
    is judged only on values that were recorded."""
    if not logprobs or any(v != v for v in logprobs):
        return None
    return hashlib.blake2b(np.asarray(logprobs, dtype=np.float32).tobytes(), digest_size=12).hexdigest()


def inter_token_gaps(times: list[float]) -> list[float] | None:
    """The gaps between successive token arrivals; tokens that arrived together (one step of speculative
    decoding) make one gap, not zeros. None where fewer than two times were recorded."""
    if len(times) < 2:
        return None
    gaps = np.diff(np.asarray(times, dtype=np.float64))
    return gaps[gaps > 0].tolist()


def describe_exception(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:2000]


class RowMaker:
    """Builds rows in the store's schema for one experiment run."""

    def __init__(self, loaded: LoadedExperiment, run_id: str, prov: dict[str, Any]) -> None:
        self.loaded = loaded
        self.exp = loaded.experiment
        self.run_id = run_id
        self.prov = prov

    @staticmethod
    def engine_columns(info: dict[str, Any]) -> dict[str, Any]:
        """The row columns taken from an engine's describe(); computed once per engine load."""
        return {
            "model_file": info.get("model_file", ""),
            "model_sha256": info.get("model_sha256", ""),
            "engine_version": info.get("engine_version", ""),
            "cpu_kernels": info.get("cpu_kernels", ""),
            "engine_info": json.dumps(
                {k: v for k, v in info.items() if k not in ("engine_version", "model_file", "model_sha256", "cpu_kernels")},
                sort_keys=True,
            ),
        }

    def base(self, cell: Cell, prompt_id: str, repeat: int, engine_cols: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "experiment": self.exp.name,
            "run_id": self.run_id,
            "cell_id": cell.id,
            "group_id": cell.group_id,
            "prompt_id": prompt_id,
            "repeat": repeat,
            **cell.as_dict,
            "max_tokens": self.exp.max_tokens,
            "engine_options": json.dumps(redact(dict(cell.engine_options)), sort_keys=True),
            **engine_cols,
            "started_at": datetime.now(timezone.utc),
            **self.prov,
        }

    def status_rows(self, cell: Cell, status: str, error: str) -> list[dict]:
        """Rows for a cell that did not run: one per prompt and repeat, so counts stay honest."""
        engine_cols = self.engine_columns({})
        return [
            self.base(cell, p.id, r, engine_cols) | {"status": status, "error": error}
            for p in self.loaded.prompt_set.prompts
            for r in range(self.exp.repeats)
        ]

    @staticmethod
    def ok(base: dict[str, Any], out: BatchOutput) -> dict[str, Any]:
        t = out.target
        n = len(t.token_ids)
        return base | {
            "status": "ok",
            "error": "",
            "prompt_tokens": out.prompt_tokens,
            "cached_tokens": out.cached_tokens,
            "preemptions": out.preemptions,
            "batch_preemptions": out.batch_preemptions,
            "draft_proposed": out.draft_proposed,
            "draft_accepted": out.draft_accepted,
            "token_ids": t.token_ids,
            "n_tokens": n,
            "text": t.text,
            "token_texts": t.token_texts or None,
            "finish_reason": t.finish_reason,
            "output_hash": output_hash(t.token_ids),
            "logprobs": recorded(t.logprobs),
            "margins": recorded(t.margins),
            "logprobs_hash": logprobs_hash(t.logprobs),
            "prefill_s": out.prefill_s,
            "ttft_s": out.ttft_s if out.ttft_s is not None or not out.token_times else out.token_times[0],
            "itl_s": inter_token_gaps(out.token_times),
            "decode_s": None if out.prefill_s is None else out.target_s - out.prefill_s,
            "wall_s": out.wall_s,
            "target_tokens_per_s": n / out.target_s if out.target_s > 0 else None,
            "batch_tokens_per_s": out.batch_generated_tokens / out.wall_s if out.wall_s > 0 else None,
            "engine_detail": json.dumps(out.detail, sort_keys=True, default=str),
        }


def auto_fallbacks(engine_info: Iterable[Any]) -> list[str]:
    """Lines for the loads whose engine chose a setting by itself and said why (llama.cpp's
    `extra_bufts: auto` turning the AMX kernels off on a CPU where they crash), from the rows'
    engine_info: the run prints it once, and `status` and the summary repeat it."""
    said: dict[str, None] = {}
    for text in set(engine_info):
        try:
            info = json.loads(text) if isinstance(text, str) and text else {}
        except ValueError:
            continue
        choice = str(info.get("extra_bufts", "")) if isinstance(info, dict) else ""
        if choice.startswith("off (auto:"):
            said[f"note: llama.cpp's extra buffer types were off in these rows: {choice[5:-1]}"] = None
    return sorted(said)
