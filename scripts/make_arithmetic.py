"""Write a set of arithmetic word problems with exact answers (seeded: the same seed, the same set).

    python scripts/make_arithmetic.py --count 100 --seed 0 > prompts/arithmetic.yaml

Each problem is one or two steps of +, -, x or exact division over small whole numbers, phrased
as a short story, and asks for the number alone. Written for this project; no data set is read.
"""

from __future__ import annotations

import argparse
import random
import sys

import yaml

NAMES = ["Mia", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aiko", "Ben", "Chloe", "Diego", "Ella", "Farid"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "shells", "cards", "stamps", "buttons"]


def _problem(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(3, 90), rng.randint(2, 60)
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(20, 150)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {thing} and gave {b} of them to {other}. How many {thing} does {name} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 15)
        return f"{name} fills {a} boxes with {b} {thing} each. How many {thing} are in the boxes altogether?", a * b
    if kind == 3:
        b, q = rng.randint(2, 9), rng.randint(2, 14)
        return (f"{name} shares {b * q} {thing} equally among {b} friends. How many {thing} does each friend "
                "get?", q)
    if kind == 4:
        a, b, c = rng.randint(10, 60), rng.randint(2, 30), rng.randint(1, 9)
        return (f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have "
                "now?", a + b - c)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    return (f"{name} buys {a} packs of {thing} with {b} in each pack, and {other} gives {name} {c} more. How many "
            f"{thing} does {name} have?", a * b + c)


def problems(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text, answer = _problem(rng)
        out.append({"id": f"arith-{i:03d}", "text": f"{text} Answer with the number only.", "answer": answer})
    return out


FILLERS = [
    "Name three colors.", "What is the capital of France?", "Write one sentence about the sea.",
    "List two fruits.", "What day comes after Monday?", "Say hello in Spanish.",
    "Give a synonym for happy.", "How many legs does a spider have?",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    head = (f"# {args.count} arithmetic word problems with exact answers, made by scripts/make_arithmetic.py "
            f"--count {args.count} --seed {args.seed}.\n# The last number in an output is its answer.\n")
    body = yaml.safe_dump({"parse": "number", "prompts": problems(args.count, args.seed), "fillers": FILLERS},
                          sort_keys=False, allow_unicode=True, width=200)
    sys.stdout.write(head + body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
