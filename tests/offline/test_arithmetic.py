"""The bundled arithmetic questions: reproducible, small, and every answer right."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from jaxtune.data.rows import OFFLINE_ARITHMETIC
from jaxtune.offline import arithmetic

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Give the number after ####\.")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in OFFLINE_ARITHMETIC.read_text(encoding="utf-8").splitlines()]


def test_the_bundled_file_is_what_the_generator_writes(tmp_path):
    assert arithmetic.DEFAULT_PATH == OFFLINE_ARITHMETIC
    out = arithmetic.main(["--out", str(tmp_path / "rows.jsonl")])
    assert out.read_bytes() == OFFLINE_ARITHMETIC.read_bytes()


def test_seed_and_row_count_change_the_output():
    assert arithmetic.generate_rows(50, seed=1) != arithmetic.generate_rows(50, seed=2)
    assert arithmetic.generate_rows(50, seed=3) == arithmetic.generate_rows(50, seed=3)
    assert len(arithmetic.generate_rows(37)) == 37


def test_the_file_is_small_plain_jsonl():
    data = OFFLINE_ARITHMETIC.read_bytes()
    assert len(data) <= 250_000 and data.endswith(b"\n") and b"\r" not in data


def test_every_answer_is_the_questions_result(rows):
    operations = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for row in rows:
        assert tuple(row) == ("prompt", "answer", "category")
        a, op, b = QUESTION.fullmatch(row["prompt"]).groups()
        assert row["answer"] == str(operations[op](int(a), int(b)))
        assert int(row["answer"]) >= 0


def test_mostly_sums_and_differences_under_100_some_small_products(rows):
    assert len(rows) == arithmetic.DEFAULT_ROWS == 2000
    assert len({row["prompt"] for row in rows}) == len(rows)
    assert Counter(row["category"] for row in rows) == {"addition": 1000, "subtraction": 900, "multiplication": 100}
    for row in rows:
        a, op, b = QUESTION.fullmatch(row["prompt"]).groups()
        limit = 12 if op == "*" else 99
        assert 1 <= int(a) <= limit and 1 <= int(b) <= limit
