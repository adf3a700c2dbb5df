"""Run in a process of its own with 8 fake CPU devices: GRPO on a tiny LoRA Llama on one device
and on a mesh of data 2, fsdp 2, tensor 2, writing each run's log to OUT/results.json.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.rl.grpo_mesh_run OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MESHES = [(1, 1, 1), (2, 2, 2)]
STEPS = 8


def run(sizes: tuple[int, int, int]) -> list[dict]:
    import jax

    from jaxtune.config import MeshConfig, RLConfig, TrainConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.train import rollouts
    from tests.conftest import EOS, PAD
    from tests.rl.test_rollouts import PROMPTS, even_share, lora_model

    data, fsdp, tensor = sizes
    placement = make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor])
    model = lora_model(placement)
    cfg = TrainConfig(
        max_steps=STEPS, batch_size=16, learning_rate=1e-2, warmup_steps=0, lr_schedule="constant", weight_decay=0.0
    )
    rl = RLConfig(num_generations=4, max_completion_length=8, beta=0.02)
    log: list[dict] = []
    rollouts.train_grpo(
        model, PROMPTS, even_share, ["even"], cfg, rl, PAD, [EOS], on_log=log.extend, check_memory=False
    )
    return [r for r in log if "loss" in r]


def main(out: Path) -> None:
    import jax

    assert jax.device_count() == 8, f"{jax.device_count()} devices: set XLA_FLAGS before starting"
    (out / "results.json").write_text(json.dumps({"x".join(map(str, sizes)): run(sizes) for sizes in MESHES}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
