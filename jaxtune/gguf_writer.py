"""An HF model folder (config.json, safetensors, tokenizer) written as one GGUF file for llama.cpp.

The file holds what a GGUF runtime needs to run the model as training did: the tensors under GGUF
names, the architecture's hyperparameters, the tokenizer (tokens, merges, special-token ids, the
add-BOS flag) and the chat template. Tensors are written by the `gguf` package (its writer, name
maps and numpy quantizers); transformers' GGUF reader, which `import_gguf` uses, reads them back.

Llama-architecture models with a byte-level BPE tokenizer (SmolLM2, Llama 3 without RoPE scaling)
only, for now. llama.cpp expects Q and K rows in its own rotary layout (`_rotary_rows`); matrices
are stored in the chosen type and vectors (norms, biases) in float32, as llama.cpp's converter does.
The file is written under a temporary name and renamed, so a crash never leaves half a file at `path`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxtune.errors import ModelError

TYPES = ("f32", "f16", "bf16", "q8_0")  # gguf's numpy quantizers write these; it has no K-quants
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
    check_tokenizer(folder)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    arch = ARCHITECTURES[config.model_type]
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(partial, arch)
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, AutoTokenizer.from_pretrained(folder), folder, config.vocab_size)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    matrix_type = gguf.GGMLQuantizationType[qtype.upper()]
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)
    return path


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


def check_tokenizer(folder: Path) -> None:
    """Raise ModelError unless `folder` holds a byte-level BPE tokenizer, the kind this writer writes."""
    tokenizer_file = Path(folder) / "tokenizer.json"
    if not tokenizer_file.is_file() or json.loads(tokenizer_file.read_text())["model"]["type"] != "BPE":
        raise ModelError(f"{tokenizer_file}: GGUF export writes byte-level BPE tokenizers only "
                         "(a tokenizer.json whose model type is BPE)")


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


def _write_tokenizer(writer, tokenizer, folder: Path, vocab_size: int) -> None:
    """Byte-level BPE as llama.cpp's `gpt2` tokenizer model: every id's token (ids the tokenizer
    lacks, as padding rows of a larger embedding, get placeholder names), special tokens as control
    tokens, and merges, special ids, add-BOS and the chat template from the folder's files."""
    import gguf

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
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
