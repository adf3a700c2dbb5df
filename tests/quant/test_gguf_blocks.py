"""A base held as a GGUF file's own blocks (`model.base_quantization: gguf`, `jaxtune.gguf.blocks`):
kept byte for byte, dequantized to exactly the weights transformers' GGUF reader (with the gguf
package's numpy dequantizers: an implementation independent of ours) reads from the file, and
the model's logits in JAX equal to transformers' own model read from the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxtune.config import MeshConfig
from jaxtune.gguf import blocks as gguf_blocks
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures import parity
from jaxtune.runtime.modeling import quantize
from jaxtune.runtime.modeling.model import to_jax

pytestmark = pytest.mark.quant
TEXTS = ["the quick brown fox jumps over the lazy dog", "yes, it is the answer", "a fox and a dog"] * 20
QTYPES = ("q8_0", "q4_0", "q4_1", "q5_0")
# float32 logits of the same float32 weights through XLA and through PyTorch: a few ulps apart
# (as tests/quant/test_quantized_base.py); a block read wrongly moves them by 1e-3 and more.
LOGIT_ATOL = 2e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama (4 query heads, 2 KV heads: its Q and K rows are reordered in the file) and a tiny Gemma 3."""
    from tests.gguf_export.gemma3 import save_tiny_gemma3
    from tests.gguf_export.llama import save_tiny_llama

    return {
        "llama": save_tiny_llama(tmp_path_factory.mktemp("llama"), TEXTS, 64, 4, 2, eos_id=5),
        "gemma3": save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), TEXTS, layers=2),
    }


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_files_blocks_are_kept_byte_for_byte_and_give_the_readers_weights_and_logits(
    folders, family, qtype, tmp_path, monkeypatch
):
    import gguf
    from transformers import AutoModelForCausalLM

    from jaxtune.gguf import writer as gguf_writer
    from jaxtune.gguf.reader import tensor_reader
    from jaxtune.gguf.writer import write_gguf

    # The exporter offers q8_0 alone of these; its writer (the gguf package's numpy quantizers) makes any.
    monkeypatch.setattr(gguf_writer, "TYPES", (*gguf_writer.TYPES, qtype))
    path = write_gguf(folders[family], tmp_path / f"model-{qtype}.gguf", qtype)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    tensors, schemes, left = gguf_blocks.read_blocks(path, theirs.config)
    assert left == {} and len(schemes) == 2 * 7 and set(schemes.values()) == {qtype}

    # Byte for byte: each layer's fields put back together are the file's bytes (in HF's row order).
    by_name = {t.name: t for t in tensor_reader(path).tensors}
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == family), 2)
    for layer in schemes:
        fields = {key.rpartition(".")[2]: value for key, value in tensors.items() if key.rpartition(".")[0] == layer}
        stored = np.asarray(by_name[names.get_name(f"{layer}.weight", try_suffixes=(".weight",))].data)
        rows = gguf_blocks._hf_row_order(layer, stored.shape[0], theirs.config, family)
        np.testing.assert_array_equal(gguf_blocks.join_blocks(fields, qtype.upper()), stored[rows])
        # ... and they stand for exactly the weight transformers' reader dequantized from the file.
        ours = quantize.dequantize({k: torch.from_numpy(v) for k, v in fields.items()}, qtype, torch.float32)
        np.testing.assert_array_equal(ours.numpy(), theirs.get_submodule(layer).weight.detach().numpy(), err_msg=layer)

    module = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    module.requires_grad_(False)
    held = quantize.load_base(module, {k: torch.from_numpy(v) for k, v in tensors.items()}, schemes)
    assert len(held) == 14 and not any(
        name.endswith(".weight") and "layers" in name and "proj" in name for name, _ in module.named_parameters()
    )
    model = to_jax(module, make_placement(MeshConfig()))
    ids = np.random.default_rng(0).integers(3, theirs.config.vocab_size, (2, 20)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with torch.no_grad():
        expected = theirs(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(parity.jax_logits(model, batch), expected, rtol=0, atol=LOGIT_ATOL)


def test_q5_0s_fifth_bits_are_read_from_the_blocks_high_bytes():
    """One Q5_0 block built by hand: d = 1, values j - 16 for j = 0..31 (so every fifth bit is exercised)."""
    import gguf

    values = np.arange(32, dtype=np.float32) - 16
    values[31] = 16  # the largest magnitude fixes d = 1: -16 * d = -16... so value 31 is 15 after clamping
    block = gguf.quants.quantize(values.reshape(1, 32), gguf.GGMLQuantizationType.Q5_0)
    fields = gguf_blocks.split_blocks(block, "Q5_0")
    expected = gguf.quants.dequantize(block, gguf.GGMLQuantizationType.Q5_0)
    ours = quantize.dequantize({k: torch.from_numpy(v) for k, v in fields.items()}, "q5_0", torch.float32)
    np.testing.assert_array_equal(ours.numpy(), expected)
    assert len(np.unique(expected)) > 16  # more levels than 4 bits give: the fifth bits were read
