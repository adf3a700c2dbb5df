"""The bundled offline dataset: reproducible, well-formed, balanced, and exactly checkable."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from jaxtune.offline import dataset
from jaxtune.offline.dataset import ANIMAL_CLASSES, COLOURS, DEFAULT_PATH, FIELDS, NAMES, OBJECTS, TOWNS

MAX_ANSWER_SHARE = 0.10


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with DEFAULT_PATH.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def by_category(rows: list[dict], category: str) -> list[dict]:
    picked = [r for r in rows if r["category"] == category]
    assert picked, f"no {category} rows"
    return picked


def max_answer_share(rows: list[dict]) -> float:
    return Counter(r["response"] for r in rows).most_common(1)[0][1] / len(rows)


def test_cli_defaults_reproduce_the_committed_file(tmp_path):
    out = dataset.main(["--out", str(tmp_path / "rows.jsonl")])
    assert out.read_bytes() == DEFAULT_PATH.read_bytes()


def test_generate_and_write_reproduce_the_committed_file(tmp_path):
    out = dataset.write_jsonl(dataset.generate_rows(), tmp_path / "rows.jsonl")
    assert out.read_bytes() == DEFAULT_PATH.read_bytes()


def test_seed_and_row_count_change_the_output():
    assert dataset.generate_rows(50, seed=1) != dataset.generate_rows(50, seed=2)
    assert dataset.generate_rows(50, seed=3) == dataset.generate_rows(50, seed=3)
    assert len(dataset.generate_rows(37)) == 37


def test_file_is_plain_jsonl_within_size_limit():
    data = DEFAULT_PATH.read_bytes()
    assert 500_000 <= len(data) <= 2_000_000
    assert data.endswith(b"\n") and b"\r" not in data


def test_schema(rows):
    assert len(rows) == dataset.DEFAULT_ROWS
    for row in rows:
        assert tuple(row) == FIELDS
        assert all(isinstance(row[k], str) for k in FIELDS)
        assert row["instruction"].strip() and row["response"].strip()


def test_answers_are_short(rows):
    assert all(1 <= len(r["response"].split()) <= 12 for r in rows)


def test_categories_are_dolly_and_balanced(rows):
    counts = Counter(r["category"] for r in rows)
    dolly = {
        "closed_qa",
        "open_qa",
        "general_qa",
        "classification",
        "information_extraction",
        "summarization",
        "creative_writing",
        "brainstorming",
    }
    assert set(counts) <= dolly
    assert len(counts) >= 6
    assert min(counts.values()) >= 0.10 * len(rows)


def test_prompts_are_unique(rows):
    prompts = Counter((r["instruction"], r["context"]) for r in rows)
    assert prompts.most_common(1)[0][1] == 1


def test_no_answer_dominates(rows):
    assert max_answer_share(rows) <= MAX_ANSWER_SHARE
    subset = random.Random(1234).sample(rows, len(rows) // 10)
    assert max_answer_share(subset) <= MAX_ANSWER_SHARE
    for category in set(r["category"] for r in rows):
        assert max_answer_share(by_category(rows, category)) <= MAX_ANSWER_SHARE


def test_closed_qa_answers_repeat_the_fact_asked_about(rows):
    for row in by_category(rows, "closed_qa"):
        facts = re.split(r"(?<=\.) ", row["context"])
        assert row["response"] in facts, row
        (asked_name,) = [w for w in re.findall(r"\w+", row["instruction"]) if w in NAMES]
        assert row["response"].startswith(asked_name), row


def test_general_qa_answers_match_the_story(rows):
    for row in by_category(rows, "general_qa"):
        story, question = row["instruction"].split(". ")
        owners = {thing: (name, colour) for name, colour, thing in re.findall(r"(\w+) has an? (\w+) (\w+)", story)}
        assert len(owners) == 2, row
        thing = re.search(r"(\w+)\?$", question).group(1)
        name, colour = owners[thing]
        expected = name if question.startswith("Who") else f"{name}'s {thing} is {colour}."
        assert row["response"] == expected, row


def test_classification_follows_the_lookup_table(rows):
    for row in by_category(rows, "classification"):
        items = row["instruction"].rsplit(": ", 1)[1].split(", ")
        pairs = [pair.split(": ") for pair in row["response"].split(", ")]
        assert [animal for animal, _ in pairs] == items
        assert all(ANIMAL_CLASSES[animal] == cls for animal, cls in pairs), row


def test_open_qa_names_the_only_animal_of_the_asked_class(rows):
    for row in by_category(rows, "open_qa"):
        cls, listed = re.search(r"(\w+)(?: in this list)?: (.+)[?.]$", row["instruction"]).groups()
        members = [a for a in listed.split(", ") if ANIMAL_CLASSES[a] == cls]
        assert members == [row["response"]], row


def test_extracted_words_appear_in_text_order(rows):
    listed = set(COLOURS + OBJECTS + NAMES + TOWNS)
    for row in by_category(rows, "information_extraction"):
        words = [w for w in re.findall(r"\w+", row["response"]) if w in listed]
        assert words, row
        position = 0
        for word in words:
            match = re.compile(rf"\b{word}\b").search(row["context"], position)
            assert match, row
            position = match.end()


def test_summaries_copy_every_field(rows):
    for row in by_category(rows, "summarization"):
        match = re.fullmatch(r"(\w+) is an? (\w+) from (\w+) with a pet (\w+)\.", row["response"])
        assert match, row
        for word in match.groups():
            assert re.search(rf"\b{word}\b", row["context"]), row
