"""A tiny Llama with the offline byte-level BPE tokenizer, and a tiny Gemma 3 with a SentencePiece
BPE tokenizer, written as GGUF and read back by transformers' own GGUF reader (an implementation
independent of the writer): the same logits, tokenizer and template."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxtune.errors import ModelError
from jaxtune.gguf.writer import (
    Vocabulary,
    check_exportable,
    llama_cpp_vocabulary,
    ollama_modelfile,
    sentencepiece_scores,
    verify_gguf,
    write_gguf,
)

pytestmark = pytest.mark.gguf

TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama (unscaled RoPE, 300 tokens) saved with the offline tokenizer, as an export writes it."""
    from tests.gguf_export.llama import save_tiny_llama

    texts = [TEXT, "yes, it is the answer", "a fox and a dog"] * 20
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), texts, 64, 4, 2, eos_id=5)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 in llama.cpp's layer pattern (6 layers, a window of 8 tokens) with a SentencePiece
    BPE tokenizer of 351 tokens, its norms drawn away from zero."""
    from tests.gguf_export.gemma3 import save_tiny_gemma3

    texts = [TEXT, "yes, it is the answer", "a fox and a dog"] * 20
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), texts)


@pytest.fixture(params=["folder", "gemma3"], ids=["llama", "gemma3"])
def model_folder(request):
    return request.getfixturevalue(request.param)


def logits_of(folder, gguf_file=None, ids=None, round_to=None) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()
    if round_to is not None:  # the weights as the file stores them, rounded by PyTorch
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.data = parameter.data.to(round_to).float()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture
def ids(model_folder):
    """The prompt's ids: longer than Gemma's window of 8, so the sliding layers' masks count."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder).encode(f"{TEXT}, yes, it is the answer")


# Measured when written: the re-read f32, f16 and bf16 files give exactly the logits of the PyTorch
# model (f16 and bf16: with its matrices rounded to that type by PyTorch). The file keeps the RMS
# norm's epsilon as float32 (1e-6 becomes 9.99999997e-07), which may move a logit in its last float32
# bit on another CPU; the bound allows that and nothing more. Without the rotary reordering of Q and K
# the Llama's logits move by up to 5.3e-3; without the 1 added to its norms, the Gemma's by 0.58.
SAME_ARITHMETIC = 1e-6
# Q8_0 rounds each weight to 1/127 of its 32-block's largest magnitude: measured 7.6e-3 at most
# over the prompt's 300-token logits, with every top-1 kept; the bound is 4x that.
Q8_0_BOUND = 3e-2


@pytest.mark.parametrize(("qtype", "round_to"), [("f32", None), ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_reread_by_transformers_the_file_computes_the_models_logits(model_folder, ids, tmp_path, qtype, round_to):
    path = write_gguf(model_folder, tmp_path / f"model-{qtype}.gguf", qtype)
    got = logits_of(path.parent, path.name, ids)
    expected = logits_of(model_folder, None, ids, round_to)
    print(f"{qtype}: max |logit difference| {np.abs(got - expected).max():.2e}")
    np.testing.assert_allclose(got, expected, rtol=0, atol=SAME_ARITHMETIC)


def test_q8_0_keeps_every_top_token_within_its_bound(model_folder, ids, tmp_path):
    path = write_gguf(model_folder, tmp_path / "model-q8_0.gguf", "q8_0")
    got, expected = logits_of(path.parent, path.name, ids), logits_of(model_folder, None, ids)
    assert np.abs(got - expected).max() <= Q8_0_BOUND
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    float32_bytes = sum(f.stat().st_size for f in model_folder.glob("*.safetensors"))
    print(
        f"q8_0: max |logit difference| {np.abs(got - expected).max():.2e}; "
        f"{path.stat().st_size} bytes against {float32_bytes} of float32"
    )


# Text that exercises each kind of token: merged pieces, runs of spaces, characters outside the
# vocabulary (SentencePiece writes them as byte tokens), and special tokens matched whole.
TEXTS = (TEXT, "  two  spaces,   three", "é, ü and 狐", "<start_of_turn>user\na fox?<end_of_turn>")


def test_the_tokenizer_and_chat_template_come_back(model_folder, tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(model_folder, tmp_path / "model-f16.gguf", "f16")
    original = AutoTokenizer.from_pretrained(model_folder)
    reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # Every token keeps its id; transformers' reader adds one token of its own past the vocabulary.
    assert {token: i for token, i in reread.get_vocab().items() if i < len(original)} == original.get_vocab()
    for text in TEXTS:
        assert reread.encode(text) == original.encode(text), text
    assert (reread.bos_token_id, reread.eos_token_id, reread.pad_token_id) == (
        original.bos_token_id,
        original.eos_token_id,
        original.pad_token_id,
    )
    assert reread.chat_template == original.chat_template
    conversation = [{"role": "user", "content": "a fox?"}, {"role": "assistant", "content": "yes"}]
    assert reread.apply_chat_template(conversation) == original.apply_chat_template(conversation)


def test_an_unsupported_model_is_one_line_naming_what_is_supported(tmp_path):
    from tests.conftest import tiny_model

    tiny_model("gemma2").save_pretrained(tmp_path)
    with pytest.raises(
        ModelError, match=r"^GGUF export: model type 'gemma2' is not supported; supported: gemma3_text, llama$"
    ):
        write_gguf(tmp_path, tmp_path / "x.gguf")
    tiny_model("llama").save_pretrained(tmp_path)  # Llama 3's scaled RoPE
    with pytest.raises(ModelError, match=r"^GGUF export: RoPE scaling 'llama3' is not supported; only unscaled RoPE$"):
        write_gguf(tmp_path, tmp_path / "x.gguf")


def test_a_gemma3_that_llama_cpp_would_run_otherwise_is_refused(gemma3):
    """llama.cpp fixes Gemma 3's layer pattern, local RoPE base and query scale whatever a file says."""
    from transformers import AutoConfig, AutoTokenizer

    from tests.conftest import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    check_exportable(AutoConfig.from_pretrained(gemma3), tokenizer)  # passes
    with pytest.raises(
        ModelError,
        match=r"^GGUF export: Gemma 3 layers must be five sliding-window layers to one "
        r"global, as llama\.cpp runs them; this model's are sliding, full$",
    ):
        check_exportable(tiny_model("gemma3").config, tokenizer)  # alternating, as the toy recipes'
    config = AutoConfig.from_pretrained(gemma3)
    config.query_pre_attn_scalar = 64
    with pytest.raises(
        ModelError,
        match=r"^GGUF export: Gemma 3 queries scaled by 1/sqrt\(64\) are not supported; "
        r"llama\.cpp scales by 1/sqrt\(head_dim\) = 1/sqrt\(256\)$",
    ):
        check_exportable(config, tokenizer)
    config = AutoConfig.from_pretrained(gemma3)
    config.rope_parameters["sliding_attention"]["rope_theta"] = 20000.0
    with pytest.raises(
        ModelError,
        match=r"^GGUF export: a Gemma 3 local RoPE base of 20000 is not supported; "
        r"llama\.cpp runs 10000$",
    ):
        check_exportable(config, tokenizer)


def test_a_folder_without_a_bpe_tokenizer_is_refused_before_a_file_is_written(folder, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(
        ModelError, match=r"tokenizer\.json: missing; GGUF export writes tokenizers from a tokenizer\.json only$"
    ):
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
    with pytest.raises(
        ModelError, match=r"^GGUF export: model type 'qwen3' is not supported; supported: gemma3_text, llama$"
    ):
        check_exportable(tiny_model("qwen3").config, AutoTokenizer.from_pretrained(folder))


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
        f'FROM ./llama-f16.gguf\n{OLLAMA_GEMMA}\nPARAMETER stop "<end_of_turn>"\n'
    )
    chatml = AutoTokenizer.from_pretrained(folder)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = CHATML
    assert ollama_modelfile("llama-q8_0.gguf", chatml) == (
        f'FROM ./llama-q8_0.gguf\n{OLLAMA_CHATML}\nPARAMETER stop "<|im_end|>"\n'
    )
    chatml.chat_template = None
    assert ollama_modelfile("llama-q8_0.gguf", chatml) == "FROM ./llama-q8_0.gguf\n"


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
LLAMA_3_SPLIT = {
    "type": "Split",
    "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"},
    "behavior": "Isolated",
    "invert": False,
}


def test_the_pre_tokenizer_is_the_llama_cpp_one_that_splits_text_alike(folder, tmp_path):
    """llama.cpp splits text by its own named regexes before BPE: the name written must be the one
    whose splits equal the tokenizer's (the offline and the imported SmolLM2 tokenizers: GPT-2's)."""
    import gguf

    bpe = {"model": {"type": "BPE"}, "normalizer": None}
    assert llama_cpp_vocabulary({**bpe, "pre_tokenizer": BYTE_LEVEL}, "t") == Vocabulary("gpt2", "gpt-2")
    digits_first = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
    assert llama_cpp_vocabulary({**bpe, "pre_tokenizer": digits_first}, "t") == Vocabulary(
        "gpt2", "smollm"
    )  # SmolLM2's hub tokenizer
    for other in (
        {**BYTE_LEVEL, "add_prefix_space": True},
        {"type": "Sequence", "pretokenizers": [LLAMA_3_SPLIT, {**BYTE_LEVEL, "use_regex": False}]},
    ):
        with pytest.raises(
            ModelError,
            match=r"^t: GGUF export writes byte-level BPE tokenizers that split text as "
            r"GPT-2 or SmolLM do, and SentencePiece BPE tokenizers; this one is BPE "
            r"with normalizer null and pre-tokenizer \{",
        ):
            llama_cpp_vocabulary({**bpe, "pre_tokenizer": other}, "t")
    path = write_gguf(folder, tmp_path / "model-f16.gguf", "f16")
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "gpt-2"


SPM = {"model": {"type": "BPE", "byte_fallback": True}, "pre_tokenizer": None}
TO_UNDERSCORE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}


def test_a_sentencepiece_vocabulary_is_written_for_llama_cpps_own_sentencepiece_tokenizer(gemma3, tmp_path):
    """Gemma's tokenizer as llama.cpp's `llama` model: each token's kind, no leading space, <bos>
    added, and scores that order the merged tokens as the merges do (llama.cpp reads no merges)."""
    import json

    import gguf
    from transformers import AutoTokenizer

    assert llama_cpp_vocabulary({**SPM, "normalizer": TO_UNDERSCORE}, "t") == Vocabulary("llama", "default", False)
    prepended = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, TO_UNDERSCORE]}
    assert llama_cpp_vocabulary({**SPM, "normalizer": prepended}, "t") == Vocabulary(
        "llama", "default", True
    )  # Llama 2's
    path = write_gguf(gemma3, tmp_path / "model-f16.gguf", "f16")
    fields = gguf.GGUFReader(path).fields
    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    tokens = fields["tokenizer.ggml.tokens"].contents()
    kinds = dict(zip(tokens, fields["tokenizer.ggml.token_type"].contents()))
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    assert {kinds[t] for t in tokenizer.all_special_tokens} == {gguf.TokenType.CONTROL}
    assert [kinds[f"<0x{b:02X}>"] for b in range(256)] == [gguf.TokenType.BYTE] * 256
    assert sum(kind == gguf.TokenType.NORMAL for kind in kinds.values()) == len(tokens) - 256 - 7
    assert fields["tokenizer.ggml.model"].contents() == "llama" and "tokenizer.ggml.merges" not in fields
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True  # as the tokenizer adds it
    scores = dict(zip(tokens, fields["tokenizer.ggml.scores"].contents()))
    merges = json.loads((gemma3 / "tokenizer.json").read_text())["model"]["merges"]
    made = list(dict.fromkeys("".join(merge) for merge in merges))  # each merged token, by its best merge
    assert [scores[t] for t in made] == sorted((scores[t] for t in made), reverse=True) and len(
        set(map(scores.get, made))
    ) == len(made)
    assert (
        fields["gemma3.attention.sliding_window"].contents() == 8
        and fields["gemma3.attention.key_length"].contents() == 256
    )
    assert (fields["gemma3.rope.freq_base"].contents(), fields["gemma3.rope.freq_base_swa"].contents()) == (1e6, 1e4)


def test_a_bpe_vocabulary_llama_cpp_would_merge_otherwise_is_refused():
    """llama.cpp joins any two adjacent pieces that make a token; Hugging Face only those a merge names."""
    vocab = {"<0x41>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, "abc": 6}
    merges = [["b", "c"], ["a", "b"], ["ab", "c"]]  # "a" + "bc" makes "abc" too, but no merge says so
    spm = {**SPM, "normalizer": TO_UNDERSCORE, "added_tokens": []}
    with pytest.raises(
        ModelError,
        match=r"^t: token 'abc' splits into 'a' and 'bc' but no merge joins them: not a "
        r"SentencePiece BPE vocabulary llama\.cpp would tokenize alike$",
    ):
        sentencepiece_scores({**spm, "model": {**spm["model"], "vocab": vocab, "merges": merges}}, "t")
    complete = [*merges, ["a", "bc"]]
    scores = sentencepiece_scores({**spm, "model": {**spm["model"], "vocab": vocab, "merges": complete}}, "t")
    assert scores.tolist() == [0, 0, 0, 0, -1, 0, -2]  # bytes and single characters 0; "abc" by its first merge
