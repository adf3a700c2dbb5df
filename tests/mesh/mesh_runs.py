"""Run in a process of its own with 8 fake CPU devices (JAX reads XLA_FLAGS once, at start):
train, evaluate, generate and export a tiny Llama, LoRA and full, on one device and on each
mesh of MESHES, and write what the tests compare to OUT/results.json (adapters to OUT/).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh.mesh_runs OUT
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

MESHES = [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]  # (data, fsdp, tensor); the first is one device
METHODS = ("lora", "full")
STEPS = 5
VOCAB, PAD, BOS, EOS = 256, 0, 2, 1
LENGTHS = [9, 14, 22, 30, 41, 47, 60, 12, 18, 35, 50, 25, 7, 33, 28, 16] * 2


def tiny_llama():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.architectures import tiny_config
    from jaxtune.config import TinyModelConfig

    shape = TinyModelConfig(architecture="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    config = tiny_config("llama", shape, VOCAB, PAD, BOS, EOS)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def rows():
    import numpy as np

    rng = np.random.default_rng(0)
    ids = [rng.integers(3, VOCAB, n).tolist() for n in LENGTHS]
    return ids, [list(r) for r in ids]


class CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.train_steps = 0

    def emit(self, record):
        self.train_steps += "Compiling jit(train_step)" in record.getMessage()


def run(method: str, sizes: tuple[int, int, int], out: Path, counter: CompileCounter) -> dict:
    import numpy as np

    from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
    from jaxtune.runtime import inference, memory, steps, training
    from jaxtune.runtime import model as rt_model
    from jaxtune.runtime.mesh import make_placement

    data, fsdp, tensor = sizes
    placement = make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    module = tiny_llama()
    lora = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
    if method == "lora":
        module = rt_model.attach_lora(module, lora)
    else:
        module.requires_grad_(True)
    model = rt_model.to_jax(module, placement)
    specs = {name: [list(a) if isinstance(a, tuple) else a for a in value.sharding.spec]
             for name, value in {**model.weights, **model.buffers}.items()}
    shapes = {name: list(value.shape) for name, value in {**model.weights, **model.buffers}.items()}

    ids, labels = rows()
    cfg = TrainConfig(method=method, max_steps=STEPS, batch_size=8, learning_rate=1e-3, warmup_steps=1, log_every=1, seed=0)
    # The memory plan compiles the step once more: made for the fully fine-tuned runs only.
    plan = memory.memory_plan(model, steps.make_optimizer(cfg), cfg, 64) if method == "full" else None
    counter.train_steps = 0
    result = training.train(model, ids, labels, cfg, PAD, 64, check_memory=False)
    compiles = counter.train_steps

    trained = rt_model.to_jax(module, placement, result.weights)
    evaluation = inference.evaluate(trained, ids[:16], labels[:16], [""] * 16, 8, PAD, progress=False)
    tokens = inference.greedy_generate(trained, [ids[0][:5], ids[1][:9], ids[2][:3], ids[3][:7]] * 2, 8, 6, (EOS,), PAD)

    folder = out / f"{method}-{'x'.join(map(str, sizes))}"
    if method == "lora":  # what the export stage writes: PEFT's save_pretrained of the trained adapter
        import torch

        module.load_state_dict({k: torch.from_numpy(v) for k, v in result.weights.items()}, strict=False)
        module.save_pretrained(folder)
    return {
        "method": method, "mesh": list(sizes), "devices": placement.mesh.size,
        "losses": [r["loss"] for r in result.log if "loss" in r],
        "train_step_compiles": compiles,
        "specs": specs, "shapes": shapes,
        "optimizer_specs": _optimizer_specs(cfg, model),
        "eval_loss": evaluation["loss"], "generated": tokens,
        "adapter": str(folder) if method == "lora" else None,
        "weights": str(_save_weights(result.weights, out, method, sizes)),
        "summary_mesh": result.summary["mesh"],
        "memory": plan,
    }


def _optimizer_specs(cfg, model) -> dict:
    """{weight: [spec of each optimizer-state leaf kept for it]} (Adam: mu and nu; SGD: the momentum)."""
    import jax

    from jaxtune.runtime import steps

    state = steps.init_optimizer(model, steps.make_optimizer(cfg))
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = getattr(path[-1], "key", None)
        if name in model.weights:
            specs.setdefault(name, []).append([list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec])
    return specs


def _save_weights(weights, out: Path, method: str, sizes) -> Path:
    from safetensors.numpy import save_file

    path = out / f"weights-{method}-{'x'.join(map(str, sizes))}.safetensors"
    save_file(weights, str(path))
    return path


def main(out: Path) -> None:
    import jax

    assert jax.device_count() == 8, f"{jax.device_count()} devices: set XLA_FLAGS before starting"
    counter = CompileCounter()
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(counter)
    logger.setLevel(logging.WARNING)
    results = []
    with jax.log_compiles():
        for method in METHODS:
            for sizes in MESHES:
                results.append(run(method, sizes, out, counter))
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
