"""Prompt masking, the train/eval split, filters and caps, stats, and the Arrow round trip."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

from jaxtune.config import DataConfig
from jaxtune.data.rows import normalize_row
from jaxtune.data.tokenize import (
    ARROW_SCHEMA,
    IGNORE_INDEX,
    encode_example,
    read_arrow,
    split_examples,
    tokenize_dataset,
    write_arrow,
)
from jaxtune.errors import ChatTemplateError, DataError

pytestmark = pytest.mark.data


@pytest.fixture
def examples(make_dolly):
    """examples(n, seed): `n` generated Dolly rows, normalized."""

    def make(n: int, seed: int = 0) -> list[dict]:
        return [normalize_row(r, DataConfig(), f"row {i}") for i, r in enumerate(make_dolly(n, seed), start=1)]

    return make


def prompt_keys(rows: list[dict]) -> set[tuple]:
    return {tuple(r["input_ids"][: r["prompt_length"]]) for r in rows}


def test_labels_mask_the_prompt(examples, tokenizer):
    example = examples(3)[1]
    row = encode_example(example, tokenizer, loss_on="all_assistant")
    n = row["prompt_length"]
    prompt_ids = tokenizer.apply_chat_template(
        example["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert row["input_ids"][:n] == prompt_ids
    assert row["labels"][:n] == [IGNORE_INDEX] * n
    assert row["labels"][n:] == row["input_ids"][n:]
    assert tokenizer.decode(row["input_ids"][n:]) == example["response"] + "<end_of_turn>"
    assert row["length"] == len(row["input_ids"]) == len(row["labels"])
    assert row["input_ids"].count(tokenizer.bos_token_id) == 1 and row["input_ids"][0] == tokenizer.bos_token_id
    assert row["prompt_text"] == example["messages"][0]["content"]
    assert row["category"] == example["category"] and row["response"] == example["response"]


def test_loss_on_all_labels_every_token(examples, tokenizer):
    row = encode_example(examples(1)[0], tokenizer, loss_on="all")
    assert row["labels"] == row["input_ids"]


def test_empty_response_encodes_to_none(examples, tokenizer):
    example = dict(examples(1)[0], response="  \n")
    assert encode_example(example, tokenizer, loss_on="all_assistant") is None


def test_prompt_text_is_the_last_user_turn(tokenizer):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Name a colour"},
    ]
    row = encode_example(
        {"messages": turns, "response": "Blue", "category": "chat"}, tokenizer, loss_on="all_assistant"
    )
    assert row["prompt_text"] == "Name a colour"
    assert tokenizer.decode(row["input_ids"][row["prompt_length"] :]) == "Blue<end_of_turn>"


THREE_TURNS = {
    "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Sky colour?"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "Grass colour?"},
        {"role": "assistant", "content": "Green"},
        {"role": "user", "content": "Snow colour?"},
    ],
    "response": "White",
    "category": "chat",
}


def labelled_spans(row: dict, tokenizer) -> list[str]:
    """The text of each run of labelled tokens."""
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    return [tokenizer.decode(span) for span in [*spans, current] if span]


@pytest.mark.parametrize(
    ("loss_on", "spans"),
    [
        ("all_assistant", ["Blue<end_of_turn>", "Green<end_of_turn>", "White<end_of_turn>"]),
        ("last_assistant", ["White<end_of_turn>"]),
    ],
)
def test_loss_on_chooses_which_assistant_turns_carry_labels(tokenizer, loss_on, spans):
    row = encode_example(THREE_TURNS, tokenizer, loss_on)
    assert labelled_spans(row, tokenizer) == spans
    assert encode_example(THREE_TURNS, tokenizer, "all")["labels"] == row["input_ids"]


def test_template_whose_prompt_is_not_a_prefix_is_rejected(examples, tokenizer):
    bad = copy.deepcopy(tokenizer)
    bad.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>assistant-reply\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="chat template of tokenizer"):
        encode_example(examples(1)[0], bad, loss_on="all_assistant")


def test_split_is_deterministic_per_seed(examples, tokenizer):
    data = examples(60)
    cfg = DataConfig(eval_fraction=0.2, seed=3)
    first = tokenize_dataset(data, tokenizer, cfg)
    assert tokenize_dataset(data, tokenizer, cfg) == first
    other = tokenize_dataset(data, tokenizer, DataConfig(eval_fraction=0.2, seed=4))
    assert prompt_keys(other[1]) != prompt_keys(first[1])
    assert first[2]["eval_rows"] == 12 and first[2]["train_rows"] == 48


def test_eval_prompts_never_appear_in_train(examples, tokenizer):
    base = examples(30)
    # Every prompt twice, with different answers: most eval rows have a twin in train.
    data = base + [dict(e, response=e["response"] + " Indeed.") for e in base]
    train, eval_, stats = tokenize_dataset(data, tokenizer, DataConfig(eval_fraction=0.25, seed=0))
    assert prompt_keys(train).isdisjoint(prompt_keys(eval_))
    assert stats["dropped"]["duplicate_of_train"] == 15 - len(eval_) > 0


def test_caps_and_drops_are_counted(examples, tokenizer):
    data = examples(80)
    data[0] = dict(data[0], response="")
    lengths = sorted(encode_example(e, tokenizer, False)["length"] for e in data[1:])
    max_length = lengths[len(lengths) // 2]
    too_long = sum(length > max_length for length in lengths)
    cfg = DataConfig(eval_fraction=0.25, max_length=max_length, max_train_rows=5, max_eval_rows=2)
    train, eval_, stats = tokenize_dataset(data, tokenizer, cfg)
    dropped = stats["dropped"]
    assert (len(train), len(eval_)) == (5, 2) == (stats["train_rows"], stats["eval_rows"])
    assert dropped["too_long"] == too_long and dropped["empty_response"] == 1
    assert dropped["max_train_rows"] > 0 and dropped["max_eval_rows"] > 0
    assert sum(dropped.values()) + 5 + 2 == stats["rows_in"] == 80
    assert all(r["length"] <= max_length for r in train + eval_)


def test_stats(examples, tokenizer):
    train, eval_, stats = tokenize_dataset(examples(40), tokenizer, DataConfig(eval_fraction=0.25))
    assert stats["tokens"] == {"train": sum(r["length"] for r in train), "eval": sum(r["length"] for r in eval_)}
    assert stats["label_tokens"]["train"] == sum(sum(label != IGNORE_INDEX for label in r["labels"]) for r in train)
    assert sum(stats["categories"]["train"].values()) == len(train)
    assert sum(stats["categories"]["eval"].values()) == len(eval_)
    p = stats["length_percentiles"]
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"] == max(r["length"] for r in train + eval_)


def test_too_few_rows(examples, tokenizer):
    with pytest.raises(DataError, match="at least 2 rows"):
        tokenize_dataset(examples(1), tokenizer, DataConfig())


def test_arrow_round_trip(examples, tokenizer, tmp_path):
    train, _, _ = tokenize_dataset(examples(20), tokenizer, DataConfig())
    path = tmp_path / "train.arrow"
    write_arrow(train, path)
    table = read_arrow(path)
    assert table.schema.equals(ARROW_SCHEMA)
    assert table.to_pylist() == train
    assert not list(tmp_path.glob("*.tmp"))


def test_read_arrow_rejects_other_tables(tmp_path):
    path = tmp_path / "other.arrow"
    table = pa.table({"input_ids": [[1, 2]]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(DataError, match="not a token table"):
        read_arrow(path)


def test_pad_id_falls_back_to_eos_then_zero():
    from types import SimpleNamespace

    from jaxtune.data.tokenize import pad_id_of

    assert pad_id_of(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_id_of(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7  # Llama 3 ships no pad token
    assert pad_id_of(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def full_rows(data: list[dict], tokenizer, loss_on: str = "all_assistant") -> dict[str, dict]:
    """Each example's untruncated encoding, by its prompt text (unique in generated data)."""
    rows = [encode_example(e, tokenizer, loss_on) for e in data]
    return {r["prompt_text"]: r for r in rows}


@pytest.mark.parametrize("loss_on", ["all_assistant", "all"])
def test_truncate_cuts_answers_and_drops_rows_without_one(examples, tokenizer, loss_on):
    data, max_length = examples(40), 30  # generated prompts are 22-24 tokens, or 34-37 with a context passage
    full = full_rows(data, tokenizer, loss_on)
    cut = [r for r in full.values() if r["prompt_length"] < max_length < r["length"]]
    no_answer = [r for r in full.values() if r["prompt_length"] >= max_length]
    assert cut and no_answer
    cfg = DataConfig(eval_fraction=0.25, max_length=max_length, too_long="truncate", loss_on=loss_on)
    train, eval_, stats = tokenize_dataset(data, tokenizer, cfg)
    assert stats["truncated"] == len(cut) and stats["dropped"]["too_long"] == len(no_answer)
    assert len(train) + len(eval_) == 40 - len(no_answer)
    for row in train + eval_:
        whole = full[row["prompt_text"]]
        n = min(whole["length"], max_length)
        assert row["length"] == len(row["input_ids"]) == len(row["labels"]) == n
        assert row["input_ids"] == whole["input_ids"][:n] and row["labels"] == whole["labels"][:n]
        assert row["prompt_length"] == whole["prompt_length"] and row["response"] == whole["response"]
        assert any(label != IGNORE_INDEX for label in row["labels"][row["prompt_length"] :])


def test_drop_is_the_default_and_truncates_nothing(examples, tokenizer):
    data, max_length = examples(40), 46
    too_long = sum(r["length"] > max_length for r in full_rows(data, tokenizer).values())
    train, eval_, stats = tokenize_dataset(data, tokenizer, DataConfig(eval_fraction=0.25, max_length=max_length))
    assert stats["truncated"] == 0 and stats["dropped"]["too_long"] == too_long > 0
    assert len(train) + len(eval_) == 40 - too_long
    assert all(r["length"] <= max_length for r in train + eval_)


def test_exact_duplicates_are_dropped_before_the_split(examples, tokenizer):
    data = examples(30)
    repeated = [*data[:10], data[3], *data[10:], copy.deepcopy(data[0]), data[29]]
    cfg = DataConfig(eval_fraction=0.2)
    train, eval_, stats = tokenize_dataset(repeated, tokenizer, cfg)
    assert stats["dropped"]["duplicate"] == 3 and stats["rows_in"] == 33
    assert list(stats["dropped"])[0] == "duplicate"
    assert (train, eval_) == tokenize_dataset(data, tokenizer, cfg)[:2]  # the first copies, in their places


def test_rows_differing_in_response_or_category_are_not_duplicates(examples, tokenizer):
    data = examples(20)
    data += [dict(data[0], category="other"), dict(data[1], response=data[1]["response"] + " Indeed.")]
    _, _, stats = tokenize_dataset(data, tokenizer, DataConfig())
    assert stats["dropped"]["duplicate"] == 0


def test_copies_of_one_row_cannot_be_split(examples, tokenizer, error_line):
    one = examples(1)[0]
    assert error_line(tokenize_dataset, [one, dict(one), dict(one)], tokenizer, DataConfig()) == (
        "need at least 2 distinct rows to split into train and eval, got 1 (2 of the 3 rows are exact duplicates)"
    )


def test_all_rows_too_long(examples, tokenizer, error_line):
    assert error_line(tokenize_dataset, examples(12), tokenizer, DataConfig(max_length=16)) == (
        "no train rows left: all 12 rows were dropped "
        "(too_long: 12; rows longer than data.max_length=16 tokens; raise data.max_length or set data.too_long=truncate)"
    )


def test_all_prompts_too_long_to_truncate(examples, tokenizer, error_line):
    cfg = DataConfig(max_length=16, too_long="truncate")
    assert error_line(tokenize_dataset, examples(12), tokenizer, cfg) == (
        "no train rows left: all 12 rows were dropped "
        "(too_long: 12; rows whose prompt alone has data.max_length=16 tokens or more; raise data.max_length)"
    )


def test_all_dropped_names_each_reason_with_a_count(examples, tokenizer, error_line):
    data = examples(10)
    data = [dict(e, response="") for e in data[:3]] + data[3:] + [data[5]]
    assert error_line(tokenize_dataset, data, tokenizer, DataConfig(max_length=16)) == (
        "no train rows left: all 11 rows were dropped (duplicate: 1; exact repeats of an earlier row; "
        "empty_response: 3; rows whose response is empty; "
        "too_long: 7; rows longer than data.max_length=16 tokens; raise data.max_length or set data.too_long=truncate)"
    )


def test_empty_train_split(examples, tokenizer, error_line):
    data = examples(4)
    cfg = DataConfig(eval_fraction=0.25)
    held_out = split_examples(data, cfg.eval_fraction, cfg.seed)[1][0]
    data = [e if e is held_out else dict(e, response=" ") for e in data]
    assert error_line(tokenize_dataset, data, tokenizer, cfg) == (
        "no train rows left: every row of the train split (3 of the 4 rows in) was dropped "
        "(empty_response: 3; rows whose response is empty)"
    )


@pytest.mark.parametrize("problem", ["empty", "prompt_in_train"])
def test_empty_eval_split(examples, tokenizer, error_line, problem):
    data = examples(4)
    cfg = DataConfig(eval_fraction=0.25)
    train_ex, (held_out,) = split_examples(data, cfg.eval_fraction, cfg.seed)
    if problem == "empty":
        reason = "empty_response: 1; rows whose response is empty"
        bad = dict(held_out, response="")
    else:
        reason = "duplicate_of_train: 1; eval rows whose prompt is also a train prompt"
        bad = dict(held_out, messages=train_ex[0]["messages"])
    data = [bad if e is held_out else e for e in data]
    assert error_line(tokenize_dataset, data, tokenizer, cfg) == (
        f"no eval rows left: every row held out for eval (1 of the 4 rows in) was dropped ({reason}); "
        "raise data.eval_fraction=0.25 to hold out more"
    )
