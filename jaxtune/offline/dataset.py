"""Deterministic generator of the bundled Dolly-15k-schema instruction data.

Every answer is copied from the prompt or read off a small fixed table that the training
rows teach many times over, so a tiny model trained from scratch can learn the tasks and
exact match on held-out rows is a meaningful score.

    python -m jaxtune.offline.dataset --out PATH [--rows N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

DEFAULT_PATH = Path(__file__).parent / "data" / "dolly_offline.jsonl"
DEFAULT_ROWS = 6000
DEFAULT_SEED = 0
FIELDS = ("instruction", "context", "response", "category")

# Small fixed word lists: the tokenizer trained on this file sees every word many times,
# and no word belongs to two lists, so the kind of a word never depends on its context.
NAMES = (
    "Tova",
    "Kasi",
    "Mira",
    "Brin",
    "Oska",
    "Lune",
    "Dara",
    "Fenn",
    "Ilka",
    "Jori",
    "Nilo",
    "Pema",
    "Quin",
    "Rhea",
    "Sami",
    "Teo",
    "Ulla",
    "Vesa",
    "Wren",
    "Yara",
    "Zeno",
    "Aldo",
    "Bea",
    "Cato",
    "Edda",
    "Gus",
    "Hedy",
    "Ivo",
    "Juna",
    "Koby",
    "Lior",
    "Mako",
    "Nell",
    "Odo",
    "Pia",
    "Rune",
    "Sela",
    "Tam",
    "Uma",
    "Vito",
)
TOWNS = (
    "Brell",
    "Orum",
    "Dunmar",
    "Kessa",
    "Valo",
    "Tarn",
    "Ashby",
    "Corin",
    "Elmfield",
    "Fallow",
    "Glenna",
    "Harrow",
    "Istra",
    "Jundle",
    "Kelby",
    "Lorne",
    "Marrow",
    "Nessa",
    "Oakmere",
    "Pellin",
    "Quarry",
    "Rillton",
    "Selby",
    "Thorn",
    "Umber",
    "Varna",
    "Westby",
    "Yarrow",
    "Zenda",
    "Moss",
)
JOBS = (
    "baker",
    "farmer",
    "teacher",
    "painter",
    "doctor",
    "sailor",
    "miner",
    "potter",
    "weaver",
    "tailor",
    "singer",
    "pilot",
    "nurse",
    "cook",
    "smith",
    "clerk",
)
COLOURS = (
    "red",
    "blue",
    "green",
    "yellow",
    "orange",
    "purple",
    "black",
    "white",
    "grey",
    "brown",
    "pink",
    "silver",
)
OBJECTS = (
    "lamp",
    "kettle",
    "drum",
    "boat",
    "kite",
    "clock",
    "bell",
    "hat",
    "cup",
    "chair",
    "book",
    "coat",
    "ring",
    "vase",
    "key",
    "map",
    "flute",
    "rope",
    "sled",
    "basket",
)
SHOPS = ("bakery", "bookshop", "cafe", "florist", "toyshop", "tearoom", "pharmacy", "gallery")

ANIMAL_CLASS_NAMES = ("mammal", "bird", "fish", "reptile")
ANIMAL_CLASSES: dict[str, str] = {
    **dict.fromkeys(("cat", "dog", "fox", "horse", "goat", "mouse", "bear", "rabbit"), "mammal"),
    **dict.fromkeys(("owl", "crow", "duck", "robin", "eagle", "swan", "parrot", "hawk"), "bird"),
    **dict.fromkeys(("trout", "salmon", "carp", "cod", "tuna", "pike", "eel", "perch"), "fish"),
    **dict.fromkeys(("lizard", "snake", "turtle", "gecko", "iguana", "tortoise", "crocodile", "cobra"), "reptile"),
}
ANIMALS = tuple(ANIMAL_CLASSES)
# The poem task reuses the class table, so it rewards knowing the table rather than guessing.
CLASS_VERBS = {"mammal": "runs", "bird": "sings", "fish": "swims", "reptile": "rests"}

Row = dict[str, str]

# Every answer starts with a name, an animal or a fixed word. A byte-level BPE
# trained on this file splits a town or job without its leading space into rare pieces,
# and a tiny model copies " Brell" from the prompt far more easily than it spells "Brell".


def with_article(phrase: str) -> str:
    """`phrase` preceded by "a" or "an"; every listed word that starts with a vowel is pronounced so."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def join_and(items: Sequence[str]) -> str:
    """English list: "x", "x and y", "x, y and z"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def make_row(category: str, instruction: str, response: str, context: str = "") -> Row:
    """One row in Dolly's schema and key order."""
    return {"instruction": instruction, "context": context, "response": response, "category": category}


# relation -> (value pool, fact sentence, question); the fact uses `a_value` where English needs an article.
RELATIONS = {
    "town": (TOWNS, "{name} lives in {value}.", "Where does {name} live?"),
    "job": (JOBS, "{name} works as {a_value}.", "What does {name} work as?"),
    "pet": (ANIMALS, "{name} owns {a_value}.", "What animal does {name} own?"),
    "colour": (COLOURS, "{name}'s favourite colour is {value}.", "What is {name}'s favourite colour?"),
}


def closed_qa(rng: random.Random) -> Row:
    """One fact of each relation about four people; the answer is the fact asked about, copied from the context."""
    # Facts keep the table's order, so each relation sits at a steady place a small model can find.
    names = rng.sample(NAMES, len(RELATIONS))
    facts = []
    for name, (pool, fact, _) in zip(names, RELATIONS.values()):
        value = rng.choice(pool)
        facts.append(fact.format(name=name, value=value, a_value=with_article(value)))
    asked = rng.randrange(len(RELATIONS))
    question = list(RELATIONS.values())[asked][2].format(name=names[asked])
    return make_row("closed_qa", question, facts[asked], " ".join(facts))


OPEN_QA_PROMPTS = ("Which of these animals is a {cls}: {items}?", "Name the {cls} in this list: {items}.")


def open_qa(rng: random.Random) -> Row:
    """Pick the one animal of a class from a short list: a lookup in ANIMAL_CLASSES plus a copy."""
    cls = rng.choice(ANIMAL_CLASS_NAMES)
    answer = rng.choice([a for a in ANIMALS if ANIMAL_CLASSES[a] == cls])
    others = rng.sample([a for a in ANIMALS if ANIMAL_CLASSES[a] != cls], rng.choice((2, 3)))
    items = [answer, *others]
    rng.shuffle(items)
    instruction = rng.choice(OPEN_QA_PROMPTS).format(cls=cls, items=", ".join(items))
    return make_row("open_qa", instruction, answer)


def general_qa(rng: random.Random) -> Row:
    """Two people each have a coloured object; ask who has one object, or what colour one is."""
    names, colours, objects = rng.sample(NAMES, 2), rng.sample(COLOURS, 2), rng.sample(OBJECTS, 2)
    things = [with_article(f"{c} {o}") for c, o in zip(colours, objects)]
    story = f"{names[0]} has {things[0]} and {names[1]} has {things[1]}."
    i = rng.randrange(2)
    if rng.random() < 0.5:
        question, answer = f"Who has the {objects[i]}?", names[i]
    else:
        question, answer = f"What colour is {names[i]}'s {objects[i]}?", f"{names[i]}'s {objects[i]} is {colours[i]}."
    return make_row("general_qa", f"{story} {question}", answer)


CLASSIFY_PROMPTS = (
    "Classify each animal as mammal, bird, fish or reptile: {items}",
    "Sort these animals into mammal, bird, fish or reptile: {items}",
)


def classification(rng: random.Random) -> Row:
    """Label two animals from ANIMAL_CLASSES, in the order given."""
    # Two items: longer lists mostly test copying the list, which the tiny model learns late.
    animals = rng.sample(ANIMALS, 2)
    instruction = rng.choice(CLASSIFY_PROMPTS).format(items=", ".join(animals))
    response = ", ".join(f"{a}: {ANIMAL_CLASSES[a]}" for a in animals)
    return make_row("classification", instruction, response)


EXTRACTION_VERBS = ("packed", "bought", "found")
EXTRACTIONS = (
    ("List the colours mentioned in the text.", "colours"),
    ("List the items mentioned in the text.", "items"),
    ("Where does the text take place?", "place"),
    ("Who is mentioned in the text?", "name"),
)


def information_extraction(rng: random.Random) -> Row:
    """A sentence naming a town, a person and coloured objects; extract one kind, in text order."""
    name, town = rng.choice(NAMES), rng.choice(TOWNS)
    colours, objects = rng.sample(COLOURS, 2), rng.sample(OBJECTS, 2)
    items = join_and([with_article(f"{c} {o}") for c, o in zip(colours, objects)])
    text = f"In {town}, {name} {rng.choice(EXTRACTION_VERBS)} {items}."
    instruction, kind = rng.choice(EXTRACTIONS)
    answers = {"colours": f"The colours are {join_and(colours)}.", "items": items, "place": f"In {town}", "name": name}
    return make_row("information_extraction", instruction, answers[kind], text)


SUMMARY_PROMPTS = (
    "Summarize this record in one sentence.",
    "Write one sentence that summarizes this record.",
    "Describe this person in one sentence.",
)


def summarization(rng: random.Random) -> Row:
    """A person record, as fields or as short sentences, summarized by one fixed template."""
    # No ages or other numbers: digit tokens are copied far less reliably than words.
    name, town, job, pet = rng.choice(NAMES), rng.choice(TOWNS), rng.choice(JOBS), rng.choice(ANIMALS)
    if rng.random() < 0.5:
        context = f"Name: {name}. City: {town}. Job: {job}. Pet: {pet}."
    else:
        context = f"{name} lives in {town}. {name} works as {with_article(job)}. {name} owns {with_article(pet)}."
    response = f"{name} is {with_article(job)} from {town} with a pet {pet}."
    return make_row("summarization", rng.choice(SUMMARY_PROMPTS), response, context)


def creative_writing(rng: random.Random) -> Row:
    """A one-line poem about an animal or an object, or a shop slogan, each from a fixed template."""
    name, colour, town = rng.choice(NAMES), rng.choice(COLOURS), rng.choice(TOWNS)
    kind = rng.randrange(3)
    if kind == 0:
        animal = rng.choice(ANIMALS)
        instruction = f"Write a one-line poem about {with_article(f'{colour} {animal}')} in {town}."
        response = f"In {town} the {colour} {animal} {CLASS_VERBS[ANIMAL_CLASSES[animal]]}."
    elif kind == 1:
        # Object words are copied in few other answers; this template gives that copy easy practice.
        thing = rng.choice(OBJECTS)
        instruction = f"Write a one-line poem about {name}'s {colour} {thing}."
        response = f"{name} loves the {colour} {thing} most of all."
    else:
        shop = rng.choice(SHOPS)
        instruction = f"Write a slogan for {name}'s {shop} in {town}."
        response = f"Come to {name}'s {shop}, the best in {town}!"
    return make_row("creative_writing", instruction, response)


def brainstorming(rng: random.Random) -> Row:
    """Two suggested names for a shop or a pet, built from words of the instruction."""
    name = rng.choice(NAMES)
    if rng.random() < 0.5:
        shop, town = rng.choice(SHOPS), rng.choice(TOWNS)
        instruction = f"Suggest two names for {name}'s new {shop} in {town}."
        response = f"{name}'s {shop} and The {town} {shop}"
    else:
        colour, animal = rng.choice(COLOURS), rng.choice(ANIMALS)
        instruction = f"Suggest two pet names for {name}'s {colour} {animal}."
        response = f"Little {colour} and Sir {animal}"
    return make_row("brainstorming", instruction, response)


GENERATORS: dict[str, Callable[[random.Random], Row]] = {
    "closed_qa": closed_qa,
    "open_qa": open_qa,
    "general_qa": general_qa,
    "classification": classification,
    "information_extraction": information_extraction,
    "summarization": summarization,
    "creative_writing": creative_writing,
    "brainstorming": brainstorming,
}
CATEGORIES = tuple(GENERATORS)
MAX_TRIES_PER_ROW = 1000


def generate_rows(n_rows: int = DEFAULT_ROWS, seed: int = DEFAULT_SEED) -> list[Row]:
    """`n_rows` rows, categories in round robin, no (instruction, context) pair repeated."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    rows = []
    for i in range(n_rows):
        category = CATEGORIES[i % len(CATEGORIES)]
        for _ in range(MAX_TRIES_PER_ROW):
            row = GENERATORS[category](rng)
            key = (row["instruction"], row["context"])
            if key not in seen:
                break
        else:
            raise ValueError(f"could not find a new {category} row after {MAX_TRIES_PER_ROW} tries")
        seen.add(key)
        rows.append(row)
    return rows


def write_jsonl(rows: Iterable[Row], path: str | Path) -> Path:
    """Write one JSON object per line with "\\n" endings, so the bytes depend only on the rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n" for row in rows)
    path.write_bytes(text.encode("utf-8"))
    return path


def generator_main(
    module: str,
    description: str,
    generate: Callable[[int, int], list],
    path: Path,
    rows: int,
    seed: int,
    argv: Sequence[str] | None = None,
) -> Path:
    """The command line of a bundled file's generator (`python -m MODULE`): `generate(rows, seed)`'s
    rows written to --out (the bundled file by default)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--out", type=Path, default=path, help="output .jsonl path")
    parser.add_argument("--rows", type=int, default=rows, help="number of rows")
    parser.add_argument("--seed", type=int, default=seed, help="seed of the generator")
    args = parser.parse_args(argv)
    return write_jsonl(generate(args.rows, args.seed), args.out)


def main(argv: Sequence[str] | None = None) -> Path:
    """Command line entry: generate rows and write them to --out (the bundled file by default)."""
    return generator_main(
        "jaxtune.offline.dataset",
        __doc__.splitlines()[0],
        generate_rows,
        DEFAULT_PATH,
        DEFAULT_ROWS,
        DEFAULT_SEED,
        argv,
    )


if __name__ == "__main__":
    main()
