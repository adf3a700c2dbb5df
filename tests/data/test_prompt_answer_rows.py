"""Prompts with the answer a reward checks (data.format: prompt_answer) read from every file type into
token tables whose rows are the prompt alone, through the generation prompt, with nothing labelled."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig, config_from_dict
from jaxtune.data import loading
from jaxtune.data.rows import OFFLINE_ARITHMETIC, normalize_row, offline_file, read_rows, source_texts
from jaxtune.data.token_table import TokenTable
from jaxtune.data.tokenize import IGNORE_INDEX, write_token_tables
from jaxtune.errors import ConfigError

pytestmark = pytest.mark.data


def make_rows(n: int, numbers: bool = True) -> list[dict]:
    """`n` distinct questions; with `numbers` the answers are JSON numbers, else text."""
    return [
        {
            "prompt": f"What is {i} + {i + 1}? Give the number after ####.",
            "answer": 2 * i + 1 if numbers else str(2 * i + 1),
            "category": ["small", "large"][i >= n // 2],
        }
        for i in range(n)
    ]


def tables(tokenizer, path, tmp_path, **settings):
    cfg = DataConfig(source=str(path), format="prompt_answer", eval_fraction=0.25, **settings)
    folder = tmp_path / "tables"
    folder.mkdir()
    stats = write_token_tables([(cfg.mixture()[0], str(path))], tokenizer, cfg, folder)
    return stats, TokenTable(folder / "train.arrow"), TokenTable(folder / "eval.arrow")


def generation_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """What decoding continues from: the conversation rendered with the opening of the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<start_of_turn>model\n")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
def test_each_row_is_its_prompt_through_the_generation_prompt_with_nothing_labelled(
    ext, write_rows, tokenizer, tmp_path
):
    rows = make_rows(16)
    stats, train, evals = tables(tokenizer, write_rows(rows, ext), tmp_path)
    assert stats["prompt_answer"] is True and "preference" not in stats
    assert (stats["train_rows"], stats["eval_rows"]) == (len(train), len(evals)) == (12, 4)
    assert stats["label_tokens"] == {"train": 0, "eval": 0}
    assert stats["tokens"]["train"] + stats["tokens"]["eval"] == train.lengths.sum() + evals.lengths.sum()
    by_prompt = {r["prompt"]: r for r in rows}
    for table in (train, evals):
        for k, prompt in enumerate(table.column("prompt_text")):
            row, ids = by_prompt[prompt], list(table.input_ids[k])
            assert ids == generation_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
            assert list(table.labels[k]) == [IGNORE_INDEX] * len(ids)
            assert table.column("length")[k] == table.column("prompt_length")[k] == len(ids)
            assert table.column("response")[k] == str(row["answer"])  # a number kept as its text
            assert table.column("category")[k] == row["category"]
            assert table.column("source")[k] == f"data.{ext}"


def test_messages_are_the_conversation_the_answer_continues(write_rows, tokenizer, tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"{i} + 1?"},
                {"role": "assistant", "content": str(i + 1)},
                {"role": "user", "content": "And doubled?"},
            ],
            "answer": 2 * (i + 1),
        }
        for i in range(8)
    ]
    stats, train, _ = tables(tokenizer, write_rows(rows, "jsonl"), tmp_path)
    assert stats["train_rows"] == 6
    by_ids = {tuple(generation_prompt_ids(tokenizer, row["messages"])): row for row in rows}
    for k in range(len(train)):
        row = by_ids[tuple(train.input_ids[k])]  # every turn, the system prompt included, then the generation prompt
        assert train.column("prompt_text")[k] == "And doubled?"  # the last user turn, as for every format
        assert train.column("response")[k] == str(row["answer"])
        assert train.column("category")[k] == "general"


@pytest.mark.parametrize(
    "answer, text", [(42, "42"), (2.5, "2.5"), (-3, "-3"), (1e21, "1e+21"), ("  7 ", "7"), ("x = 4", "x = 4")]
)
def test_an_answer_is_text_or_a_number_kept_as_its_text(answer, text):
    example = normalize_row(
        {"prompt": " What? ", "answer": answer}, DataConfig(format="prompt_answer"), "data.jsonl line 1"
    )
    assert example == {"messages": [{"role": "user", "content": "What?"}], "response": text, "category": "general"}


def test_columns_rename_the_prompt_and_the_answer(write_rows, tokenizer, tmp_path):
    rows = [{"question": r["prompt"], "solution": r["answer"], "kind": r["category"]} for r in make_rows(8)]
    cfg = DataConfig(format="prompt_answer", columns={"prompt": "question", "answer": "solution", "category": "kind"})
    examples = read_rows(cfg, write_rows(rows, "jsonl"))
    assert [(e["messages"][0]["content"], e["response"], e["category"]) for e in examples] == [
        (r["question"], str(r["solution"]), r["kind"]) for r in rows
    ]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"answer": "1"},
            "a prompt_answer row needs its prompt as 'prompt' (text) or 'messages' (the conversation before the "
            "answer), exactly one of them; got neither",
        ),
        (
            {"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "1"},
            "a prompt_answer row needs its prompt as 'prompt' (text) or 'messages' (the conversation before the answer), "
            "exactly one of them; got both",
        ),
        ({"prompt": "q"}, "missing column 'answer' (format 'prompt_answer' needs answer; columns present: prompt)"),
        ({"prompt": "q", "answer": ""}, "'answer' must be non-empty text or a finite number, got an empty string"),
        ({"prompt": "q", "answer": None}, "'answer' must be non-empty text or a finite number, got null"),
        ({"prompt": "q", "answer": True}, "'answer' must be non-empty text or a finite number, got bool"),
        ({"prompt": "q", "answer": [1]}, "'answer' must be non-empty text or a finite number, got list"),
        ({"prompt": "q", "answer": float("nan")}, "'answer' must be non-empty text or a finite number, got nan"),
        ({"prompt": "", "answer": "1"}, "'prompt' must be a non-empty string, got an empty string"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"},
            "in a prompt_answer row 'messages' is the conversation before the answer, so its last message must be a 'user' "
            "turn, got role 'assistant'",
        ),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(row, message, write_rows, tokenizer, tmp_path, error_line):
    rows = make_rows(6)
    rows.insert(4, row)
    path = write_rows(rows, "jsonl")
    assert error_line(tables, tokenizer, path, tmp_path) == f"{path} line 5: {message}"
    assert (
        error_line(lambda: list(source_texts(DataConfig(format="prompt_answer"), path))) == f"{path} line 5: {message}"
    )


def test_a_prompt_answer_row_in_another_format_is_named_as_one(write_rows, error_line):
    path = write_rows([{"prompt": "What is 1 + 1?", "answer": 2}], "jsonl")
    assert error_line(read_rows, DataConfig(format="prompt_completion"), path) == (
        f"{path} line 1: missing column 'completion' (format 'prompt_completion' needs prompt, completion; columns "
        "present: prompt, answer) (this row looks like format 'prompt_answer')"
    )
    path = write_rows([{"question": "What is 1 + 1?", "answer": 2}], "jsonl")  # no prompt: no format's row
    assert error_line(read_rows, DataConfig(), path).endswith("columns present: question, answer)")


def test_a_parquet_answer_column_may_hold_numbers_but_not_lists(tmp_path, error_line):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.5, 2.0]}), path)
    assert [e["response"] for e in read_rows(DataConfig(format="prompt_answer"), path)] == ["1.5", "2.0"]
    pq.write_table(pa.table({"prompt": ["a"], "answer": [[1]]}), path)
    assert (
        error_line(read_rows, DataConfig(format="prompt_answer"), str(path))
        == f"{path}: column 'answer' is list<element: int64>, expected text (string) or a number"
    )


@pytest.mark.parametrize("too_long", ["drop", "truncate"])
def test_a_prompt_longer_than_max_length_is_dropped_whatever_too_long_says(too_long, write_rows, tokenizer, tmp_path):
    rows = make_rows(16)
    rows[0]["prompt"] = " ".join(["very"] * 100) + " long?"
    longest = max(len(generation_prompt_ids(tokenizer, [{"role": "user", "content": r["prompt"]}])) for r in rows[1:])
    stats, train, evals = tables(tokenizer, write_rows(rows, "jsonl"), tmp_path, max_length=longest, too_long=too_long)
    assert stats["dropped"]["too_long"] == 1 and stats["truncated"] == 0
    assert len(train) + len(evals) == 15 and max(train.longest, evals.longest) == longest  # one at the limit is kept


def test_when_every_prompt_is_too_long_the_error_says_what_to_raise(write_rows, tokenizer, tmp_path, error_line):
    path = write_rows(make_rows(8), "jsonl")
    line = error_line(lambda: tables(tokenizer, path, tmp_path, max_length=8, too_long="truncate"))
    assert line == (
        "no train rows left: all 8 rows were dropped (too_long: 8; prompts longer than data.max_length=8 "
        "tokens; raise data.max_length)"
    )


def test_repeats_are_dropped_and_an_eval_prompt_never_appears_in_train(write_rows, tokenizer, tmp_path):
    rows = make_rows(16)
    rows += [dict(rows[3]), {**rows[5], "answer": "another"}]  # an exact repeat; the same prompt with another answer
    stats, train, evals = tables(tokenizer, write_rows(rows, "jsonl"), tmp_path)
    assert stats["dropped"]["duplicate"] == 1
    assert stats["train_rows"] + stats["eval_rows"] + stats["dropped"]["duplicate_of_train"] == 17
    assert not set(evals.column("prompt_text")) & set(train.column("prompt_text"))


def test_source_texts_are_the_prompts_and_the_answers(write_rows):
    rows = [
        {"prompt": "What is 1 + 1?", "answer": 2},
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name 3."}],
            "answer": "three",
        },
    ]
    assert list(source_texts(DataConfig(format="prompt_answer"), write_rows(rows, "jsonl"))) == [
        "What is 1 + 1?",
        "2",
        "Be brief.",
        "Name 3.",
        "three",
    ]


def test_the_offline_source_reads_the_bundled_arithmetic(tokenizer, tmp_path):
    assert offline_file("prompt_answer") == OFFLINE_ARITHMETIC
    assert loading.location("offline", "prompt_answer") == str(OFFLINE_ARITHMETIC)
    examples = read_rows(DataConfig(format="prompt_answer"))
    first = json.loads(OFFLINE_ARITHMETIC.read_text().splitlines()[0])
    assert examples[0] == {
        "messages": [{"role": "user", "content": first["prompt"]}],
        "response": first["answer"],
        "category": first["category"],
    }
    cfg = DataConfig(format="prompt_answer", max_train_rows=50, max_eval_rows=10)
    (tmp_path / "tables").mkdir()
    stats = write_token_tables([(cfg.mixture()[0], "offline")], tokenizer, cfg, tmp_path / "tables")
    assert stats["rows_in"] == len(examples) and sum(stats["dropped"].values()) == len(examples) - 60


def test_the_config_refuses_prompt_answer_mixed_with_other_formats_or_without_grpo():
    grpo = {"train": {"objective": "grpo", "batch_size": 8}}
    mixed = {"data": {"sources": [{"source": "a.jsonl", "format": "prompt_answer"}, {"source": "b.jsonl"}]}, **grpo}
    with pytest.raises(
        ConfigError, match=r"a mixture cannot mix prompt_answer rows with other formats \(got dolly, prompt_answer\)"
    ):
        config_from_dict(mixed)
    with pytest.raises(ConfigError, match="data.format=prompt_answer holds prompts for reinforcement learning"):
        config_from_dict({"data": {"format": "prompt_answer"}})
    with pytest.raises(ConfigError, match="train.objective=grpo samples answers to prompts"):
        config_from_dict(grpo)
    both = [{"source": "a.jsonl", "format": "prompt_answer"}, {"source": "b.jsonl", "format": "prompt_answer"}]
    assert config_from_dict({"data": {"sources": both}, **grpo}).data.mixture()[1].format == "prompt_answer"
