"""Preference pairs (data.format: preference) read from every file type into token tables of two rows per pair."""

from __future__ import annotations

import json

import pytest

from jaxtune.config import DataConfig, load_config
from jaxtune.data.token_table import TokenTable
from jaxtune.data.tokenize import IGNORE_INDEX, write_token_tables
from jaxtune.errors import ConfigError

pytestmark = [pytest.mark.data, pytest.mark.preference]


def make_pairs(n: int) -> list[dict]:
    """`n` distinct pairs: the chosen answer names the right colour, the rejected one another colour."""
    colours = ["red", "blue", "green", "grey", "pink", "brown"]
    return [
        {
            "prompt": f"What colour is item {i}?",
            "chosen": f"Item {i} is {colours[i % 6]}.",
            "rejected": f"Item {i} is {colours[(i + 1) % 6]} and large.",
            "category": ["qa", "colours"][i % 2],
        }
        for i in range(n)
    ]


def tables(tokenizer, path, tmp_path, **settings):
    cfg = DataConfig(source=str(path), format="preference", eval_fraction=0.25, **settings)
    folder = tmp_path / "tables"
    folder.mkdir()
    stats = write_token_tables([(cfg.mixture()[0], str(path))], tokenizer, cfg, folder)
    return stats, TokenTable(folder / "train.arrow"), TokenTable(folder / "eval.arrow")


def answer_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([int(t) for t, label in zip(ids, labels) if label != IGNORE_INDEX])


@pytest.mark.parametrize("ext", ["jsonl", "csv", "parquet", "json"])
def test_each_pair_is_its_chosen_row_then_its_rejected_row(ext, write_rows, tokenizer, tmp_path):
    pairs = make_pairs(16)
    stats, train, evals = tables(tokenizer, write_rows(pairs, ext), tmp_path)
    assert stats["preference"] is True
    assert (stats["train_rows"], stats["eval_rows"]) == (12, 4)  # pairs, each two rows
    assert (len(train), len(evals)) == (24, 8)
    by_prompt = {p["prompt"]: p for p in pairs}
    for table in (train, evals):
        prompts, answers = table.column("prompt_text"), table.column("response")
        for k in range(0, len(table), 2):
            pair = by_prompt[prompts[k]]
            assert prompts[k + 1] == prompts[k]
            assert (answers[k], answers[k + 1]) == (pair["chosen"], pair["rejected"])
            chosen_ids, rejected_ids = table.input_ids[k], table.input_ids[k + 1]
            prompt_length = table.column("prompt_length")[k]
            # One prompt, tokenized alike, before each answer; the labels cover the answer and its end of turn alone.
            assert list(chosen_ids[:prompt_length]) == list(rejected_ids[:prompt_length])
            assert pair["chosen"] in answer_text(tokenizer, chosen_ids, table.labels[k])
            assert pair["rejected"] in answer_text(tokenizer, rejected_ids, table.labels[k + 1])
            assert all(label == IGNORE_INDEX for label in table.labels[k][:prompt_length])


def test_messages_and_conversational_answers(write_rows, tokenizer, tmp_path):
    rows = [
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Name colour {i}."}],
            "chosen": [{"role": "assistant", "content": f"Colour {i} is red."}],
            "rejected": f"Colour {i} is blue.",
        }
        for i in range(8)
    ]
    stats, train, _ = tables(tokenizer, write_rows(rows, "jsonl"), tmp_path)
    assert stats["train_rows"] == 6
    assert train.column("response")[0].endswith("red.") and train.column("response")[1].endswith("blue.")
    assert "Be brief." in tokenizer.decode(list(train.input_ids[0]))


def test_identical_answers_are_dropped_and_counted(write_rows, tokenizer, tmp_path):
    pairs = make_pairs(16)
    for pair in pairs[:3]:
        pair["rejected"] = pair["chosen"]
    pairs[3]["rejected"] = ""
    stats, train, evals = tables(tokenizer, write_rows(pairs, "jsonl"), tmp_path)
    assert stats["dropped"]["identical_pair"] == 3
    assert stats["dropped"]["empty_response"] == 1
    assert stats["train_rows"] + stats["eval_rows"] == 12
    assert len(train) + len(evals) == 24


def test_a_pair_too_long_is_dropped_whole_or_both_answers_truncated(write_rows, tokenizer, tmp_path):
    pairs = make_pairs(16)
    pairs[0]["rejected"] = " ".join(["very"] * 200) + " long."
    stats, train, evals = tables(tokenizer, write_rows(pairs, "jsonl"), tmp_path, max_length=64)
    assert stats["dropped"]["too_long"] == 1
    assert len(train) + len(evals) == 30
    (tmp_path / "truncate").mkdir()
    stats, train, evals = tables(
        tokenizer, write_rows(pairs, "jsonl"), tmp_path / "truncate", max_length=64, too_long="truncate"
    )
    assert stats["truncated"] == 1 and stats["dropped"]["too_long"] == 0
    assert max(train.lengths.max(), evals.lengths.max()) == 64
    # Percentiles are of rows, as for SFT: the longest is one answer cut to max_length, not the pair's sum.
    assert stats["length_percentiles"]["max"] == 64
    assert stats["tokens"]["train"] + stats["tokens"]["eval"] == train.lengths.sum() + evals.lengths.sum()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"chosen": "a", "rejected": "b"}, "needs its prompt as 'prompt' (text) or 'messages'"),
        ({"prompt": "q", "messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}, "got both"),
        ({"prompt": "q", "chosen": "a"}, "missing column 'rejected'"),
        (
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "a",
                "rejected": "b",
            },
            "must be a 'user' turn",
        ),
        (
            {"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
            "'chosen' must be the 'assistant' answer",
        ),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(row, message, write_rows, tokenizer, tmp_path, error_line):
    rows = make_pairs(6)
    rows.insert(4, row)
    path = write_rows(rows, "jsonl")
    line = error_line(tables, tokenizer, path, tmp_path)
    assert line.startswith(f"{path} line 5: ") and message in line, line


def test_the_objective_and_the_data_must_agree():
    with pytest.raises(ConfigError, match="set data.format=preference"):
        load_config(overrides=["train.objective=dpo"])
    with pytest.raises(ConfigError, match="set train.objective=dpo"):
        load_config(overrides=["data.format=preference"])
    with pytest.raises(ConfigError, match="loss_type=robust"):
        load_config(overrides=["data.format=preference", "train.objective=dpo", "preference.label_smoothing=0.1"])
    cfg = load_config(overrides=["data.format=preference", "train.objective=simpo", "preference.label_smoothing=0.1"])
    assert cfg.preference.label_smoothing == 0.1
    assert json.dumps(cfg.preference.model_dump())  # a plain section, hashed into keys
