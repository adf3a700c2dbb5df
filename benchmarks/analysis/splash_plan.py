"""XLA:TPU's plan of the Gemma 3 1B LoRA recipe's train step at 8 x 2048 on one v5e chip, with
splash attention (what jaxtune runs on TPU) and with XLA's attention, compiled here without the chip:

    JAX_PLATFORMS=cpu python -m benchmarks.analysis.splash_plan [--target v5e-1] [--length 2048] [--remat layer]

At the recipe's remat (matmuls) neither fits one v5e chip at this length (21.5 GiB of
temporaries either way: what the layers keep for the backward pass dominates); with
remat=layer, what attention itself needs shows.

Not part of `make bench` (each compile of the 1B step takes minutes on 2 cores). The model is
Gemma 3 1B's exact shape on the meta device (its config.json's shape fields, as
tests/training/test_memory_plan.py has them); needs the tpu-plan extra.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

GEMMA3_1B = {
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jaxtune.config import load_config
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices import compile_cache, targets
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import memory
    from jaxtune.runtime.modeling import attention
    from jaxtune.runtime.modeling.model import attach_lora, to_jax

    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="v5e-1")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--remat", default="layer", help="train.remat, a fixed policy (the recipe's is auto)")
    args = parser.parse_args()
    config = load_config(
        "configs/gemma3-1b-dolly-lora.yaml", [f"train.batch_size={args.batch}", f"train.remat={args.remat}"]
    )
    target = targets.resolve(args.target)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("gemma3_text", **GEMMA3_1B), dtype=torch.bfloat16, attn_implementation="eager"
        )
    model = to_jax(
        attach_lora(module, config.lora), make_placement(config.mesh, targets.devices(target)), shapes_only=True
    )
    print(
        f"Gemma 3 1B, LoRA r={config.lora.r}, remat {config.train.remat}, {args.batch} x {args.length}, "
        f"{target.describe(model.placement.mesh.size)}"
    )
    for core in ("splash", "xla"):
        started = time.perf_counter()
        try:
            with attention.choose(core):
                plan = memory.memory_plan(
                    model, steps.make_optimizer(config.train), config.train, args.length, limit=target.chip.hbm
                )
            found = (
                f"peak {plan.peak / 2**30:.2f} GiB + code {plan.code / 2**20:.1f} MiB of "
                f"{target.chip.hbm / 2**30:.2f} GiB"
            )
        except Exception as e:
            refused = compile_cache.refusal(e)
            if not refused:
                raise
            found = f"does not compile: {refused}"
        print(f"{core:>6} attention: {found} ({time.perf_counter() - started:.0f} s to compile)", flush=True)


if __name__ == "__main__":
    main()
