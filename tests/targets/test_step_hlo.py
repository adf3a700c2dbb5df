"""benchmarks/analysis/step_hlo.py, the breakdown of a train step's optimized HLO by kernel, checked on a
tiny model compiled for a compile-only H100: its matmul flops are the count the MFU formula
makes (`flops.train_flops_per_token`), and the loss takes the accelerator's larger chunks."""

from __future__ import annotations

import pytest

from benchmarks.analysis import step_hlo
from jaxtune.config import load_config
from jaxtune.runtime.devices import targets

pytestmark = pytest.mark.target

VOCAB, HIDDEN, RANK, ROWS, LENGTH = 262_144, 256, 4, 4, 256


@pytest.fixture(scope="module")
def gemma_vocabulary_folder(tmp_path_factory):
    """A two-layer Llama with Gemma 3's 262k vocabulary, so the loss is chunked as Gemma's is."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("wide-vocabulary-config")
    AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    return folder


def _breakdown(folder, target: str) -> tuple[dict, object]:
    from jaxtune.checks.doctor import as_trained
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures.flops import train_flops_per_token
    from jaxtune.runtime.modeling.model import to_jax

    config = load_config(
        None,
        [
            f"lora.r={RANK}",
            "lora.modules_to_save=[]",  # the Gemma recipe's LoRA: a frozen head
            "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
        ],
    )
    module = as_trained(meta_model(str(folder), None, False, "bfloat16"), config, randomize_lora=False)
    model = to_jax(module, make_placement(config.mesh, targets.devices(targets.resolve(target))), shapes_only=True)
    compiled = steps.compiled_train_step(model, steps.make_optimizer(config.train), 1, ROWS, LENGTH)
    found = step_hlo.kernels(compiled.as_text(), RANK, VOCAB)
    chip = targets.resolve("h100").chip
    groups = {g["group"]: g for g in step_hlo.breakdown(found, chip.peak_flops, chip.hbm_bandwidth)}
    return groups, train_flops_per_token(model, context=0)


def test_the_steps_matmul_flops_are_the_mfu_formulas_and_the_loss_takes_512_token_chunks(gemma_vocabulary_folder):
    groups, counted = _breakdown(gemma_vocabulary_folder, "h100")
    head = VOCAB * HIDDEN
    tokens = ROWS * LENGTH
    scored = ROWS * (LENGTH - 1)  # the loss scores each token but the last of a row
    # The head: the chunk's logits and the hidden states' gradient from them, 2 FLOPs an entry each.
    assert groups["matmul: vocabulary (head and loss)"]["flops"] == pytest.approx(2 * 2 * head * scored, rel=1e-3)
    # The frozen layers: forward and the activations' gradient, but for the first layer's q, k and v
    # input gradient, which nothing needs (the embeddings are frozen) and XLA may drop.
    frozen_layers = counted["matmul_weights"] - counted["trained_weights"] - head
    first_qkv = HIDDEN * (4 + 2 + 2) * 64
    assert (
        (2 * 2 * frozen_layers - 2 * first_qkv) * tokens
        <= groups["matmul: model"]["flops"]
        <= 2 * 2 * frozen_layers * tokens
    )
    # LoRA's rank-4 matmuls: forward, input and factor gradients at most; XLA rewrites some dots this
    # thin as multiplies and sums (counted with the elementwise kernels, their flops not counted).
    assert 0 < groups["matmul: LoRA (rank 4)"]["flops"] <= 3 * 2 * counted["trained_weights"] * tokens
    # 1,020 scored tokens in 512-token chunks: 2 chunks, 2 matmuls each; the CPU's 64 MiB chunks are 64 tokens.
    assert groups["matmul: vocabulary (head and loss)"]["kernels"] == 2 * 2
    assert groups["attention (flash kernel)"]["kernels"] == 2 * 3  # per layer: forward, dq, dk and dv
