"""Side-by-side train-step timings on one machine, in one run, printed as ratios.

    python benchmarks/train_step.py [--steps 20] [--batch 16] [--length 48]

Compares, on the offline demo's model shape (4 layers, hidden 128, LoRA r=64 on every
linear layer): jaxtune's jitted train step, torchax's own `make_train_step` un-jitted (what
it returns on its own), and PyTorch eager with the same LoRA model.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import jaxtune.runtime  # noqa: F401  (loads torchax under the torch 2.13 shim)
from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
from jaxtune.runtime import steps
from jaxtune.runtime.mesh import make_placement
from jaxtune.runtime.model import attach_lora, to_jax

LORA = LoraConfig(r=64, alpha=64, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def lora_model() -> torch.nn.Module:
    config = Gemma3TextConfig(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=64,
                              pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    return attach_lora(Gemma3ForCausalLM(config), LORA)


def seconds_per_step(step, n: int) -> float:
    for _ in range(3):  # compile and warm up
        step()
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def jax_step(jitted: bool, ids, mask, labels):
    ids, mask, labels = (jax.numpy.asarray(a) for a in (ids, mask, labels))
    model = to_jax(lora_model(), make_placement(MeshConfig()))
    optimizer = steps.make_optimizer(TrainConfig(max_steps=1000), 1000)
    state = {"w": model.weights, "o": optimizer.init(model.weights)}
    if jitted:
        jaxtune_step = steps.make_train_step(model, optimizer)
        key = steps.step_key(0, 1)

        def train_step(w, b, o, batch, lab):  # one micro-batch per step, as torchax's step takes
            return jaxtune_step(w, b, o, {k: v[None] for k, v in batch.items()}, lab[None], key)
    else:
        import torchax.train
        from torchax import interop

        raw = torchax.train.make_train_step(steps.forward_logits(model), steps.mean_token_loss, optimizer)

        def train_step(w, b, o, batch, lab):
            with model.env:
                out = raw(*interop.torch_view((w, b, o, batch, lab)))
            return interop.jax_view(out)

    def step():
        loss, state["w"], state["o"] = train_step(state["w"], model.buffers, state["o"], {"input_ids": ids, "attention_mask": mask}, labels)
        jax.block_until_ready(loss)

    return step


def torch_step(ids, mask, labels):
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-3)
    batch = {k: torch.tensor(v).long() for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}

    def step():
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=48)
    args = parser.parse_args()
    ids = np.random.default_rng(0).integers(3, 1024, (args.batch, args.length)).astype(np.int32)
    mask, labels = np.ones_like(ids), ids.copy()
    # PyTorch first: once XLA's CPU thread pool exists, torch's own threads compete with it.
    eager_torch = seconds_per_step(torch_step(ids, mask, labels), args.steps)
    jitted = seconds_per_step(jax_step(True, ids, mask, labels), args.steps)
    eager_jax = seconds_per_step(jax_step(False, ids, mask, labels), max(3, args.steps // 4))
    print(f"jaxtune jitted step   {jitted * 1e3:8.1f} ms")
    print(f"torchax un-jitted     {eager_jax * 1e3:8.1f} ms   {eager_jax / jitted:5.2f}x the jitted step")
    print(f"PyTorch eager (CPU)   {eager_torch * 1e3:8.1f} ms   {eager_torch / jitted:5.2f}x the jitted step")


if __name__ == "__main__":
    main()
