"""A tiny Gemma 3 the GGUF writer can write, with a SentencePiece BPE tokenizer built as transformers
builds Gemma's: the shape llama.cpp runs every Gemma 3 in (five sliding-window layers to one global,
a local RoPE base of 10,000, queries scaled by 1/sqrt(head_dim)) and head_dim 256, the query scale
transformers' GGUF reader assumes for Gemma 3.

The tokenizer's pieces are learned by a BPE trainer on the texts (spaces as ▁), laid out as a
SentencePiece vocabulary (special tokens, the 256 byte tokens, then pieces best first), and its
merges are every split of each piece, best piece first: what transformers derives from a
SentencePiece model or a GGUF file's vocabulary (`generate_merges`)."""

from __future__ import annotations

from pathlib import Path

# Gemma 3's own chat template (it writes <bos>; the tokenizer adds it as well, as Gemma's does).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


def save_spm_tokenizer(folder: Path, texts: list[str], pieces: int = 200):
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=pieces, show_progress=False))
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    tokens = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *(piece for piece, _ in learned)]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = generate_merges(vocab, {token: -i for i, token in enumerate(tokens)}, skip_tokens=set(SPECIAL))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)  # as Gemma's adds <bos>
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_tiny_gemma3(folder: Path, texts: list[str], layers: int = 6, sliding_window: int = 8) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.config import TinyModelConfig
    from jaxtune.offline.architectures import tiny_config

    tokenizer = save_spm_tokenizer(folder, texts)
    vocab = len(tokenizer)
    shape = TinyModelConfig(
        architecture="gemma3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=sliding_window,
        vocab_size=vocab,
    )
    config = tiny_config(
        "gemma3",
        shape,
        vocab,
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.convert_tokens_to_ids("<end_of_turn>"),
    )
    config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config.query_pre_attn_scalar = 256
    config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from their zero start, so the +1 llama.cpp expects shows if missed
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0, 0.3)
    model.save_pretrained(folder)
    return folder
