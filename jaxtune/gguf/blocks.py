"""A GGUF file's quantized linear weights as they are stored, for a base held quantized
(`model.base_quantization: gguf`): no round trip through float32.

Q8_0, Q4_0, Q4_1 and Q5_0 tensors (ggml's blocks of 32 values along a row, a row being one
output's inputs, as `runtime.modeling.quantize` blocks them) are split into their blocks' fields (see
`runtime.modeling.quantize.GGUF_SCHEMES`) byte for byte: `join_blocks` puts the file's bytes back. Other
types (K-quants, float tensors) are not returned; the model keeps those layers as the imported
float weights. Each tensor is named as the HF layer it loads into, with the rows of a llama
model's Q and K projections put back in HF's rotary order (llama.cpp's converter interleaves
them, transformers' GGUF reader undoes it; each row's blocks move whole).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxtune.errors import ModelError

BLOCK = 32
# ggml type -> (scheme, bytes per block, its fields: (name, first byte, bytes, numpy dtype))
LAYOUTS = {
    "Q8_0": ("q8_0", 34, (("scales", 0, 2, np.float16), ("codes", 2, 32, np.int8))),
    "Q4_0": ("q4_0", 18, (("scales", 0, 2, np.float16), ("codes", 2, 16, np.uint8))),
    "Q4_1": ("q4_1", 20, (("scales", 0, 2, np.float16), ("mins", 2, 2, np.float16), ("codes", 4, 16, np.uint8))),
    "Q5_0": ("q5_0", 22, (("scales", 0, 2, np.float16), ("high", 2, 4, np.uint8), ("codes", 6, 16, np.uint8))),
}


def split_blocks(data: np.ndarray, ggml_type: str) -> dict[str, np.ndarray]:
    """A tensor's (rows, blocks x bytes) uint8 data as its fields, each (rows, blocks x values)."""
    _, size, fields = LAYOUTS[ggml_type]
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, size)
    return {
        name: np.ascontiguousarray(blocks[..., first : first + n]).view(dtype).reshape(rows, -1)
        for name, first, n, dtype in fields
    }


def join_blocks(fields: dict[str, np.ndarray], ggml_type: str) -> np.ndarray:
    """`split_blocks` undone: the file's bytes."""
    _, size, layout = LAYOUTS[ggml_type]
    rows = fields["scales"].shape[0]
    blocks = fields["scales"].shape[1]
    parts = [np.ascontiguousarray(fields[name]).view(np.uint8).reshape(rows, blocks, n) for name, _, n, _ in layout]
    return np.concatenate(parts, axis=-1).reshape(rows, blocks * size)


def read_blocks(path: str | Path, config) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """(tensors '<layer>.<field>', scheme per layer, the ggml type of every linear weight left out)
    of the GGUF file at `path`, for the HF model of `config` (the imported model's). Layers are
    the decoder's linear layers (named as the HF model names them); the embedding and head are
    left to the imported model."""
    import gguf

    from jaxtune.gguf.reader import tensor_reader

    reader = tensor_reader(path)
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field else ""
    arch_id = next((key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch_id is None:
        raise ModelError(f"{path}: GGUF architecture {architecture!r} is not one gguf names")
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    by_gguf = {t.name: t for t in reader.tensors}
    tensors, schemes, left = {}, {}, {}
    for layer in _linear_layers(config):
        gguf_name = names.get_name(f"{layer}.weight", try_suffixes=(".weight",))
        tensor = by_gguf.get(gguf_name) if gguf_name else None
        if tensor is None:
            raise ModelError(f"{path}: no GGUF tensor for the layer {layer} (looked for {gguf_name})")
        kind = tensor.tensor_type.name
        if kind not in LAYOUTS:
            left[layer] = kind
            continue
        rows = _hf_row_order(layer, tensor.data.shape[0], config, architecture)
        for name, value in split_blocks(np.asarray(tensor.data), kind).items():
            tensors[f"{layer}.{name}"] = value[rows]
        schemes[layer] = LAYOUTS[kind][0]
    return tensors, schemes, left


def _linear_layers(config) -> list[str]:
    """The decoder's linear layers of a llama-like model (llama, gemma3 text): q, k, v, o, gate, up, down."""
    return [
        f"model.layers.{i}.{part}"
        for i in range(config.num_hidden_layers)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]


def _hf_row_order(layer: str, rows: int, config, architecture: str) -> np.ndarray:
    """For each HF row, the file row holding it: llama's Q and K rows are interleaved per head in
    the file (llama.cpp's order: pairs), halves in HF's; every other tensor's rows are HF's."""
    order = np.arange(rows)
    if architecture != "llama" or not layer.endswith(("q_proj", "k_proj")):
        return order
    heads = config.num_attention_heads if layer.endswith("q_proj") else config.num_key_value_heads
    # The writer's permutation (jaxtune.gguf.writer._rotary_rows) of HF rows: file row f holds HF row order[f].
    to_file = order.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(to_file)
