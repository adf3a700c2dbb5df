"""Bad data files: exit status 1, one last line naming the file, row or line, and column, and no
artifact folder added to the store. Files that cannot be read at all are refused before the
flow starts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.badinput.conftest import dolly_rows, refused_before_the_flow, write_jsonl

pytestmark = pytest.mark.badinput

HINT = " (--debug shows the traceback)"


def test_a_missing_file_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    missing = tmp_path / "nothere.jsonl"
    refused_before_the_flow(
        jaxtune.run(f"--set=data.source={missing}"),
        1,
        f"jaxtune: data.source {str(missing)!r}: no such file, and not a hub dataset id of the form 'owner/name'",
    )
    assert jaxtune.folders() == set()


def test_an_empty_file_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    empty = tmp_path / "rows.jsonl"
    empty.write_text("")
    refused_before_the_flow(
        jaxtune.run(f"--set=data.source={empty}"), 1, f"jaxtune: data.source {str(empty)!r}: file is empty"
    )
    assert jaxtune.folders() == set()


def test_a_folder_or_a_file_of_another_type_is_refused_before_the_flow_starts(jaxtune, tmp_path):
    text = tmp_path / "rows.txt"
    text.write_text("hello\n")
    refused_before_the_flow(
        jaxtune.run(f"--set=data.source={text}"),
        1,
        f"jaxtune: data.source {str(text)!r}: unsupported file type '.txt'; supported: .jsonl, .json, .parquet, .csv",
    )
    refused_before_the_flow(
        jaxtune.run(f"--set=data.source={tmp_path}"),
        1,
        f"jaxtune: data.source {str(tmp_path)!r} is a folder",
        prefix=True,
    )
    assert jaxtune.folders() == set()


def test_a_malformed_json_line_is_named_by_its_number(jaxtune, tmp_path):
    bad = write_jsonl(tmp_path / "rows.jsonl", dolly_rows(4))
    bad.write_text(bad.read_text() + '{"instruction": "x", "response": \n')
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1 and done.flow_started
    assert (
        done.last_line == f"jaxtune: build_tokenizer: {bad} line 5: not valid JSON (Expecting value at column 34){HINT}"
    )
    assert "Traceback" not in done.stderr
    assert jaxtune.folders() == set()


def test_bytes_that_are_not_utf8_are_named_by_line(jaxtune, tmp_path):
    bad = write_jsonl(tmp_path / "rows.jsonl", dolly_rows(3))
    bad.write_bytes(bad.read_bytes() + b'{"instruction": "caf\xe9", "response": "x"}\n')
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert done.last_line.startswith(f"jaxtune: build_tokenizer: {bad} line 4: not valid UTF-8")
    assert jaxtune.folders() == set()


def test_a_missing_column_lists_the_columns_found(jaxtune, tmp_path):
    rows = [{"instruction": r["instruction"], "answer": r["response"]} for r in dolly_rows(4)]
    bad = write_jsonl(tmp_path / "rows.jsonl", rows)
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert done.last_line == (
        f"jaxtune: build_tokenizer: {bad} line 1: missing column 'response' (format 'dolly' needs "
        f"instruction, response; columns present: instruction, answer){HINT}"
    )
    assert jaxtune.folders() == set()


@pytest.mark.parametrize(("value", "got"), [(42, "int"), (None, "null"), (["a"], "list")])
def test_a_response_that_is_not_text_is_named_with_its_line_and_type(jaxtune, tmp_path, value, got):
    rows = dolly_rows(4)
    rows[2]["response"] = value
    bad = write_jsonl(tmp_path / "rows.jsonl", rows)
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert done.last_line == f"jaxtune: build_tokenizer: {bad} line 3: 'response' must be a string, got {got}{HINT}"
    assert jaxtune.folders() == set()


def test_rows_of_two_formats_in_one_file_name_the_row_and_the_format_it_looks_like(jaxtune, tmp_path):
    rows = dolly_rows(3) + [{"instruction": "Say hi", "input": "", "output": "hi"}]
    bad = write_jsonl(tmp_path / "rows.jsonl", rows)
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert done.last_line.startswith(f"jaxtune: build_tokenizer: {bad} line 4: missing column 'response'")
    assert "(this row looks like format 'alpaca')" in done.last_line
    assert jaxtune.folders() == set()


def test_a_csv_without_its_header_line_says_the_first_line_was_taken_as_the_header(jaxtune, tmp_path):
    bad = tmp_path / "rows.csv"
    bad.write_text("What is two plus two?,,Four.,open_qa\nName a colour.,,Red.,brainstorming\n")
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert done.last_line.startswith(
        f"jaxtune: build_tokenizer: {bad}: the first line is read as the CSV header, "
        "but it names none of the columns format 'dolly' needs (instruction, response)"
    )
    assert jaxtune.folders() == set()


def test_a_parquet_file_with_a_number_column_is_named_by_column_and_type(jaxtune, tmp_path):
    bad = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"instruction": ["a?", "b?", "c?"], "response": [1, 2, 3]}), bad)
    done = jaxtune.run(f"--set=data.source={bad}")
    assert done.status == 1
    assert (
        done.last_line == f"jaxtune: build_tokenizer: {bad}: column 'response' is int64, expected text (string){HINT}"
    )
    assert jaxtune.folders() == set()


def test_when_every_row_is_too_long_the_message_says_so_and_which_setting_to_change(jaxtune, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", dolly_rows(12, words=40))
    done = jaxtune.run(f"--set=data.source={rows}", "--set=data.max_length=16", "--until=tokenize")
    assert done.status == 1
    assert "build_tokenizer" in jaxtune.folders().__repr__(), "the stages before tokenize are complete and kept"
    assert done.last_line.startswith("jaxtune: tokenize: no train rows left: all 12 rows were dropped (too_long: 12")
    assert "data.max_length=16" in done.last_line and "data.too_long=truncate" in done.last_line
    assert not any(f.startswith("tokenize/") for f in jaxtune.folders())


def test_an_eval_split_left_empty_is_named(jaxtune, tmp_path):
    # Every eval prompt also appears in train (same instruction, another answer): eval rows all go.
    rows = dolly_rows(6)
    rows += [{**row, "response": row["response"] + " again"} for row in rows]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    done = jaxtune.run(f"--set=data.source={data}", "--set=data.eval_fraction=0.1", "--until=tokenize")
    assert done.status == 1
    assert done.last_line.startswith("jaxtune: tokenize: no eval rows left")
    assert "duplicate_of_train" in done.last_line
    assert not any(f.startswith("tokenize/") for f in jaxtune.folders())


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_rows_longer_than_max_length_are_dropped_or_truncated_and_counted(jaxtune, tmp_path, policy):
    rows = dolly_rows(30)
    long_rows = [
        {**row, "instruction": f"Long {i}?", "response": " ".join(["word"] * 150)}
        for i, row in enumerate(dolly_rows(3))
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows + long_rows)
    done = jaxtune.run(
        f"--set=data.source={data}", "--set=data.max_length=64", f"--set=data.too_long={policy}", "--until=tokenize"
    )
    assert done.status == 0, done.stderr
    stats = jaxtune.stats()
    assert stats["rows_in"] == 33
    if policy == "drop":
        assert (stats["dropped"]["too_long"], stats["truncated"]) == (3, 0)
        assert stats["train_rows"] + stats["eval_rows"] == 30
    else:
        assert (stats["dropped"]["too_long"], stats["truncated"]) == (0, 3)
        assert stats["train_rows"] + stats["eval_rows"] == 33
        assert stats["length_percentiles"]["max"] == 64


def test_duplicate_rows_are_dropped_once_and_counted(jaxtune, tmp_path):
    rows = dolly_rows(20)
    data = write_jsonl(tmp_path / "rows.jsonl", rows + rows[:5] + rows[:2])
    done = jaxtune.run(f"--set=data.source={data}", "--until=tokenize")
    assert done.status == 0, done.stderr
    stats = jaxtune.stats()
    assert (stats["rows_in"], stats["dropped"]["duplicate"]) == (27, 7)
    assert stats["train_rows"] + stats["eval_rows"] == 20
    assert json.loads((next(jaxtune.store.glob("tokenize/*/manifest.json"))).read_text())["stage"] == "tokenize"
