"""Every source format through `tokenize_sources`: the same rows whatever the file type, the true
line or row in error messages (in worker processes too), and `max_rows`."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from jaxtune.config import DataConfig, SourceConfig
from jaxtune.data import loading
from jaxtune.data.tokenize import tokenize_sources
from jaxtune.errors import DataError

pytestmark = pytest.mark.data

NAME = "rows"  # every source gets this label, so the `source` column does not tell the formats apart


@pytest.fixture
def tokenize(tokenizer, tmp_path):
    """tokenize(path, num_proc=1, **source settings) -> TokenTables, each call in a fresh work folder."""

    def run(path: Path | str, num_proc: int | None = 1, **settings):
        src = SourceConfig(source=str(path), name=settings.pop("name", NAME), **settings)
        work = Path(tempfile.mkdtemp(prefix="work-", dir=tmp_path))
        return tokenize_sources([(src, str(path))], tokenizer, DataConfig(num_proc=num_proc), work)

    return run


def split_rows(tables) -> tuple[list[dict], list[dict]]:
    return tables.rows("train"), tables.rows("eval")


def save_dataset(rows: list[dict], folder: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    return folder


def save_dataset_dict(splits: dict[str, list[dict]], folder: Path) -> Path:
    import datasets

    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(folder)
    )
    return folder


# --- every format reads the same rows -------------------------------------------------------


@pytest.fixture
def jsonl_tables(dolly_rows, write_rows, tokenize):
    return tokenize(write_rows(dolly_rows, "jsonl"))


@pytest.mark.parametrize("ext", ["json", "csv", "parquet"])
def test_each_file_format_gives_the_rows_jsonl_gives(ext, dolly_rows, write_rows, tokenize, jsonl_tables):
    tables = tokenize(write_rows(dolly_rows, ext))
    assert split_rows(tables) == split_rows(jsonl_tables)
    assert tables.stats == jsonl_tables.stats
    assert tables.stats["rows_in"] == len(dolly_rows)


def test_a_saved_dataset_folder_gives_the_rows_jsonl_gives(dolly_rows, tmp_path, tokenize, jsonl_tables):
    folder = save_dataset(dolly_rows, tmp_path / "saved")
    tables = tokenize(folder)
    assert split_rows(tables) == split_rows(jsonl_tables)
    assert tables.stats == jsonl_tables.stats


def test_a_saved_dataset_dict_is_read_at_its_hub_split(dolly_rows, make_dolly, tmp_path, tokenize, jsonl_tables):
    other = make_dolly(10, seed=7)  # a "train" split of other rows, which must not be read
    folder = save_dataset_dict({"train": other, "validation": dolly_rows}, tmp_path / "saved_dict")
    tables = tokenize(folder, hub_split="validation")
    assert split_rows(tables) == split_rows(jsonl_tables)
    assert tables.stats["rows_in"] == len(dolly_rows)
    # and the default split is "train": the other rows
    assert tokenize(folder).stats["rows_in"] == len(other)


def test_a_missing_split_of_a_saved_dataset_dict_names_the_splits(
    dolly_rows, make_dolly, tmp_path, tokenize, error_line
):
    folder = save_dataset_dict({"train": make_dolly(6, seed=7), "validation": dolly_rows}, tmp_path / "saved_dict")
    line = error_line(lambda: tokenize(folder, hub_split="test"))
    assert str(folder) in line
    assert "'test'" in line and "train" in line and "validation" in line


# --- the true line or row in error messages -------------------------------------------------


def jsonl_with_blank_lines(rows: list[dict], bad_at: int, bad_text: str, path: Path) -> tuple[Path, int]:
    """rows as JSONL with blank lines between some of them, `bad_text` replacing row `bad_at`;
    returns the path and the file line the bad row is on."""
    lines, bad_line = [], None
    for i, row in enumerate(rows):
        if i % 3 == 1:
            lines += ["", "   "]  # blank and whitespace-only lines still count
        if i == bad_at:
            bad_line = len(lines) + 1
            lines.append(bad_text)
        else:
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, bad_line


def _without_response(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "response"})


BAD_JSONL = {
    "invalid_json": (lambda row: '{"instruction": "broken", "response": ', "not valid JSON"),
    "missing_response": (_without_response, "missing column 'response'"),
}


@pytest.mark.parametrize("bad", BAD_JSONL)
def test_a_bad_jsonl_row_is_named_by_its_true_line(bad, dolly_rows, tmp_path, tokenize, error_line):
    make_bad, what = BAD_JSONL[bad]
    path, line = jsonl_with_blank_lines(dolly_rows, 13, make_bad(dolly_rows[13]), tmp_path / "bad.jsonl")
    assert line > 14, "the blank lines must shift the line number away from the row index"
    message = error_line(lambda: tokenize(path))
    assert message.startswith(f"{path} line {line}: "), message
    assert what in message


def _drop_response(row: dict) -> None:
    del row["response"]


@pytest.mark.parametrize(
    "ext, index, spoil, what",
    [
        ("json", 8, _drop_response, "missing column 'response'"),
        # CSV cells are text: an empty required cell is the bad value
        ("csv", 10, lambda row: row.update(instruction=""), "'instruction' must be a non-empty string"),
        ("parquet", 16, lambda row: row.update(response=None), "'response' must be a string, got null"),
    ],
)
def test_a_bad_row_of_a_json_csv_or_parquet_file_is_named_by_its_row(
    dolly_rows, write_rows, tokenize, error_line, ext, index, spoil, what
):
    rows = [dict(r) for r in dolly_rows]
    spoil(rows[index])
    path = write_rows(rows, ext)
    message = error_line(lambda: tokenize(path))
    assert message.startswith(f"{path} row {index + 1}: "), message
    assert what in message


# --- worker processes -----------------------------------------------------------------------


@pytest.fixture
def two_workers(monkeypatch):
    """60 rows are split over two worker processes (one per 10 rows, at most num_proc=2)."""
    monkeypatch.setattr(loading, "ROWS_PER_PROCESS", 10)
    assert loading.processes(60, 2) == 2  # else the tests below would silently run in one process
    assert loading.processes(60, 1) is None


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_two_worker_processes_give_the_rows_one_gives(ext, make_dolly, write_rows, tokenize, two_workers):
    path = write_rows(make_dolly(60), ext)
    one, two = tokenize(path, num_proc=1), tokenize(path, num_proc=2)
    assert split_rows(two) == split_rows(one)
    assert two.stats == one.stats
    assert two.stats["rows_in"] == 60


class _RecordsPids:
    """A map function that leaves a file named after the process calling it in `folder`, then does what `function` does."""

    def __init__(self, function, folder: Path):
        self.function, self.folder = function, folder

    def __call__(self, *args, **kwargs):
        (self.folder / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        return self.function(*args, **kwargs)


def test_two_workers_normalize_and_encode_in_two_other_processes(
    make_dolly, write_rows, tokenize, monkeypatch, tmp_path
):
    """The worker count is not taken on trust (as `two_workers` takes it): each map function records its pid."""
    from jaxtune.data import tokenize as encoding

    monkeypatch.setattr(loading, "ROWS_PER_PROCESS", 10)  # 60 rows: one worker per 30, at most num_proc=2
    seen = {}
    for name, module, attribute in (("normalize", loading, "_normalize_batch"), ("encode", encoding, "_encode_map")):
        seen[name] = tmp_path / f"pids-{name}"
        seen[name].mkdir()
        monkeypatch.setattr(module, attribute, _RecordsPids(getattr(module, attribute), seen[name]))
    tables = tokenize(write_rows(make_dolly(60), "jsonl"), num_proc=2)
    assert tables.stats["rows_in"] == 60
    for name, folder in seen.items():
        pids = {int(p.name.split("-")[0]) for p in folder.iterdir()}
        assert len(pids) == 2 and os.getpid() not in pids, f"{name} ran in processes {pids}, this one is {os.getpid()}"


def test_a_bad_row_in_the_second_worker_is_named_by_its_true_line(
    make_dolly, tmp_path, tokenize, two_workers, error_line
):
    rows = make_dolly(60)
    path, line = jsonl_with_blank_lines(rows, 47, _without_response(rows[47]), tmp_path / "bad.jsonl")
    message = error_line(lambda: tokenize(path, num_proc=2))
    assert message.startswith(f"{path} line {line}: "), message
    assert "missing column 'response'" in message


def test_a_bad_parquet_row_in_the_second_worker_is_named_by_its_row(
    make_dolly, write_rows, tokenize, two_workers, error_line
):
    rows = make_dolly(60)
    rows[44]["response"] = None  # the second worker's shard starts at row 31: its indices must be global
    path = write_rows(rows, "parquet")
    message = error_line(lambda: tokenize(path, num_proc=2))
    assert message.startswith(f"{path} row 45: "), message


# --- max_rows -------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["jsonl", "csv", "parquet"])
def test_max_rows_reads_only_the_first_rows(ext, make_dolly, write_rows, tokenize):
    rows = make_dolly(30)
    rows[20]["instruction"] = ""  # a bad row after the first 12
    path = write_rows(rows, ext)
    with pytest.raises(DataError):
        tokenize(path)  # the bad row is there to be found when every row is read
    tables = tokenize(path, max_rows=12)
    assert tables.stats["rows_in"] == 12
    assert tables.stats["sources"] == [
        {
            "name": NAME,
            "weight": 1.0,
            "max_rows": 12,
            "rows_in": 12,
            "train_rows": tables.stats["train_rows"],
            "eval_rows": tables.stats["eval_rows"],
        }
    ]
    train, eval_ = split_rows(tables)
    assert len(train) + len(eval_) == 12
    assert sorted(r["response"] for r in train + eval_) == sorted(r["response"].strip() for r in rows[:12])


def test_max_rows_above_the_row_count_reads_every_row(dolly_rows, write_rows, tokenize):
    tables = tokenize(write_rows(dolly_rows, "jsonl"), max_rows=1000)
    assert tables.stats["rows_in"] == len(dolly_rows)
