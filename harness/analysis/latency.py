"""Serving latency of a setting: time to first token, inter-token latency, time per output token and
end-to-end latency at p50/p90/p99, as serving benchmarks report them.

The definitions are those of vLLM's serving benchmark (`vllm bench serve`), per target request:
- TTFT (`ttft`): from sending the request to its first output token (the row's `ttft_s`);
- TPOT (`tpot`): (end-to-end latency - TTFT) / (output tokens - 1); a request of one token has none;
- ITL (`itl`): every gap between two successive output tokens as the caller received them (the row's
  `itl_s`; a step that delivers several tokens at once, as speculative decoding does, is one gap),
  pooled over the requests;
- E2EL (`e2el`): from sending the request to its last output token.
Percentiles are numpy's linear interpolation, over requests (TTFT, TPOT, E2EL) or gaps (ITL). A
metric an engine does not report (ITL from an engine that hands the output over only at the end) is
NaN, never zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

METRICS = ("ttft", "itl", "tpot", "e2el")
PERCENTILES = (50, 90, 99)
#: the row columns the metrics read
COLUMNS = ("ttft_s", "itl_s", "n_tokens", "target_tokens_per_s")
#: how each metric is written in tables and messages
TITLES = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2el": "E2EL"}


def columns(metric: str, percentile: int) -> str:
    """The column of one metric at one percentile ('tpot_p99')."""
    return f"{metric}_p{percentile}"


def samples(rows: pd.DataFrame, metric: str, suffix: str = "") -> np.ndarray:
    """The metric's samples in seconds from rows of one setting (`suffix`: of one side of a pairing)."""
    tokens = rows[f"n_tokens{suffix}"].to_numpy(dtype=float)
    rate = rows[f"target_tokens_per_s{suffix}"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        e2el = np.where(rate > 0, tokens / rate, np.nan)
    ttft = rows[f"ttft_s{suffix}"].to_numpy(dtype=float) if f"ttft_s{suffix}" in rows else np.full(len(rows), np.nan)
    if metric == "ttft":
        values = ttft
    elif metric == "e2el":
        values = e2el
    elif metric == "tpot":
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(tokens > 1, (e2el - ttft) / (tokens - 1), np.nan)
    elif metric == "itl":
        gaps = rows[f"itl_s{suffix}"] if f"itl_s{suffix}" in rows else []
        parts = [np.asarray(g, dtype=float) for g in gaps if g is not None and not _missing(g) and len(g)]
        values = np.concatenate(parts) if parts else np.empty(0)
    else:
        raise ValueError(f"unknown latency metric '{metric}'; allowed: {', '.join(METRICS)}")
    return values[np.isfinite(values)]


def _missing(value: Any) -> bool:
    return isinstance(value, float) and np.isnan(value)


def percentiles(rows: pd.DataFrame, suffix: str = "") -> dict[str, float]:
    """Every metric at every percentile, in seconds (NaN where no sample was recorded)."""
    out: dict[str, float] = {}
    for metric in METRICS:
        values = samples(rows, metric, suffix)
        for p in PERCENTILES:
            out[columns(metric, p)] = float(np.percentile(values, p)) if values.size else float("nan")
    return out


def compared(off: dict[str, float], on: dict[str, float], names: tuple[str, str] = ("off", "on")) -> dict[str, float]:
    """Both sides' percentiles and their ratios, on / off (above 1: the second setting is slower)."""
    out: dict[str, float] = {}
    for key in off:
        a, b = off[key], on[key]
        out[f"{key}_{names[0]}"] = a
        out[f"{key}_{names[1]}"] = b
        out[f"{key}_ratio"] = b / a if a > 0 else float("nan")
    return out


def long_form(table: pd.DataFrame, keys: list[str], sides: tuple[str, str] = ("off", "on")) -> pd.DataFrame:
    """A table with `{metric}_p{p}_{side}` and `{metric}_p{p}_ratio` columns as one row per setting and
    metric (p50/p90/p99 of each side in milliseconds, and the ratios), for the terminal."""
    import pandas as pd

    records = []
    for record in table.to_dict("records"):
        for metric in METRICS:
            row = {k: record[k] for k in keys} | {"metric": TITLES[metric]}
            for side in sides:
                for p in PERCENTILES:
                    row[f"p{p}_{side}_ms"] = 1000 * record.get(f"{columns(metric, p)}_{side}", float("nan"))
            for p in PERCENTILES:
                row[f"p{p}_ratio"] = record.get(f"{columns(metric, p)}_ratio", float("nan"))
            records.append(row)
    return pd.DataFrame(records)


def by_setting(rows: pd.DataFrame, keys: list[str], reference: dict[str, Any]) -> pd.DataFrame:
    """Per setting: its runs' latency percentiles, and their ratios against the reference setting (the
    same setting with the reference's axes at the reference's values, measured in the same folder);
    the ratio is NaN where that setting has no runs. Only ok runs count."""
    import pandas as pd

    ok = rows[rows["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame(columns=keys + ["runs"])
    own = {key if isinstance(key, tuple) else (key,): (len(part), percentiles(part))
           for key, part in ok.groupby(keys, dropna=False, sort=True)}
    records = []
    for key, (runs, values) in own.items():
        setting = dict(zip(keys, key))
        ref_key = tuple(reference.get(k, setting[k]) for k in keys)
        ref = own.get(ref_key, (0, {}))[1]
        record = setting | {"runs": runs} | values
        for name, value in values.items():
            base = ref.get(name, float("nan"))
            record[f"{name}_ratio"] = value / base if base > 0 else float("nan")
        records.append(record)
    return pd.DataFrame(records)
