"""The tokenize key follows the rows: one edited row of a JSONL file, a Parquet file or a
save_to_disk folder changes it; the same bytes elsewhere give the data input the same key.
Keys come from `planned_keys` with the offline model: nothing runs, nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig, JaxtuneConfig, StoreConfig
from jaxtune.tasks.sources import dataset_ref

pytestmark = pytest.mark.data


@pytest.fixture
def keys(tmp_path) -> Callable[[Path], dict[str, str]]:
    """keys(source) -> planned_keys of the offline config reading `source`; asserts that no stage ran."""
    from jaxtune.flows.finetune import planned_keys

    store = tmp_path / "store"

    def plan(source: Path) -> dict[str, str]:
        config = JaxtuneConfig(data=DataConfig(source=str(source)), store=StoreConfig(root=str(store)))
        assert config.model.name == "offline"
        planned = planned_keys(config)
        assert not store.exists(), "planned_keys must not run any stage"
        return planned

    return plan


def edited(rows: list[dict], index: int = 7) -> list[dict]:
    """`rows` with exactly one row's response changed."""
    rows = [dict(r) for r in rows]
    rows[index]["response"] += " (edited)"
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved(rows: list[dict], path: Path) -> Path:
    import datasets

    shutil.rmtree(path, ignore_errors=True)
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {
    "jsonl": (write_jsonl, "data.jsonl"),
    "parquet": (write_parquet, "data.parquet"),
    "saved": (write_saved, "saved"),
}


@pytest.mark.parametrize("kind", WRITERS)
def test_editing_one_row_changes_the_tokenize_key(kind, dolly_rows, tmp_path, keys):
    write, name = WRITERS[kind]
    path = write(dolly_rows, tmp_path / "in" / name)
    before = keys(path)
    assert keys(path) == before, "the same bytes, the same keys"
    write(edited(dolly_rows), path)
    after = keys(path)
    assert after["tokenize"] != before["tokenize"]
    # the rows are the offline tokenizer's training text too, so every stage after it changes
    assert {stage for stage in before if after[stage] == before[stage]} == set()
    write(dolly_rows, path)  # and back: the key follows the content, not the history
    assert keys(path) == before


@pytest.mark.parametrize("kind", WRITERS)
def test_the_same_rows_elsewhere_give_the_data_the_same_key(kind, dolly_rows, tmp_path, keys):
    write, name = WRITERS[kind]
    first = write(dolly_rows, tmp_path / "one" / name)
    moved = tmp_path / "two" / "nested" / name  # the same name: only the folder differs
    moved.parent.mkdir(parents=True)
    (shutil.copytree if first.is_dir() else shutil.copy)(first, moved)
    assert dataset_ref(DataConfig(source=str(moved))).key == dataset_ref(DataConfig(source=str(first))).key
    here, there = keys(first), keys(moved)
    # The stages that read the data only through its ref follow the content.
    assert there["build_tokenizer"] == here["build_tokenizer"]
    assert there["build_model"] == here["build_model"]
    # Rewritten (not copied) with the same rows, the key is the same too.
    rewritten = write(dolly_rows, tmp_path / "three" / name)
    assert dataset_ref(DataConfig(source=str(rewritten))).key == dataset_ref(DataConfig(source=str(first))).key


def test_the_same_rows_elsewhere_keep_the_tokenize_key(dolly_rows, tmp_path, keys):
    first = write_jsonl(dolly_rows, tmp_path / "one" / "data.jsonl")
    moved = write_jsonl(dolly_rows, tmp_path / "two" / "data.jsonl")
    assert keys(moved)["tokenize"] == keys(first)["tokenize"]
    # The file's name lands in the tables' `source` column, so it is part of the key.
    renamed = write_jsonl(dolly_rows, tmp_path / "two" / "other.jsonl")
    assert keys(renamed)["tokenize"] != keys(first)["tokenize"]
