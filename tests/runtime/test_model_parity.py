"""The JAX path computes what PyTorch eager computes: logits, loss, greedy tokens."""

import numpy as np
import pytest
import torch

from jaxtune.config import LoraConfig, MeshConfig, ModelConfig, TrainConfig
from jaxtune.runtime import decode, model as rt_model, steps
from jaxtune.runtime.mesh import make_placement
from tests.conftest import tiny_gemma3


@pytest.fixture(scope="module")
def torch_model():
    return tiny_gemma3(sliding_window=16)


@pytest.fixture(scope="module")
def jax_model(torch_model):
    return rt_model.to_jax(torch_model, ModelConfig(), make_placement(MeshConfig()))


def _batch(seed=0, b=3, t=40):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 256, (b, t)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 25:] = 0  # a right-padded row, longer than the sliding window before the padding
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return ids, mask, labels


def test_logits_match_pytorch_fp32(torch_model, jax_model):
    from torchax import interop

    ids, mask, _ = _batch()
    with torch.no_grad():
        expected = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    forward = interop.jax_jit(steps.forward_logits(jax_model))
    with jax_model.env:
        got = forward(*interop.torch_view((jax_model.weights, jax_model.buffers, {"input_ids": ids, "attention_mask": mask})))
    got = np.asarray(interop.jax_view(got))
    valid = mask.astype(bool)
    diff = np.abs(got - expected)[valid].max()
    assert diff <= 1e-4, diff


def test_eval_loss_matches_pytorch(torch_model, jax_model):
    ids, mask, labels = _batch(1)
    nll, count = steps.make_eval_step(jax_model)(jax_model.weights, jax_model.buffers, {"input_ids": ids, "attention_mask": mask}, labels)
    with torch.no_grad():
        logits = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        ref_nll, ref_count = steps.token_nll(logits, torch.tensor(labels).long())
    np.testing.assert_array_equal(np.asarray(count), ref_count.numpy())
    np.testing.assert_allclose(np.asarray(nll), ref_nll.numpy(), rtol=1e-5)


def test_greedy_decode_matches_generate_with_left_padding(torch_model, jax_model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (11, 23, 5)]
    ids, mask = decode.left_pad(prompts, pad_id=0)
    generate = decode.make_generate(jax_model, max_new_tokens=24, eos_ids=(1,))
    tokens = np.asarray(generate(jax_model.weights, jax_model.buffers, ids, mask))
    for row, prompt in enumerate(prompts):
        expected = torch_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24, do_sample=False, eos_token_id=1, pad_token_id=0,
        )[0, len(prompt):].numpy()
        assert tokens[row, : len(expected)].tolist() == expected.tolist(), row


def test_lora_train_step_lowers_loss_and_only_touches_adapters():
    module = rt_model.attach_lora(tiny_gemma3(), LoraConfig(r=4, alpha=8))
    jm = rt_model.to_jax(module, ModelConfig(), make_placement(MeshConfig()))
    assert all("lora_" in name for name in jm.weights)
    frozen_before = {k: np.asarray(v) for k, v in jm.buffers.items()}
    cfg = TrainConfig(learning_rate=1e-2, warmup_steps=0, max_steps=20)
    optimizer = steps.make_optimizer(cfg)
    train_step = steps.make_train_step(jm, optimizer)
    ids, mask, labels = _batch(2)
    weights, opt_state = jm.weights, optimizer.init(jm.weights)
    losses = []
    for _ in range(20):
        loss, weights, opt_state = train_step(weights, jm.buffers, opt_state, {"input_ids": ids, "attention_mask": mask}, labels)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.3, losses  # memorising one batch: 5.57 -> 5.06 when written
    assert float(steps.grad_norm_of(opt_state)) > 0
    for k, v in jm.buffers.items():
        np.testing.assert_array_equal(np.asarray(v), frozen_before[k])
