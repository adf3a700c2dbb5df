"""An HF model folder (config.json, safetensors, tokenizer) written as one GGUF file for llama.cpp.

The file holds what a GGUF runtime needs to run the model as training did: the tensors under GGUF
names, the architecture's hyperparameters, the tokenizer (tokens, merges, special-token ids, the
add-BOS flag) and the chat template. Tensors are written by the `gguf` package (its writer, name
maps and numpy quantizers); transformers' GGUF reader, which `import_gguf` uses, reads them back.

Llama-architecture models with a byte-level BPE tokenizer (SmolLM2, Llama 3 without RoPE scaling)
only, for now. llama.cpp expects Q and K rows in its own rotary layout (`_rotary_rows`); matrices
are stored in the chosen type and vectors (norms, biases) in float32, as llama.cpp's converter does.
The file is written under a temporary name, read back and compared tensor by tensor with what was
written (`verify_gguf`), and only then renamed: a crash or a bad write never leaves a file at `path`.
`ollama_modelfile` gives the Ollama Modelfile that runs it with the chat template's turns and stops.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from jaxtune.config import GGUF_TYPES as TYPES
from jaxtune.errors import ModelError, first_line
from jaxtune.gguf_reader import plain_reader

ARCHITECTURES = {"llama": "llama"}  # HF model_type -> GGUF architecture


def write_gguf(folder: str | Path, path: str | Path, qtype: str = "f16") -> Path:
    """Write the model of HF folder `folder` to `path` as GGUF, its matrices stored as `qtype`."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    folder, path = Path(folder), Path(path)
    if qtype not in TYPES:
        raise ModelError(f"GGUF type {qtype!r}: not one of {', '.join(TYPES)}")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    pre_tokenizer = check_tokenizer(folder)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    arch = ARCHITECTURES[config.model_type]
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(partial, arch)
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, AutoTokenizer.from_pretrained(folder), folder, config.vocab_size, pre_tokenizer)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    matrix_type = gguf.GGMLQuantizationType[qtype.upper()]
    written: dict[str, tuple[int, str]] = {}
    for name, array in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelError(f"{folder}: tensor {name!r} has no GGUF name for {config.model_type}")
        array = _rotary_rows(name, array.astype(np.float32), config)
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
        reader = plain_reader(path)
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
        raise ModelError(f"GGUF export writes byte-level BPE tokenizers only; {config.model_type}'s tokenizer "
                         f"{type(tokenizer).__name__} has no tokenizer.json")
    llama_cpp_pre_tokenizer(json.loads(backend.to_str()), f"{config.model_type}'s tokenizer")


# llama.cpp splits text before BPE by the regexes of a named pre-tokenizer; these are the names whose
# splits equal a Hugging Face byte-level pre-tokenizer's (llama.cpp's llama-vocab.cpp): GPT-2's regex
# alone, and (SmolLM, StarCoder) every digit split off first. A tokenizer llama.cpp would split
# otherwise is refused rather than written to tokenize differently there.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_DIGITS = {"type": "Digits", "individual_digits": True}


def llama_cpp_pre_tokenizer(tokenizer_json: dict, what: str) -> str:
    """The llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`) that splits text as `tokenizer_json`
    (a tokenizer.json's content) does, or ModelError naming `what`."""
    def is_(step, expected):
        return all(step.get(key) == value for key, value in expected.items())

    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") == "BPE" and not tokenizer_json.get("normalizer"):
        if len(steps) == 1 and is_(steps[0], _BYTE_LEVEL):
            return "gpt-2"
        if len(steps) == 2 and is_(steps[0], _DIGITS) and is_(steps[1], _BYTE_LEVEL):
            return "smollm"
    raise ModelError(f"{what}: GGUF export writes byte-level BPE tokenizers that split text as GPT-2 or SmolLM "
                     f"do; this one is {model.get('type')} with pre-tokenizer {json.dumps(pre)[:120]}")


def check_supported(config) -> None:
    """Raise ModelError, naming what is supported, for a model this writer cannot write faithfully."""
    if config.model_type not in ARCHITECTURES:
        raise ModelError(f"GGUF export: model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        # llama.cpp keeps Llama 3's scaled frequencies in a tensor transformers' reader ignores,
        # so the file could not be checked against the model it came from.
        raise ModelError(f"GGUF export: RoPE scaling {rope['rope_type']!r} is not supported; only unscaled RoPE")


def check_tokenizer(folder: Path) -> str:
    """The llama.cpp pre-tokenizer name of `folder`'s tokenizer.json, or ModelError naming the file:
    this writer writes byte-level BPE tokenizers that llama.cpp splits as Hugging Face does."""
    tokenizer_file = Path(folder) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelError(f"{tokenizer_file}: missing; GGUF export writes byte-level BPE tokenizers only")
    return llama_cpp_pre_tokenizer(json.loads(tokenizer_file.read_text()), str(tokenizer_file))


def _write_hyperparameters(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def _write_tokenizer(writer, tokenizer, folder: Path, vocab_size: int, pre_tokenizer: str) -> None:
    """Byte-level BPE as llama.cpp's `gpt2` tokenizer model: every id's token (ids the tokenizer
    lacks, as padding rows of a larger embedding, get placeholder names), special tokens as control
    tokens, and merges, special ids, add-BOS and the chat template from the folder's files."""
    import gguf

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


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
        return text[len(tokenizer.bos_token):] if tokenizer.bos_token and text.startswith(tokenizer.bos_token) else text

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
    if answered[len(first):].count(answer) != 1 or again[len(answered):].count(user_2) != 1:
        return None
    turns = {"assistant": turn(answered[len(first):], answer), "user": turn(again[len(answered):], user_2)}
    separator = turns["user"][2]
    if turns["assistant"][2] != separator or not opening[len(first):].startswith(separator):
        return None  # turns separated by different text: beyond a per-role template
    opening = opening[len(first) + len(separator):]
    # What comes before the first user turn: a <bos> the tokenizer adds itself, or a default system turn.
    header = strip_bos(first[: first.index(user_1) - len(turns["user"][0])])
    with_system = strip_bos(render([{"role": "system", "content": system}, *one]))
    first_user = first[first.index(user_1) - len(turns["user"][0]):]
    if with_system.endswith(first_user) and with_system.count(system) == 1:
        turns["system"] = turn(with_system[: -len(first_user)], system)
    else:  # folded into the first user turn: written as a user turn of its own
        turns["system"] = turns["user"]
    branches = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
                       f"{turns[role][0]}{{{{ .Content }}}}{turns[role][1]}{separator}" for i, role in enumerate(_ROLES))
    default = f'{{{{ if ne (index .Messages 0).Role "system" }}}}{header}{{{{ end }}}}' if header else ""
    return f"{default}{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}{opening}"
