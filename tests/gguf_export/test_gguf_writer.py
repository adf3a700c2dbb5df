"""A tiny Llama and the offline BPE tokenizer written as GGUF, read back by transformers' own GGUF
reader (an implementation independent of the writer): the same logits, tokenizer and template."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxtune.errors import ModelError
from jaxtune.gguf_writer import check_exportable, llama_cpp_pre_tokenizer, ollama_modelfile, verify_gguf, write_gguf

pytestmark = pytest.mark.gguf

TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama (unscaled RoPE, 300 tokens) saved with the offline tokenizer, as an export writes it."""
    from tests.gguf_export.llama import save_tiny_llama

    texts = [TEXT, "yes, it is the answer", "a fox and a dog"] * 20
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), texts, 64, 4, 2, eos_id=5)


def logits_of(folder, gguf_file=None, ids=None, round_to=None) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()
    if round_to is not None:  # the weights as the file stores them, rounded by PyTorch
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.data = parameter.data.to(round_to).float()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def ids(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).encode(TEXT)


# Measured when written: the re-read f32, f16 and bf16 files give exactly the logits of the PyTorch
# model (f16 and bf16: with its matrices rounded to that type by PyTorch). The file keeps the RMS
# norm's epsilon as float32 (1e-6 becomes 9.99999997e-07), which may move a logit in its last float32
# bit on another CPU; the bound allows that and nothing more. Without the rotary reordering of Q and K
# the logits move by up to 5.3e-3.
SAME_ARITHMETIC = 1e-6
# Q8_0 rounds each weight to 1/127 of its 32-block's largest magnitude: measured 7.6e-3 at most
# over the prompt's 300-token logits, with every top-1 kept; the bound is 4x that.
Q8_0_BOUND = 3e-2


@pytest.mark.parametrize(("qtype", "round_to"), [("f32", None), ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_reread_by_transformers_the_file_computes_the_models_logits(folder, ids, tmp_path, qtype, round_to):
    path = write_gguf(folder, tmp_path / f"model-{qtype}.gguf", qtype)
    got = logits_of(path.parent, path.name, ids)
    expected = logits_of(folder, None, ids, round_to)
    print(f"{qtype}: max |logit difference| {np.abs(got - expected).max():.2e}")
    np.testing.assert_allclose(got, expected, rtol=0, atol=SAME_ARITHMETIC)


def test_q8_0_keeps_every_top_token_within_its_bound(folder, ids, tmp_path):
    path = write_gguf(folder, tmp_path / "model-q8_0.gguf", "q8_0")
    got, expected = logits_of(path.parent, path.name, ids), logits_of(folder, None, ids)
    assert np.abs(got - expected).max() <= Q8_0_BOUND
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    float32_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"q8_0: max |logit difference| {np.abs(got - expected).max():.2e}; "
          f"{path.stat().st_size} bytes against {float32_bytes} of float32")


def test_the_tokenizer_and_chat_template_come_back(folder, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    original = AutoTokenizer.from_pretrained(folder)
    reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # Every token keeps its id; transformers' reader adds one token of its own past the vocabulary.
    assert {token: i for token, i in reread.get_vocab().items() if i < len(original)} == original.get_vocab()
    assert reread.encode(TEXT) == original.encode(TEXT)
    assert (reread.bos_token_id, reread.eos_token_id, reread.pad_token_id) == (
        original.bos_token_id, original.eos_token_id, original.pad_token_id)
    assert reread.chat_template == original.chat_template
    conversation = [{"role": "user", "content": "a fox?"}, {"role": "assistant", "content": "yes"}]
    assert reread.apply_chat_template(conversation) == original.apply_chat_template(conversation)


def test_an_unsupported_model_is_one_line_naming_what_is_supported(tmp_path):
    from tests.conftest import tiny_model

    tiny_model("gemma3").save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"^GGUF export: model type 'gemma3_text' is not supported; supported: llama$"):
        write_gguf(tmp_path, tmp_path / "x.gguf")
    tiny_model("llama").save_pretrained(tmp_path)  # Llama 3's scaled RoPE
    with pytest.raises(ModelError, match=r"^GGUF export: RoPE scaling 'llama3' is not supported; only unscaled RoPE$"):
        write_gguf(tmp_path, tmp_path / "x.gguf")


def test_a_folder_without_a_bpe_tokenizer_is_refused_before_a_file_is_written(folder, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"tokenizer\.json: missing; GGUF export writes byte-level BPE tokenizers only$"):
        write_gguf(bare, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_a_damaged_file_is_found_and_named(folder, tmp_path):
    import gguf

    path = write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    reader = gguf.GGUFReader(path)
    expected = {t.name: (int(t.tensor_type), _sha(t.data)) for t in reader.tensors}
    del reader
    verify_gguf(path, expected)  # the file as written passes
    flipped = tmp_path / "flipped.gguf"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's data
    flipped.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=rf"^{flipped}: tensor '[\w.]+' differs from what was written$"):
        verify_gguf(flipped, expected)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelError, match=rf"^{truncated}: (not a readable GGUF file|tensor '[\w.]+' differs)"):
        verify_gguf(truncated, expected)


def test_a_write_that_goes_wrong_leaves_no_file(folder, tmp_path, monkeypatch):
    import os

    import gguf

    close = gguf.GGUFWriter.close

    def close_then_lose_the_tail(writer):  # as a full disk or a killed copy would leave it
        close(writer)
        os.truncate(writer.path, os.path.getsize(writer.path) - 64)

    monkeypatch.setattr(gguf.GGUFWriter, "close", close_then_lose_the_tail)
    with pytest.raises(ModelError, match=r"model-f16\.gguf\.\d+: "):
        write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_the_exportable_check_names_the_tokenizer_and_the_architecture(folder, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from tests.conftest import tiny_model

    check_exportable(AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))  # passes
    with pytest.raises(ModelError, match=r"^GGUF export: model type 'gemma3_text' is not supported; supported: llama$"):
        check_exportable(tiny_model("gemma3").config, AutoTokenizer.from_pretrained(folder))


def _sha(array) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()


CHATML = (  # SmolLM2-135M-Instruct's chat template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
OLLAMA_CHATML = (
    'TEMPLATE """{{ if ne (index .Messages 0).Role "system" }}<|im_start|>system\n'
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{{ end }}"
    '{{ range .Messages }}{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
    '{{ end }}{{ end }}<|im_start|>assistant\n"""'
)
# The offline tokenizer's Gemma-style template: "\n" between turns, <bos> added by the tokenizer,
# a system message folded into the first user turn (so written as a user turn of its own).
OLLAMA_GEMMA = (
    'TEMPLATE """{{ range .Messages }}{{ if eq .Role "system" }}<start_of_turn>user\n{{ .Content }}<end_of_turn>\n'
    '{{ else if eq .Role "user" }}<start_of_turn>user\n{{ .Content }}<end_of_turn>\n'
    '{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n'
    '{{ end }}{{ end }}<start_of_turn>model\n"""'
)


def test_the_ollama_modelfile_formats_turns_as_the_chat_template_does(folder):
    from transformers import AutoTokenizer

    gemma_style = AutoTokenizer.from_pretrained(folder)
    assert ollama_modelfile("llama-f16.gguf", gemma_style) == (
        f'FROM ./llama-f16.gguf\n{OLLAMA_GEMMA}\nPARAMETER stop "<end_of_turn>"\n')
    chatml = AutoTokenizer.from_pretrained(folder)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = CHATML
    assert ollama_modelfile("llama-q8_0.gguf", chatml) == (
        f'FROM ./llama-q8_0.gguf\n{OLLAMA_CHATML}\nPARAMETER stop "<|im_end|>"\n')
    chatml.chat_template = None
    assert ollama_modelfile("llama-q8_0.gguf", chatml) == "FROM ./llama-q8_0.gguf\n"


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
LLAMA_3_SPLIT = {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"},
                 "behavior": "Isolated", "invert": False}


def test_the_pre_tokenizer_is_the_llama_cpp_one_that_splits_text_alike(folder, tmp_path):
    """llama.cpp splits text by its own named regexes before BPE: the name written must be the one
    whose splits equal the tokenizer's (the offline and the imported SmolLM2 tokenizers: GPT-2's)."""
    import gguf

    bpe = {"model": {"type": "BPE"}, "normalizer": None}
    assert llama_cpp_pre_tokenizer({**bpe, "pre_tokenizer": BYTE_LEVEL}, "t") == "gpt-2"
    digits_first = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
    assert llama_cpp_pre_tokenizer({**bpe, "pre_tokenizer": digits_first}, "t") == "smollm"  # SmolLM2's hub tokenizer
    for other in ({**BYTE_LEVEL, "add_prefix_space": True},
                  {"type": "Sequence", "pretokenizers": [LLAMA_3_SPLIT, {**BYTE_LEVEL, "use_regex": False}]}):
        with pytest.raises(ModelError, match=r"^t: GGUF export writes byte-level BPE tokenizers that split text as "
                                             r"GPT-2 or SmolLM do; this one is BPE with pre-tokenizer \{"):
            llama_cpp_pre_tokenizer({**bpe, "pre_tokenizer": other}, "t")
    path = write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"
