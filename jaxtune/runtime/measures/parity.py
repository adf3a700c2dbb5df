"""The JAX path against PyTorch eager on the very same tensors: logits, loss, gradients, greedy tokens.

The PyTorch side copies the JaxModel's arrays back into torch tensors and runs the module
with `functional_call` outside torchax, so a difference can only come from how the two
backends compute, never from different weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import torch
from transformers import GenerationConfig

from jaxtune.runtime.compiled import programs, steps
from jaxtune.runtime.decoding import decode
from jaxtune.runtime.modeling.model import JaxModel


def _to_torch(tree: dict[str, jax.Array]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in tree.items():
        array = np.asarray(jax.device_get(value))
        if array.dtype.name == "bfloat16":  # torch cannot read numpy's bfloat16 directly
            out[name] = torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(np.array(array))
    return out


def _torch_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.asarray(value)).long() for name, value in batch.items()}


def _torch_forward(model: JaxModel, weights: dict[str, torch.Tensor], batch: dict[str, np.ndarray]) -> torch.Tensor:
    kwargs = {**_torch_batch(batch), "use_cache": False}
    buffers = _to_torch(model.flat(model.buffers))  # PyTorch's own forward: per-layer names
    return torch.func.functional_call(
        model.module, (model.for_compute(weights), buffers), args=(), kwargs=kwargs
    ).logits


def jax_logits(model: JaxModel, batch: dict[str, np.ndarray]) -> np.ndarray:
    """(b, t, vocab) float32 logits from the compiled JAX forward."""
    from torchax import interop

    forward = programs.shared("logits", model, (), lambda ref: jax.jit(interop.jax_view(steps.forward_logits(ref))))
    with model.env:
        logits = forward(model, model.weights, model.buffers, dict(batch))
    return np.asarray(logits, dtype=np.float32)


def torch_logits(model: JaxModel, batch: dict[str, np.ndarray]) -> np.ndarray:
    """The same logits from PyTorch eager."""
    with torch.no_grad():
        return _torch_forward(model, _to_torch(model.flat(model.weights)), batch).float().numpy()


def jax_loss_and_grads(
    model: JaxModel, batch: dict[str, np.ndarray], labels: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    loss, grads = steps.make_loss_and_grad(model)(model.weights, model.buffers, dict(batch), labels)
    return float(loss), {name: np.asarray(g, dtype=np.float32) for name, g in model.flat(grads).items()}


def torch_loss_and_grads(
    model: JaxModel, batch: dict[str, np.ndarray], labels: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    weights = {name: value.requires_grad_(True) for name, value in _to_torch(model.flat(model.weights)).items()}
    loss = steps.mean_token_loss(_torch_forward(model, weights, batch), torch.from_numpy(np.asarray(labels)).long())
    loss.backward()
    return float(loss.detach()), {name: w.grad.float().numpy() for name, w in weights.items()}


def relative_diff(got: np.ndarray, expected: np.ndarray) -> float:
    """‖got − expected‖ / ‖expected‖ (absolute difference when `expected` is all zeros)."""
    scale = float(np.linalg.norm(expected))
    return float(np.linalg.norm(got - expected)) / (scale if scale > 0 else 1.0)


def worst_gradient(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> tuple[str, float]:
    """(parameter name, relative difference) of the gradient that differs most."""
    diffs = {name: relative_diff(got[name], expected[name]) for name in expected}
    name = max(diffs, key=diffs.get)
    return name, diffs[name]


def jax_greedy(
    model: JaxModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int, eos_ids: tuple[int, ...] = ()
) -> list[list[int]]:
    """All prompts decoded together (left-padded) by the compiled decoder; no eos: every row runs to the end."""
    ids, mask = decode.left_pad(prompts, pad_id)
    tokens = decode.make_generate(model, max_new_tokens, eos_ids)(model, model.weights, model.buffers, ids, mask)
    return np.asarray(tokens).tolist()


def torch_greedy(
    module: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, pad_id: int, eos_ids: Sequence[int] = ()
) -> list[int]:
    """`generate(do_sample=False)` on one unpadded prompt, stopping after any of `eos_ids` (kept)."""
    # eos_token_id=[] for none: None would fall back to the model's own generation config.
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=pad_id
    )
    with torch.no_grad():
        out = module.generate(
            input_ids=torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


def logits_parity(model: JaxModel, rows: Sequence[Sequence[int]], pad_id: int) -> dict:
    """JAX against PyTorch logits on `rows` (right-padded together), over their real tokens:
    max |difference|, the logits' own scale, and how often both pick the same top token."""
    from jaxtune.runtime.compiled.batches import bucket_length, pad_batch

    padded = pad_batch(rows, rows, pad_id, bucket_length(max(len(r) for r in rows)), len(rows))
    batch = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
    valid = batch["attention_mask"].astype(bool)
    got, expected = jax_logits(model, batch)[valid], torch_logits(model, batch)[valid]
    return {
        "dtype": str(model.dtype),
        "rows": len(rows),
        "tokens": int(valid.sum()),
        "max_abs_diff": float(np.abs(got - expected).max()),
        "max_abs_logit": float(np.abs(expected).max()),
        "top1_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean()),
    }
