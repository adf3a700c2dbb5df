"""Reading rows from every file type and format into the same normalized examples, and clear errors."""

from __future__ import annotations

import json
import sys
import types

import pytest

from jaxtune.config import DataConfig
from jaxtune.data import rows as rows_module
from jaxtune.data.rows import DataError, read_rows

EXTENSIONS = ["jsonl", "json", "parquet", "csv"]


def expected(dolly: list[dict]) -> list[dict]:
    """The normalized examples a list of Dolly rows should read as."""
    out = []
    for r in dolly:
        content = f"{r['instruction']}\n\n{r['context']}" if r["context"] else r["instruction"]
        out.append({"messages": [{"role": "user", "content": content}], "response": r["response"], "category": r["category"]})
    return out


def as_format(dolly: list[dict], fmt: str) -> list[dict]:
    """The same content in another row schema."""
    out = []
    for r in dolly:
        prompt = f"{r['instruction']}\n\n{r['context']}" if r["context"] else r["instruction"]
        if fmt == "dolly":
            out.append(dict(r))
        elif fmt == "alpaca":
            out.append({"instruction": r["instruction"], "input": r["context"], "output": r["response"], "category": r["category"]})
        elif fmt == "prompt_completion":
            out.append({"prompt": prompt, "completion": r["response"], "category": r["category"]})
        else:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["response"]}]
            out.append({"messages": turns, "category": r["category"]})
    return out


@pytest.mark.parametrize("ext", EXTENSIONS)
@pytest.mark.parametrize("fmt", ["dolly", "alpaca", "prompt_completion", "messages"])
def test_every_format_and_file_type_reads_the_same(dolly_rows, write_rows, fmt, ext):
    path = write_rows(as_format(dolly_rows, fmt), ext)
    assert read_rows(DataConfig(format=fmt), str(path)) == expected(dolly_rows)


@pytest.mark.parametrize("key", ["data", "train"])
def test_json_object_holding_the_rows(dolly_rows, tmp_path, key):
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({key: dolly_rows, "version": 1}))
    assert read_rows(DataConfig(), str(path)) == expected(dolly_rows)


def test_optional_fields_default(write_rows):
    path = write_rows([{"instruction": "Say hi.", "response": "Hi."}, {"instruction": "Q", "context": None, "response": "A"}], "jsonl")
    got = read_rows(DataConfig(), str(path))
    assert got[0] == {"messages": [{"role": "user", "content": "Say hi."}], "response": "Hi.", "category": "general"}
    assert got[1]["messages"][0]["content"] == "Q"


def test_columns_rename_source_columns(dolly_rows, write_rows):
    names = {"instruction": "question", "context": "passage", "response": "answer", "category": "category"}
    renamed = [{names[k]: v for k, v in r.items()} for r in dolly_rows]
    cfg = DataConfig(columns={"instruction": "question", "context": "passage", "response": "answer"})
    assert read_rows(cfg, str(write_rows(renamed, "parquet"))) == expected(dolly_rows)


def test_columns_key_must_be_a_format_column(dolly_rows, write_rows):
    path = write_rows(dolly_rows, "jsonl")
    with pytest.raises(DataError, match=r"data.columns: 'question' is not a column of format 'dolly'"):
        read_rows(DataConfig(columns={"question": "instruction"}), str(path))


def test_messages_keep_system_and_earlier_turns(write_rows):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
    ]
    got = read_rows(DataConfig(format="messages"), str(write_rows([{"messages": turns}], "jsonl")))
    assert got == [{"messages": turns[:-1], "response": "Blue", "category": "general"}]


def test_offline_source_reads_the_bundled_file(dolly_rows, write_rows, monkeypatch):
    monkeypatch.setattr(rows_module, "OFFLINE_DATA", write_rows(dolly_rows, "jsonl", name="dolly_offline"))
    assert read_rows(DataConfig()) == expected(dolly_rows)


def test_missing_offline_file(monkeypatch, tmp_path):
    monkeypatch.setattr(rows_module, "OFFLINE_DATA", tmp_path / "dolly_offline.jsonl")
    with pytest.raises(DataError, match="bundled offline data file is missing"):
        read_rows(DataConfig())


def test_text_is_stripped(write_rows):
    path = write_rows([{"instruction": " Q \n", "context": "\n", "response": " A  ", "category": "x"}], "jsonl")
    assert read_rows(DataConfig(), str(path)) == [{"messages": [{"role": "user", "content": "Q"}], "response": "A", "category": "x"}]


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"instruction": "a", "response": "b"}\n{"instruction": "\xff", "response": "b"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl line 2: not valid UTF-8"):
        read_rows(DataConfig(), str(path))


def test_hub_id_goes_to_load_dataset(dolly_rows, monkeypatch):
    calls = []

    def load_dataset(name, split, revision):
        calls.append((name, split, revision))
        return dolly_rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = DataConfig(source="someone/dolly-like", hub_split="train[:10]", revision="abc123")
    assert read_rows(cfg) == expected(dolly_rows)
    assert calls == [("someone/dolly-like", "train[:10]", "abc123")]


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "response": "b"}\n\n{"instruction": "c", "response": \n')
    with pytest.raises(DataError, match=r"data\.jsonl line 3: not valid JSON \("):
        read_rows(DataConfig(), str(path))


def test_invalid_json_document_names_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n{"instruction": "a", "response": "b"},\n{"instruction": }\n]')
    with pytest.raises(DataError, match=r"data\.json line 3: not valid JSON"):
        read_rows(DataConfig(), str(path))


def test_missing_column_names_line_and_present_columns(write_rows):
    path = write_rows([{"instruction": "a", "response": "b"}, {"prompt": "a", "answer": "b"}], "jsonl")
    message = (
        r"data\.jsonl line 2: missing column 'instruction' "
        r"\(format 'dolly' needs instruction, response; columns present: prompt, answer\)"
    )
    with pytest.raises(DataError, match=message):
        read_rows(DataConfig(), str(path))


def test_missing_renamed_column_mentions_the_mapping(write_rows):
    path = write_rows([{"instruction": "a", "response": "b"}], "csv")
    with pytest.raises(DataError, match=r"data\.csv row 1: missing column 'answer' \(mapped to 'response' by data.columns\)"):
        read_rows(DataConfig(columns={"response": "answer"}), str(path))


@pytest.mark.parametrize(
    ("ext", "where", "value", "got"),
    [("jsonl", "line 12", 42, "int"), ("json", "row 12", [1], "list"), ("parquet", "row 12", None, "null")],
)
def test_non_string_response_names_row(dolly_rows, write_rows, ext, where, value, got):
    bad = [dict(r) for r in dolly_rows[:15]]
    bad[11]["response"] = value  # parquet columns have one type, so there the bad value is a null
    with pytest.raises(DataError, match=rf"data\.{ext} {where}: 'response' must be a string, got {got}"):
        read_rows(DataConfig(), str(write_rows(bad, ext)))


def test_empty_instruction_is_an_error(write_rows):
    path = write_rows([{"instruction": "  ", "response": "b"}], "jsonl")
    with pytest.raises(DataError, match=r"line 1: 'instruction' must be a non-empty string, got an empty string"):
        read_rows(DataConfig(), str(path))


@pytest.mark.parametrize(
    ("turns", "problem"),
    [
        ([{"role": "user", "content": "hi"}], "last message must be the 'assistant' answer"),
        ([{"role": "bot", "content": "hi"}], "message 1 has role 'bot'"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "no 'user' turn"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}], "message 1 'content' must be a string, got int"),
        ([], "must be a non-empty list"),
    ],
)
def test_bad_messages(write_rows, turns, problem):
    path = write_rows([{"messages": turns}], "jsonl")
    with pytest.raises(DataError, match=rf"data\.jsonl line 1: .*{problem}"):
        read_rows(DataConfig(format="messages"), str(path))


def test_unsupported_extension_lists_supported(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"data\.txt: unsupported file type '\.txt'; supported: \.jsonl, \.json, \.parquet, \.csv"):
        read_rows(DataConfig(), str(path))


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_empty_file(tmp_path, ext):
    path = tmp_path / f"data.{ext}"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=rf"data\.{ext}: file is empty"):
        read_rows(DataConfig(), str(path))


@pytest.mark.parametrize(("name", "text"), [("blank.jsonl", "\n\n  \n"), ("list.json", "[]"), ("header.csv", "instruction,response\n")])
def test_file_without_rows(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=rf"{name}: no rows"):
        read_rows(DataConfig(), str(path))


def test_missing_file_that_is_not_a_hub_id(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file, and not a hub dataset id"):
        read_rows(DataConfig(), str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match=r"no such file"):
        read_rows(DataConfig(), "not a dataset")


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"data\.parquet: not a readable parquet file"):
        read_rows(DataConfig(), str(path))


def test_csv_keeps_text_as_text(write_rows):
    path = write_rows([{"instruction": "Zip code?", "response": "007", "category": "closed_qa"}], "csv")
    assert read_rows(DataConfig(), str(path))[0]["response"] == "007"
