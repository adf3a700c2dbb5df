"""Fixtures for the data layer: a small Dolly-like row generator, file writers and a trained tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer

_SUBJECTS = [
    "the river",
    "a red fox",
    "the old library",
    "python lists",
    "the moon",
    "a bakery",
    "the violin",
    "green tea",
]
_ASKS = ["What is", "Describe", "Tell me about", "Explain", "Summarize what you know about"]
_FACTS = ["is quiet at night", "was built long ago", "has many uses", "is easy to learn", "changes with the seasons"]
# category -> whether rows of it carry a context passage (as in Dolly)
_CATEGORIES = {
    "open_qa": False,
    "closed_qa": True,
    "brainstorming": False,
    "summarization": True,
    "classification": False,
}


def make_dolly_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct Dolly-schema rows (instruction/context/response/category), deterministic for `seed`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        category = list(_CATEGORIES)[i % len(_CATEGORIES)]
        subject = rng.choice(_SUBJECTS)
        context = f"Note {i}: {subject} {rng.choice(_FACTS)}." if _CATEGORIES[category] else ""
        words = " and ".join(rng.choice(_FACTS) for _ in range(rng.randint(1, 6)))  # varied lengths
        rows.append(
            {
                "instruction": f"{rng.choice(_ASKS)} {subject} (item {i})?",
                "context": context,
                "response": f"{subject.capitalize()} {words}.",
                "category": category,
            }
        )
    return rows


@pytest.fixture
def dolly_rows() -> list[dict]:
    return make_dolly_rows(24)


@pytest.fixture
def make_dolly() -> Callable[..., list[dict]]:
    """The row generator itself, for tests that need a particular size or seed."""
    return make_dolly_rows


@pytest.fixture
def write_rows(tmp_path: Path) -> Callable[..., Path]:
    """Write rows to tmp_path/<name>.<ext> as jsonl, json, parquet or csv (lists become JSON text in CSV)."""

    def write(rows: list[dict], ext: str, name: str = "data") -> Path:
        path = tmp_path / f"{name}.{ext}"
        if ext == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        elif ext == "json":
            path.write_text(json.dumps(rows), encoding="utf-8")
        elif ext == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        elif ext == "csv":
            flat = [{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows]
            pacsv.write_csv(pa.Table.from_pylist(flat), path)
        else:
            raise ValueError(ext)
        return path

    return write


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The offline BPE tokenizer trained on generated rows, loaded back through AutoTokenizer."""
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts_for_tokenizer(make_dolly_rows(300, seed=1)), vocab_size=512, out_dir=out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture
def error_line() -> Callable[..., str]:
    """error_line(fn, *args): the first line of the DataError `fn(*args)` raises, the line users see."""
    from jaxtune.errors import DataError

    def first_line(fn: Callable, *args) -> str:
        with pytest.raises(DataError) as info:
            fn(*args)
        return str(info.value).splitlines()[0]

    return first_line
