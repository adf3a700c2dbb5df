"""The offline byte-level BPE tokenizer: exact round trips, one bos, the chat template, determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxtune.offline.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, texts_for_tokenizer, train_tokenizer

ROWS = [
    {
        "instruction": f"What does item {i} do?",
        "context": "It is a tool." if i % 3 else "",
        "response": f"Item {i} helps with chores.",
        "category": "open_qa",
    }
    for i in range(200)
]
TEXTS = texts_for_tokenizer(ROWS)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, vocab_size=400, out_dir=out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


ODD_TEXTS = [
    "Item 7 helps.",
    "  leading and trailing  ",
    "héllo wörld 🙂 ∑ 中文",
    "tabs\tand\nnewlines\r\n",
    "",
    "<b>x</b>",
]


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_decode_encode_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids


def test_special_tokens(tok):
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4, 5]
    assert (tok.pad_token, tok.bos_token, tok.unk_token) == ("<pad>", "<bos>", "<unk>")
    assert tok.eos_token == "<end_of_turn>" and tok.eos_token_id == 5
    assert tok("<start_of_turn>model")["input_ids"][0] == 4
    assert len(tok) == 400


def test_encoding_text_adds_no_special_tokens(tok):
    assert tok.bos_token_id not in tok("Item 7 helps.")["input_ids"]


def test_chat_template_has_a_single_bos(tok):
    chat = [{"role": "user", "content": "What does item 3 do?"}, {"role": "assistant", "content": "It helps."}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.eos_token_id


def test_chat_template_two_turns(tok):
    chat = [
        {"role": "user", "content": "What does item 3 do?"},
        {"role": "assistant", "content": "It helps."},
        {"role": "user", "content": " And item 4? "},
        {"role": "assistant", "content": "Chores."},
    ]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<bos><start_of_turn>user\nWhat does item 3 do?<end_of_turn>\n"
        "<start_of_turn>model\nIt helps.<end_of_turn>\n"
        "<start_of_turn>user\nAnd item 4?<end_of_turn>\n"
        "<start_of_turn>model\nChores.<end_of_turn>"
    )
    assert tok.apply_chat_template(chat[:3], tokenize=False, add_generation_prompt=True).endswith(
        "<start_of_turn>user\nAnd item 4?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_system_message_folds_into_first_user_turn(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_saved_template_is_loaded(tok):
    assert tok.chat_template == CHAT_TEMPLATE


def test_training_is_deterministic(tok_dir, tmp_path):
    train_tokenizer(TEXTS, vocab_size=400, out_dir=tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()


def test_texts_for_tokenizer_skips_empty_fields():
    rows = [
        {"instruction": "Q", "context": "", "response": "A"},
        {"instruction": "Q2", "context": "C", "response": "A2"},
    ]
    assert texts_for_tokenizer(rows) == ["Q", "A", "Q2", "C", "A2"]


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least 262"):
        train_tokenizer(TEXTS, vocab_size=100, out_dir=tmp_path)
