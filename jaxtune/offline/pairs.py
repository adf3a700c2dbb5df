"""Deterministic preference pairs built from the bundled offline rows, for DPO and SimPO demos.

Each row's answer is the chosen one. The rejected answer is the same answer with one entity
swapped for another of its kind (a name, town, job, colour, object, animal, shop or animal
class): the answer's last entity, which is the one the question asks for in most templates,
replaced by a word of the same kind that the prompt mentions (a distractor a careless reader
would pick) or, if it mentions none, by a seeded choice from the word list. Plausible, and
wrong by one word: a model prefers the chosen answer only if it reads the prompt.

    python -m jaxtune.offline.pairs [--out PATH] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

from jaxtune.offline import dataset

DEFAULT_PATH = Path(__file__).parent / "data" / "preference_offline.jsonl"
KINDS = (
    dataset.NAMES,
    dataset.TOWNS,
    dataset.JOBS,
    dataset.COLOURS,
    dataset.OBJECTS,
    dataset.ANIMALS,
    dataset.SHOPS,
    dataset.ANIMAL_CLASS_NAMES,
)
KIND_OF = {word: kind for kind in KINDS for word in kind}
WORD = re.compile(r"[A-Za-z]+")


def prompt_of(row: dict) -> str:
    """The user turn a Dolly row becomes (`jaxtune.data.rows.normalize_row`): instruction, then context."""
    return f"{row['instruction']}\n\n{row['context']}" if row["context"] else row["instruction"]


def rejected_answer(row: dict, rng: random.Random) -> str | None:
    """The answer with its last entity swapped (see the module docstring); None if it names none."""
    matches = [m for m in WORD.finditer(row["response"]) if m.group() in KIND_OF]
    if not matches:
        return None
    target = matches[-1]
    kind = KIND_OF[target.group()]
    in_answer = {m.group() for m in matches}
    prompt_words = [
        w for w in dict.fromkeys(WORD.findall(prompt_of(row))) if KIND_OF.get(w) is kind and w not in in_answer
    ]
    others = prompt_words or [w for w in kind if w not in in_answer]
    swap = rng.choice(others)
    return row["response"][: target.start()] + swap + row["response"][target.end() :]


def generate_pairs(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """A pair per row whose answer names an entity: {prompt, chosen, rejected, category}."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        rejected = rejected_answer(row, rng)
        if rejected is not None and rejected != row["response"]:
            pairs.append(
                {"prompt": prompt_of(row), "chosen": row["response"], "rejected": rejected, "category": row["category"]}
            )
    return pairs


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m jaxtune.offline.pairs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH, help="output .jsonl path")
    parser.add_argument("--seed", type=int, default=0, help="seed of the swaps")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in dataset.DEFAULT_PATH.read_text(encoding="utf-8").splitlines()]
    return dataset.write_jsonl(generate_pairs(rows, args.seed), args.out)


if __name__ == "__main__":
    main()
