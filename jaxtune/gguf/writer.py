"""An HF model folder (config.json, safetensors, tokenizer) written as one GGUF file for llama.cpp.

The file holds what a GGUF runtime needs to run the model as training did: the tensors under GGUF
names, the architecture's hyperparameters, the tokenizer (tokens, merges, special-token ids, the
add-BOS flag) and the chat template. Tensors are written by the `gguf` package (its writer, name
maps and numpy quantizers); transformers' GGUF reader, which `import_gguf` uses, reads them back.

Two architectures: Llama (SmolLM2, Llama 3 without RoPE scaling) and Gemma 3 (text). llama.cpp
expects a Llama's Q and K rows in its own rotary layout (`_rotary_rows`) and a Gemma's norm weights
with the 1 Gemma adds at run time included (`_gemma_norm`); matrices are stored in the chosen type
and vectors (norms, biases) in float32, as llama.cpp's converter does. Tokenizers: byte-level BPE
(llama.cpp's `gpt2` model) and SentencePiece BPE (its `llama` model, `sentencepiece_scores`).
The file is written under a temporary name, read back and compared tensor by tensor with what was
written (`verify_gguf`), and only then renamed: a crash or a bad write never leaves a file at `path`.
`ollama_modelfile` gives the Ollama Modelfile that runs it with the chat template's turns and stops.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxtune.config import GGUF_TYPES as TYPES
from jaxtune.errors import ModelError, first_line
from jaxtune.gguf.reader import tensor_reader


def write_gguf(folder: str | Path, path: str | Path, qtype: str = "f16") -> Path:
    """Write the model of HF folder `folder` to `path` as GGUF, its matrices stored as `qtype`."""
    return write_ggufs(folder, {qtype: path})[0]


def write_ggufs(folder: str | Path, targets: dict[str, str | Path], tokenizer=None) -> list[Path]:
    """`write_gguf` for each (type, path) of `targets`, the model and its tokenizer read once for all
    (Gemma 3's 262k-token vocabulary takes about 8 s to read and lay out). `tokenizer`: the folder's
    tokenizer where the caller has it open already (opening Gemma 3's takes about 6 s)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    for qtype in targets:
        if qtype not in TYPES:
            raise ModelError(f"GGUF type {qtype!r}: not one of {', '.join(TYPES)}")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    tokenizer = _read_tokenizer(folder, config.vocab_size, tokenizer)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return [_write_one(folder, config, tensors, tokenizer, Path(path), qtype) for qtype, path in targets.items()]


def _write_one(
    folder: Path, config, tensors: dict[str, np.ndarray], tokenizer: _Tokenizer, path: Path, qtype: str
) -> Path:
    import gguf

    arch = ARCHITECTURES[config.model_type]
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(partial, arch.gguf)
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, tokenizer)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch.gguf)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    matrix_type = gguf.GGMLQuantizationType[qtype.upper()]
    written: dict[str, tuple[int, str]] = {}
    for name, array in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelError(f"{folder}: tensor {name!r} has no GGUF name for {config.model_type}")
        array = arch.tensor(name, array.astype(np.float32), config)
        kind = matrix_type if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
            kind = gguf.GGMLQuantizationType.F16  # Q8_0 blocks are 32 values of a row
        data = array if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        written[gguf_name] = (int(kind), _digest(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    try:
        verify_gguf(partial, written)
    except ModelError:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


def verify_gguf(path: str | Path, expected: dict[str, tuple[int, str]]) -> None:
    """Raise ModelError, naming the file and the first bad tensor, unless `path` reads back as a GGUF
    file holding exactly `expected`: GGUF tensor name -> (GGML type, sha256 of the tensor's bytes).
    A truncated file, a flipped byte or a missing tensor all fail here."""
    try:
        reader = tensor_reader(path)
        found = {t.name: (int(t.tensor_type), _digest(t.data)) for t in reader.tensors}
    except Exception as error:  # the reader's own errors on a damaged file are ValueError, IndexError, ...
        raise ModelError(f"{path}: not a readable GGUF file ({first_line(error)})") from error
    for name, (kind, digest) in expected.items():
        if name not in found:
            raise ModelError(f"{path}: tensor {name!r} is missing")
        if found[name][0] != kind:
            raise ModelError(f"{path}: tensor {name!r} is stored as type {found[name][0]}, not {kind}")
        if found[name][1] != digest:
            raise ModelError(f"{path}: tensor {name!r} differs from what was written")
    if set(found) - set(expected):
        raise ModelError(f"{path}: holds tensors that were not written: {sorted(set(found) - set(expected))[:3]}")


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()


def check_exportable(config, tokenizer) -> None:
    """Raise ModelError unless a model of transformers `config` with `tokenizer` can be written: what
    the train stage checks before it starts, so a run never trains for a file it cannot write."""
    check_supported(config)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelError(
            f"GGUF export writes tokenizers from a tokenizer.json only; {config.model_type}'s tokenizer "
            f"{type(tokenizer).__name__} has none"
        )
    tokenizer_json = json.loads(backend.to_str())
    if llama_cpp_vocabulary(tokenizer_json, f"{config.model_type}'s tokenizer").model == "llama":
        sentencepiece_scores(tokenizer_json, f"{config.model_type}'s tokenizer")


@dataclass(frozen=True)
class Vocabulary:
    """How llama.cpp reads a tokenizer: `model` is `tokenizer.ggml.model` ("gpt2", byte-level BPE, or
    "llama", SentencePiece BPE), `pre` its pre-tokenizer, `add_space_prefix` SentencePiece's leading ▁."""

    model: str
    pre: str
    add_space_prefix: bool = False


# llama.cpp splits text before BPE by the regexes of a named pre-tokenizer; these are the names whose
# splits equal a Hugging Face byte-level pre-tokenizer's (llama.cpp's llama-vocab.cpp): GPT-2's regex
# alone, and (SmolLM, StarCoder) every digit split off first. A tokenizer llama.cpp would split
# otherwise is refused rather than written to tokenize differently there.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_DIGITS = {"type": "Digits", "individual_digits": True}
# SentencePiece BPE as transformers converts it (Gemma, Llama 2): spaces become ▁, with or without
# a ▁ prepended, bytes outside the vocabulary as <0xNN> tokens. Splitting at " " after that
# normalizer (as the Gemma tokenizers transformers builds from GGUF files do) splits nothing.
_TO_UNDERSCORE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
_PREPEND = {"type": "Prepend", "prepend": "\u2581"}
_NO_OP_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}


def llama_cpp_vocabulary(tokenizer_json: dict, what: str) -> Vocabulary:
    """How llama.cpp is to read the tokenizer of `tokenizer_json` (a tokenizer.json's content) so that
    it splits text as Hugging Face does, or ModelError naming `what`."""

    def is_(step, expected):
        return all(step.get(key) == value for key, value in expected.items())

    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    normalizer = tokenizer_json.get("normalizer")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") == "BPE" and not normalizer:
        if len(steps) == 1 and is_(steps[0], _BYTE_LEVEL):
            return Vocabulary("gpt2", "gpt-2")
        if len(steps) == 2 and is_(steps[0], _DIGITS) and is_(steps[1], _BYTE_LEVEL):
            return Vocabulary("gpt2", "smollm")
    if model.get("type") == "BPE" and model.get("byte_fallback") and (not pre or pre == _NO_OP_SPLIT):
        if normalizer == _TO_UNDERSCORE:
            return Vocabulary("llama", "default", add_space_prefix=False)
        if normalizer == {"type": "Sequence", "normalizers": [_PREPEND, _TO_UNDERSCORE]}:
            return Vocabulary("llama", "default", add_space_prefix=True)
    raise ModelError(
        f"{what}: GGUF export writes byte-level BPE tokenizers that split text as GPT-2 or SmolLM "
        f"do, and SentencePiece BPE tokenizers; this one is {model.get('type')} with normalizer "
        f"{json.dumps(normalizer)[:80]} and pre-tokenizer {json.dumps(pre)[:120]}"
    )


def sentencepiece_scores(tokenizer_json: dict, what: str) -> np.ndarray:
    """Each id's score for llama.cpp's SentencePiece tokenizer, which merges the adjacent pair whose
    joined text is the best-scored token, where Hugging Face's BPE applies the best-ranked merge.

    A token's score is minus the rank of the first merge that makes it. That is one order only where
    the merges are SentencePiece's own, converted: every split of a merged token into two tokens is a
    merge, and every token of several characters (but added and byte tokens) is made by one. Then
    both pick the same pair at each step; otherwise ModelError names the first token that breaks it."""
    model = tokenizer_json["model"]
    vocab, merges = model["vocab"], [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    first: dict[str, int] = {}
    pairs = set()
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
        pairs.add((left, right))
    kept = {token["content"] for token in tokenizer_json.get("added_tokens", [])}
    for token in vocab:
        if token in kept or _is_byte(token):
            continue
        if token not in first and len(token) > 1:
            raise ModelError(
                f"{what}: token {token!r} is made by no merge: not a SentencePiece BPE vocabulary "
                f"llama.cpp would tokenize alike"
            )
        for cut in range(1, len(token) if token in first else 0):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in pairs:
                raise ModelError(
                    f"{what}: token {token!r} splits into {left!r} and {right!r} but no merge joins "
                    f"them: not a SentencePiece BPE vocabulary llama.cpp would tokenize alike"
                )
    scores = np.zeros(max(vocab.values()) + 1, np.float32)
    for token, rank in first.items():
        if token in vocab and token not in kept:
            scores[vocab[token]] = -float(rank)
    return scores


def _is_byte(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def check_supported(config) -> None:
    """Raise ModelError, naming what is supported, for a model this writer cannot write faithfully."""
    if config.model_type not in ARCHITECTURES:
        raise ModelError(
            f"GGUF export: model type {config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    ARCHITECTURES[config.model_type].check(config)


def gguf_architecture(config) -> str:
    """llama.cpp's name for the architecture of transformers `config`, or ModelError as `check_supported`."""
    check_supported(config)
    return ARCHITECTURES[config.model_type].gguf


def _check_llama(config) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        # llama.cpp keeps Llama 3's scaled frequencies in a tensor transformers' reader ignores,
        # so the file could not be checked against the model it came from.
        raise ModelError(f"GGUF export: RoPE scaling {rope['rope_type']!r} is not supported; only unscaled RoPE")


def _check_gemma3(config) -> None:
    """llama.cpp runs every Gemma 3 (but the 27B) with five sliding-window layers to one global, a
    local RoPE base of 10,000 and queries scaled by 1/sqrt(head_dim), whatever the file says: a model
    built otherwise would run differently there, so it is refused."""
    layers = config.num_hidden_layers
    pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    if list(config.layer_types) != pattern:
        raise ModelError(
            "GGUF export: Gemma 3 layers must be five sliding-window layers to one global, as "
            "llama.cpp runs them; this model's are " + ", ".join(t.split("_")[0] for t in config.layer_types)
        )
    rope = config.rope_parameters
    for kind, theta in (("sliding_attention", 10000.0), ("full_attention", None)):
        if rope[kind].get("rope_type", "default") != "default":
            raise ModelError(
                f"GGUF export: RoPE scaling {rope[kind]['rope_type']!r} is not supported; only unscaled RoPE"
            )
        if theta is not None and rope[kind]["rope_theta"] != theta:
            raise ModelError(
                f"GGUF export: a Gemma 3 local RoPE base of {rope[kind]['rope_theta']:g} is not "
                f"supported; llama.cpp runs {theta:g}"
            )
    if config.query_pre_attn_scalar != config.head_dim:
        raise ModelError(
            f"GGUF export: Gemma 3 queries scaled by 1/sqrt({config.query_pre_attn_scalar:g}) are not "
            f"supported; llama.cpp scales by 1/sqrt(head_dim) = 1/sqrt({config.head_dim})"
        )
    if (
        config.attn_logit_softcapping
        or config.final_logit_softcapping
        or getattr(config, "use_bidirectional_attention", False)
    ):
        raise ModelError("GGUF export: Gemma 3 with soft-capping or bidirectional attention is not supported")


def _write_hyperparameters(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    ARCHITECTURES[config.model_type].keys(writer, config)


def _llama_keys(writer, config) -> None:
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))


def _gemma3_keys(writer, config) -> None:
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_rope_freq_base_swa(float(config.rope_parameters["sliding_attention"]["rope_theta"]))
    writer.add_sliding_window(config.sliding_window)


@dataclass(frozen=True)
class _Tokenizer:
    """What a file says of the tokenizer: the same for every type written."""

    vocabulary: Vocabulary
    tokens: list[str]
    kinds: list[int]
    scores: list[float] | None  # SentencePiece only
    special: object  # gguf.SpecialVocab: special ids, add-BOS/EOS, merges (byte-level BPE), chat template


def _read_tokenizer(folder: Path, vocab_size: int, tokenizer=None) -> _Tokenizer:
    """How llama.cpp is to read `folder`'s tokenizer.json (or ModelError naming the file): every id's token (ids the tokenizer lacks, as padding rows of a larger embedding, get
    placeholder names), special tokens as control tokens; for byte-level BPE (llama.cpp's `gpt2`
    model) the merges, for SentencePiece BPE (its `llama` model) each token's score and kind;
    special ids, add-BOS and the chat template from the folder's files."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelError(f"{tokenizer_file}: missing; GGUF export writes tokenizers from a tokenizer.json only")
    tokenizer_json = json.loads(tokenizer_file.read_text())
    vocabulary = llama_cpp_vocabulary(tokenizer_json, str(tokenizer_file))
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(folder)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_tokens)
    scores = None
    if vocabulary.model == "gpt2":
        kinds = [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    else:
        by_rank = sentencepiece_scores(tokenizer_json, str(tokenizer_file))
        added = {token["content"]: token["special"] for token in tokenizer_json.get("added_tokens", [])}

        def kind(i, token):
            if i >= len(by_rank) or i not in by_id:
                return gguf.TokenType.UNUSED
            if token in added:  # matched whole in the text before any merge, by llama.cpp as by Hugging Face
                return gguf.TokenType.CONTROL if added[token] or token in special else gguf.TokenType.USER_DEFINED
            return gguf.TokenType.BYTE if _is_byte(token) else gguf.TokenType.NORMAL

        scores = [float(by_rank[i]) if i < len(by_rank) else 0.0 for i in range(vocab_size)]
        kinds = [kind(i, token) for i, token in enumerate(tokens)]
    special_vocab = gguf.SpecialVocab(folder, load_merges=vocabulary.model == "gpt2", n_vocab=vocab_size)
    # Whether a runtime adds <bos> and <eos> to a text, as the tokenizer itself does when it encodes one
    # (where no file says, llama.cpp and transformers' reader add <bos> to a SentencePiece vocabulary).
    ids = tokenizer("a")["input_ids"]
    special_vocab.add_special_token = {
        "bos": tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id],
        "eos": tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id],
    }
    return _Tokenizer(vocabulary, tokens, kinds, scores, special_vocab)


def _write_tokenizer(writer, tokenizer: _Tokenizer) -> None:
    writer.add_tokenizer_model(tokenizer.vocabulary.model)
    writer.add_tokenizer_pre(tokenizer.vocabulary.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.kinds)
    if tokenizer.scores is not None:
        writer.add_token_scores(tokenizer.scores)
        writer.add_add_space_prefix(tokenizer.vocabulary.add_space_prefix)
    tokenizer.special.add_to_gguf(writer, quiet=True)


def _gemma_norm(name: str, array: np.ndarray, config) -> np.ndarray:
    """Gemma's RMS norms scale by 1 + w, llama.cpp's by w: the 1 is added here, as llama.cpp's
    converter does (transformers' GGUF reader takes it off)."""
    return array + np.float32(1) if name.endswith("norm.weight") else array


def _rotary_rows(name: str, array: np.ndarray, config) -> np.ndarray:
    """Q and K projections reordered from HF's rotary layout (halves) to llama.cpp's (pairs), as
    llama.cpp's converter does; transformers' GGUF reader undoes it."""
    if ".q_proj." in name:
        heads = config.num_attention_heads
    elif ".k_proj." in name:
        heads = config.num_key_value_heads
    else:
        return array
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class _Architecture:
    """What llama.cpp needs of one transformers model type beyond what every architecture shares."""

    gguf: str  # llama.cpp's name for it
    check: Callable  # (config): ModelError for a model llama.cpp would run otherwise
    keys: Callable  # (writer, config): its own hyperparameters
    tensor: Callable  # (HF name, float32 array, config): the array as llama.cpp reads it


ARCHITECTURES = {  # by transformers model_type
    "llama": _Architecture("llama", _check_llama, _llama_keys, _rotary_rows),
    "gemma3_text": _Architecture("gemma3", _check_gemma3, _gemma3_keys, _gemma_norm),
}


_ROLES = ("system", "user", "assistant")


def ollama_modelfile(gguf_name: str, tokenizer) -> str:
    """The Ollama Modelfile of GGUF file `gguf_name` (in the same folder): the tokenizer's chat
    template in Ollama's (Go template) syntax, and its end of turn as the stop token.

    The template is read off the Jinja template's own output: each role's text before and after a
    message's content, from conversations of placeholder messages, and the text that opens the
    answer. A template that folds the system message into the first user turn (Gemma's) gets the
    system message as a user turn of its own, as Ollama's Gemma templates do."""
    from jaxtune.data.templates import end_of_turn_ids

    stops = [tokenizer.convert_ids_to_tokens(i) for i in end_of_turn_ids(tokenizer)]
    lines = [f"FROM ./{gguf_name}"]
    template = _ollama_template(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def _ollama_template(tokenizer) -> str | None:
    """The Go template, or None where the Jinja template's output does not split into turns."""

    def render(messages, prompt=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def strip_bos(text):
        return (
            text[len(tokenizer.bos_token) :] if tokenizer.bos_token and text.startswith(tokenizer.bos_token) else text
        )

    def turn(text, content):
        """(before, after) `content` in one turn's text; whitespace that opens a turn (a separator the
        template writes between turns) counts as the end of the turn before it."""
        before, after = text.split(content)
        lead = before[: len(before) - len(before.lstrip())]
        return before.lstrip(), after, lead

    user_1, answer, user_2, system = "\x02U1\x02", "\x02A\x02", "\x02U2\x02", "\x02S\x02"
    one = [{"role": "user", "content": user_1}]
    two = [*one, {"role": "assistant", "content": answer}]
    first, answered, again = render(one), render(two), render([*two, {"role": "user", "content": user_2}])
    opening = render(one, prompt=True)
    if not (answered.startswith(first) and again.startswith(answered) and opening.startswith(first)):
        return None
    if answered[len(first) :].count(answer) != 1 or again[len(answered) :].count(user_2) != 1:
        return None
    turns = {"assistant": turn(answered[len(first) :], answer), "user": turn(again[len(answered) :], user_2)}
    separator = turns["user"][2]
    if turns["assistant"][2] != separator or not opening[len(first) :].startswith(separator):
        return None  # turns separated by different text: beyond a per-role template
    opening = opening[len(first) + len(separator) :]
    # What comes before the first user turn: a <bos> the tokenizer adds itself, or a default system turn.
    header = strip_bos(first[: first.index(user_1) - len(turns["user"][0])])
    with_system = strip_bos(render([{"role": "system", "content": system}, *one]))
    first_user = first[first.index(user_1) - len(turns["user"][0]) :]
    if with_system.endswith(first_user) and with_system.count(system) == 1:
        turns["system"] = turn(with_system[: -len(first_user)], system)
    else:  # folded into the first user turn: written as a user turn of its own
        turns["system"] = turns["user"]
    branches = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
        f"{turns[role][0]}{{{{ .Content }}}}{turns[role][1]}{separator}"
        for i, role in enumerate(_ROLES)
    )
    default = f'{{{{ if ne (index .Messages 0).Role "system" }}}}{header}{{{{ end }}}}' if header else ""
    return f"{default}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{opening}"
