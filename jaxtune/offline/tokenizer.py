"""Byte-level BPE tokenizer with a Gemma-style chat template, trained on the bundled offline rows.

Special tokens and their ids: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<start_of_turn>` 4,
`<end_of_turn>` 5. The chat template writes `<bos>` itself; the tokenizer adds no special tokens
when it encodes, so `apply_chat_template(..., tokenize=True)` yields exactly one `<bos>`.

`tokenizer.eos_token` is `<end_of_turn>`: an assistant turn ends with it, so greedy decoding that
stops on `eos_token_id` stops at the end of the answer. `<eos>` keeps id 1 (as in Gemma) but is
never emitted by the template.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN)

# Gemma's layout: a leading system message is folded into the first user turn, roles are 'user' and
# 'model'. Unlike Gemma, the newline goes *between* turns rather than after each one, so a
# conversation ending in an assistant turn ends on `<end_of_turn>` (the eos) and the generation
# prompt is still a prefix of the full conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}{{ '\\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}<end_of_turn>"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}<start_of_turn>model{{ '\\n' }}{% endif %}"
)

_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train the BPE on `texts` and save a `transformers` tokenizer (with chat template) to `out_dir`."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )
    backend = _train_backend(texts, vocab_size)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=END_OF_TURN,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[EOS, START_OF_TURN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)


def texts_for_tokenizer(rows: list[dict]) -> list[str]:
    """The non-empty instruction, context and response strings of Dolly rows, in row order."""
    texts = []
    for row in rows:
        for key in ("instruction", "context", "response"):
            value = row.get(key)
            if isinstance(value, str) and value.strip():
                texts.append(value)
    return texts


def _train_backend(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` whose decode(encode(x)) == x for any text."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # No prefix space and no post-processor: encoding adds nothing, so text round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
