"""Deterministic generator of the bundled arithmetic questions, for GRPO demos (`format: prompt_answer`).

Each row asks one sum, {"prompt": "What is 17 + 25? Give the number after ####.", "answer": "42",
"category": "addition"}: two-number additions and subtractions of numbers under 100 (a
difference never negative), and a few products of numbers up to 12. The answer is a number, so
the reward `exact_answer` checks any sampled answer exactly, and the tasks are easy enough that
a tiny model sampling answers finds some right and learns from them within minutes.

    python -m jaxtune.offline.arithmetic [--out PATH] [--rows N] [--seed S]
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxtune.offline.dataset import generator_main

DEFAULT_PATH = Path(__file__).parent / "data" / "arithmetic_offline.jsonl"
DEFAULT_ROWS = 2000
DEFAULT_SEED = 0
PROMPT = "What is {a} {op} {b}? Give the number after ####."
MAX_TRIES_PER_ROW = 1000

Row = dict[str, str]


def addition(rng: random.Random) -> tuple[int, str, int, int]:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return a, "+", b, a + b


def subtraction(rng: random.Random) -> tuple[int, str, int, int]:
    """The larger number first: a negative answer would be a harder task than the rest."""
    a, b = sorted((rng.randint(1, 99), rng.randint(1, 99)), reverse=True)
    return a, "-", b, a - b


def multiplication(rng: random.Random) -> tuple[int, str, int, int]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return a, "*", b, a * b


GENERATORS: dict[str, Callable[[random.Random], tuple[int, str, int, int]]] = {
    "addition": addition,
    "subtraction": subtraction,
    "multiplication": multiplication,
}
# One row in twenty is a product: 121 of them exist, and 2,000 rows take 100.
CYCLE = ("addition", "subtraction") * 9 + ("addition", "multiplication")


def make_row(category: str, rng: random.Random) -> Row:
    a, op, b, answer = GENERATORS[category](rng)
    return {"prompt": PROMPT.format(a=a, op=op, b=b), "answer": str(answer), "category": category}


def generate_rows(n_rows: int = DEFAULT_ROWS, seed: int = DEFAULT_SEED) -> list[Row]:
    """`n_rows` rows, categories in CYCLE's order, no prompt repeated (so none is dropped as a
    duplicate, and no eval prompt is a train prompt)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    for i in range(n_rows):
        category = CYCLE[i % len(CYCLE)]
        for _ in range(MAX_TRIES_PER_ROW):
            row = make_row(category, rng)
            if row["prompt"] not in seen:
                break
        else:
            raise ValueError(f"could not find a new {category} question after {MAX_TRIES_PER_ROW} tries")
        seen.add(row["prompt"])
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> Path:
    """Command line entry: generate rows and write them to --out (the bundled file by default)."""
    return generator_main(
        "jaxtune.offline.arithmetic",
        __doc__.splitlines()[0],
        generate_rows,
        DEFAULT_PATH,
        DEFAULT_ROWS,
        DEFAULT_SEED,
        argv,
    )


if __name__ == "__main__":
    main()
