"""Reading rows from every file type and format into the same normalized examples, and clear errors."""

from __future__ import annotations

import json
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig
from jaxtune.data import rows as rows_module
from jaxtune.data.rows import read_rows, source_texts
from jaxtune.errors import DataError

pytestmark = pytest.mark.data

EXTENSIONS = ["jsonl", "json", "parquet", "csv"]


def expected(dolly: list[dict]) -> list[dict]:
    """The normalized examples a list of Dolly rows should read as."""
    out = []
    for r in dolly:
        content = f"{r['instruction']}\n\n{r['context']}" if r["context"] else r["instruction"]
        out.append(
            {"messages": [{"role": "user", "content": content}], "response": r["response"], "category": r["category"]}
        )
    return out


def as_format(dolly: list[dict], fmt: str) -> list[dict]:
    """The same content in another row schema."""
    out = []
    for r in dolly:
        prompt = f"{r['instruction']}\n\n{r['context']}" if r["context"] else r["instruction"]
        if fmt == "dolly":
            out.append(dict(r))
        elif fmt == "alpaca":
            out.append(
                {
                    "instruction": r["instruction"],
                    "input": r["context"],
                    "output": r["response"],
                    "category": r["category"],
                }
            )
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
    path = write_rows(
        [{"instruction": "Say hi.", "response": "Hi."}, {"instruction": "Q", "context": None, "response": "A"}], "jsonl"
    )
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
    assert read_rows(DataConfig(), str(path)) == [
        {"messages": [{"role": "user", "content": "Q"}], "response": "A", "category": "x"}
    ]


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
    with pytest.raises(
        DataError, match=r"data\.csv row 1: missing column 'answer' \(mapped to 'response' by data.columns\)"
    ):
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
        (
            [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}],
            "message 1 'content' must be a string, got int",
        ),
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
    with pytest.raises(
        DataError, match=r"data\.txt: unsupported file type '\.txt'; supported: \.jsonl, \.json, \.parquet, \.csv"
    ):
        read_rows(DataConfig(), str(path))


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_empty_file(tmp_path, ext):
    path = tmp_path / f"data.{ext}"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=rf"data\.{ext}: file is empty"):
        read_rows(DataConfig(), str(path))


@pytest.mark.parametrize(
    ("name", "text"), [("blank.jsonl", "\n\n  \n"), ("list.json", "[]"), ("header.csv", "instruction,response\n")]
)
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


# Each message below is compared whole: its first line is what the user sees.


@pytest.mark.parametrize(
    ("fmt", "row", "message"),
    [
        (
            "dolly",
            {"instruction": "a", "input": "", "output": "b"},
            "missing column 'response' (format 'dolly' needs instruction, response; "
            "columns present: instruction, input, output) (this row looks like format 'alpaca')",
        ),
        (
            "alpaca",
            {"instruction": "a", "response": "b", "category": "x"},
            "missing column 'output' (format 'alpaca' needs instruction, output; "
            "columns present: instruction, response, category) (this row looks like format 'dolly')",
        ),
        (
            "prompt_completion",
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "missing column 'prompt' (format 'prompt_completion' needs prompt, completion; "
            "columns present: messages) (this row looks like format 'messages')",
        ),
        (
            "dolly",
            {"question": "a", "answer": "b"},
            "missing column 'instruction' (format 'dolly' needs instruction, response; columns present: question, answer)",
        ),
    ],
)
def test_row_of_another_format_is_named(write_rows, error_line, fmt, row, message):
    good = as_format([{"instruction": "q", "context": "", "response": "r", "category": "c"}], fmt)[0]
    path = write_rows([good, row], "jsonl")
    assert error_line(read_rows, DataConfig(format=fmt), str(path)) == f"{path} line 2: {message}"


def test_csv_without_header(tmp_path, error_line):
    path = tmp_path / "data.csv"
    path.write_text("What is 2+2?,4\nName a colour,Blue\n")
    assert error_line(read_rows, DataConfig(), str(path)) == (
        f"{path}: the first line is read as the CSV header, but it names none of the columns format 'dolly' needs "
        "(instruction, response); found: 'What is 2+2?', '4'"
    )


def test_csv_header_check_uses_the_mapping_and_shortens_cells(tmp_path, error_line):
    path = tmp_path / "data.csv"
    path.write_text(f"instruction,{'x' * 50}\n")  # 'instruction' is mapped away, so it does not count
    cfg = DataConfig(columns={"instruction": "question", "response": "answer"})
    assert error_line(read_rows, cfg, str(path)) == (
        f"{path}: the first line is read as the CSV header, but it names none of the columns format 'dolly' needs "
        f"(question, answer); found: 'instruction', '{'x' * 37}...'"
    )


def test_csv_header_with_some_format_column_is_checked_per_row(tmp_path, error_line):
    path = tmp_path / "data.csv"
    path.write_text("category,answer\nx,y\n")
    assert error_line(read_rows, DataConfig(), str(path)) == (
        f"{path} row 1: missing column 'instruction' (format 'dolly' needs instruction, response; "
        "columns present: category, answer)"
    )


def test_csv_blank_lines_before_the_header_are_skipped(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("\n\ninstruction,response\nZip code?,007\n")
    assert read_rows(DataConfig(), str(path))[0]["response"] == "007"  # still read as text


@pytest.mark.parametrize(
    ("columns", "cfg", "message"),
    [
        ({"instruction": ["a"], "response": [1]}, DataConfig(), "column 'response' is int64, expected text (string)"),
        (
            {"instruction": ["a"], "response": ["b"], "context": [1.5]},
            DataConfig(),
            "column 'context' is double, expected text (string)",
        ),
        (
            {"question": [True], "response": ["b"]},
            DataConfig(columns={"instruction": "question"}),
            "column 'question' (mapped to 'instruction' by data.columns) is bool, expected text (string)",
        ),
        (
            {"messages": [3]},
            DataConfig(format="messages"),
            "column 'messages' is int64, expected a list of {role, content} objects (list<struct>)",
        ),
        (
            {"messages": [["hi"]]},
            DataConfig(format="messages"),
            "column 'messages' is list<element: string>, expected a list of {role, content} objects (list<struct>)",
        ),
    ],
)
def test_parquet_column_of_wrong_type(tmp_path, error_line, columns, cfg, message):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table(columns), path)
    assert error_line(read_rows, cfg, str(path)) == f"{path}: {message}"


def test_parquet_accepted_column_types(tmp_path):
    """All-null columns (type null), dictionary-encoded text (pandas categoricals) and messages as JSON text read fine."""
    path = tmp_path / "data.parquet"
    category = pa.array(["x", "y"]).dictionary_encode()
    pq.write_table(
        pa.table({"instruction": ["a", "b"], "context": pa.nulls(2), "response": ["c", "d"], "category": category}),
        path,
    )
    assert [e["category"] for e in read_rows(DataConfig(), str(path))] == ["x", "y"]
    turns = json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    pq.write_table(pa.table({"messages": pa.array([turns], pa.large_string())}), path)
    assert read_rows(DataConfig(format="messages"), str(path))[0]["response"] == "b"


def test_parquet_missing_column_is_still_the_row_message(tmp_path, error_line):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"instruction": ["a"], "answer": [1]}), path)
    assert error_line(read_rows, DataConfig(), str(path)) == (
        f"{path} row 1: missing column 'response' (format 'dolly' needs instruction, response; columns present: instruction, answer)"
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"response": 3}, "'response' must be a string, got int"),
        ({"response": None}, "'response' must be a string, got null"),
        ({"instruction": None}, "'instruction' must be a non-empty string, got null"),
        ({"context": ["x"]}, "'context' must be a string, got list"),
        ({"category": 1.5}, "'category' must be a string, got float"),
    ],
)
def test_jsonl_value_of_wrong_type_names_line_and_column(write_rows, error_line, bad, message):
    good = {"instruction": "a", "context": "", "response": "b", "category": "c"}
    path = write_rows([good, {**good, **bad}], "jsonl")
    assert error_line(read_rows, DataConfig(), str(path)) == f"{path} line 2: {message}"


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_empty_file_message(tmp_path, error_line, ext):
    path = tmp_path / f"data.{ext}"
    path.write_bytes(b"")
    assert error_line(read_rows, DataConfig(), str(path)) == f"{path}: file is empty"


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv"])
def test_blank_lines_only_have_no_rows(tmp_path, error_line, ext):
    path = tmp_path / f"data.{ext}"
    path.write_text("\n  \n\n")
    assert error_line(read_rows, DataConfig(), str(path)) == f"{path}: no rows"


def test_missing_file_message(tmp_path, error_line):
    path = tmp_path / "nope.jsonl"
    assert (
        error_line(read_rows, DataConfig(), str(path))
        == f"{path}: no such file, and not a hub dataset id of the form 'owner/name'"
    )


def test_json_cut_off_at_the_line_end_names_that_column(tmp_path, error_line):
    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "x", "response": \r\n')
    assert (
        error_line(read_rows, DataConfig(), str(path))
        == f"{path} line 2: not valid JSON (Expecting value at column 34)"
    )


def test_source_texts_checks_rows_as_reading_does(write_rows, error_line):
    """The offline tokenizer stage reads the file first; a bad row must fail there with the same message."""
    path = write_rows([{"instruction": "a", "response": "b"}, {"instruction": "c", "response": None}], "jsonl")
    assert (
        error_line(lambda: list(source_texts(DataConfig(), str(path))))
        == f"{path} line 2: 'response' must be a string, got null"
    )
