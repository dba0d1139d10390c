"""The within_noise test's power and level, by seeded simulation: how often a setting is called
within_noise (harness.analysis.guarantees.excess_upper at or below the margin, against a floor that
departs) when its runs truly depart as often as the floor's (power), and when they depart more often by
more than the margin (level: it must stay at or below 5 %). Prints a Markdown table for
docs/statistics.md.

    python scripts/noise_power.py                 # prompts 5..100 x repeats 5..50, 400 folders a point
    python scripts/noise_power.py --folders 100   # quicker

Each prompt's floor rate is drawn once per folder: zero for 60 % of prompts (most prompts of a
determinism run never depart), uniform up to 30 % for the rest; the setting's rate is the floor's
plus the excess."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.analysis import guarantees


def share(prompts: int, repeats: int, excess: float, folders: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    called = 0
    for _ in range(folders):
        floor = np.where(rng.random(prompts) < 0.6, 0.0, rng.uniform(0.0, 0.3, size=prompts))
        d0 = rng.binomial(repeats, floor)
        d1 = rng.binomial(repeats, np.clip(floor + excess, 0, 1))
        n = np.full(prompts, repeats)
        if d0.sum():
            called += guarantees.excess_upper(d1, n, d0, n) <= guarantees.NOISE_MARGIN
    return called / folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", type=int, default=400)
    args = parser.parse_args()
    prompts, repeats = (5, 10, 20, 35, 50, 100), (5, 10, 20, 50)
    print(f"share of folders called within_noise (margin {guarantees.NOISE_MARGIN:g}; {args.folders} folders a point)\n")
    print("| prompts | " + " | ".join(f"{r} repeats: equal rates / +0.15" for r in repeats) + " |")
    print("|---|" + "---|" * len(repeats))
    for k in prompts:
        cells = [f"{share(k, r, 0.0, args.folders, k * 100 + r):.0%} / {share(k, r, 0.15, args.folders, k * 100 + r + 7):.0%}"
                 for r in repeats]
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
