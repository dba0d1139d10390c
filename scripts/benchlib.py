"""Shared by the overhead benchmarks: alternate a bare run and the harness's, report the ratio."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def alternate(bare: Callable[[], int], harness: Callable[[], int], rounds: int) -> tuple[list[float], list[float]]:
    """Tokens/s of each side, round by round in turn, so drift on the machine hits both alike.

    Each callable runs one batch and returns how many tokens it generated.
    """
    rates: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for side, run in zip(rates, (bare, harness)):
            t0 = time.perf_counter()
            tokens = run()
            side.append(tokens / (time.perf_counter() - t0))
    return rates


HEADER = f"{'N':>3} {'bare tok/s':>11} {'harness tok/s':>14} {'ratio':>6} {'best/best':>9}"


def row(n: int, bare: list[float], mine: list[float]) -> str:
    b, m = statistics.median(bare), statistics.median(mine)
    return (f"{n:>3} {b:>11.1f} {m:>14.1f} {m / b:>6.3f} {max(mine) / max(bare):>9.3f}"
            f"   spread bare {min(bare):.1f}-{max(bare):.1f}, harness {min(mine):.1f}-{max(mine):.1f}")
