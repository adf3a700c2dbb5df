"""Run in a process of its own with 8 fake CPU devices (JAX reads XLA_FLAGS once, at start):
train, evaluate, generate and export a tiny Llama, LoRA and full, on one device and on each
mesh of MESHES, and write what the tests compare to OUT/results.json (adapters and weights to
OUT/). Besides the numbers each run records where its batches went (the first train
micro-batch, eval batch and decode prompts it placed), XLA's own per-device bytes of the
memory plan's compiled step, and, on one device, Adam's moments after every step (what the
tests derive their bounds from); and a model placed with `mesh.shardings` overrides records
where its weights went.

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
HISTORY_MESHES = (MESHES[0],)  # the runs whose moments are kept step by step: the reference the bounds come from
PLAN_LENGTH = (
    2  # the memory plan's tokens a row, one row a device: activations next to nothing, the state's bytes alone
)
OVERRIDE_MESH = (1, 4, 2)
# Two weights the built-in rules place otherwise: lm_head [tensor, fsdp] becomes [fsdp, tensor],
# layer 0's q_proj [tensor, fsdp] becomes whole.
OVERRIDES = {r"lm_head\.weight$": ["fsdp", "tensor"], r"layers\.0\.self_attn\.q_proj\.weight$": [None, None]}


def tiny_llama():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.config import TinyModelConfig
    from jaxtune.offline.architectures import tiny_config

    shape = TinyModelConfig(
        architecture="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    config = tiny_config("llama", shape, VOCAB, PAD, BOS, EOS)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def rows():
    import numpy as np

    rng = np.random.default_rng(0)
    ids = [rng.integers(3, VOCAB, n).tolist() for n in LENGTHS]
    return ids, [list(r) for r in ids]


def _spec(sharding) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in sharding.spec]


def _placed(array) -> dict:
    """Where one placed batch array went: its spec, whole and per-device shape, and the rows of
    its batch dimension the devices hold, each distinct [start, stop) once."""
    axis = 1 if array.ndim == 3 else 0  # (micro_batches, rows, t) or (rows, t)
    held = {(s.index[axis].start or 0, s.index[axis].stop or array.shape[axis]) for s in array.addressable_shards}
    return {
        "spec": _spec(array.sharding),
        "shape": list(array.shape),
        "shard_shape": list(array.sharding.shard_shape(array.shape)),
        "rows": sorted(map(list, held)),
    }


def _moments(opt_state) -> dict:
    """{"mu/NAME" and "nu/NAME": Adam's moment of weight NAME} of an optimizer state, on the host."""
    import jax
    import numpy as np

    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if len(path) >= 2 and getattr(path[-2], "name", None) in ("mu", "nu"):
            found[f"{path[-2].name}/{path[-1].key}"] = np.asarray(leaf)
    return found


class Recorder:
    """What the jaxtune calls of a run did, recorded around them (the code under test is unchanged):
    the first batch each of Placement's shard_* methods placed (as `_placed` says), XLA's figures
    of the memory plan's compile (`steps.train_step_memory`), and Adam's moments after each train step."""

    KINDS = {"shard_micro_batches": "train", "shard_batch": "eval", "shard_prompts": "prompts"}

    def __init__(self):
        from jaxtune.runtime.compiled import steps
        from jaxtune.runtime.devices.mesh import Placement

        self.batches, self.xla, self.moments = {}, None, []
        for method, kind in self.KINDS.items():
            setattr(Placement, method, self._placing(getattr(Placement, method), kind))
        measure, make_step = steps.train_step_memory, steps.make_train_step

        def train_step_memory(*args, **kwargs):
            self.xla = measure(*args, **kwargs)
            return self.xla

        def make_train_step(*args, **kwargs):
            step = make_step(*args, **kwargs)

            def run(*inputs):
                loss, weights, opt_state = step(*inputs)
                self.moments.append(_moments(opt_state))  # copied now: the next step donates opt_state
                return loss, weights, opt_state

            run.program = step.program
            return run

        steps.train_step_memory, steps.make_train_step = train_step_memory, make_train_step

    def _placing(self, shard, kind):
        import jax

        def placing(placement, arrays):
            placed = shard(placement, arrays)
            self.batches.setdefault(kind, _placed(jax.tree.leaves(placed)[0]))
            return placed

        return placing

    def take(self) -> tuple[dict, dict | None, list[dict]]:
        """What was recorded since the last call: (batches, XLA memory figures, moments of each step)."""
        taken = self.batches, self.xla, self.moments
        self.batches, self.xla, self.moments = {}, None, []
        return taken


class CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.train_steps = 0

    def emit(self, record):
        self.train_steps += "Compiling jit(train_step)" in record.getMessage()


def run(method: str, sizes: tuple[int, int, int], out: Path, counter: CompileCounter, recorder: Recorder) -> dict:
    import numpy as np

    from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.decoding import inference
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import memory
    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.train import training

    data, fsdp, tensor = sizes
    placement = make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    module = tiny_llama()
    lora = LoraConfig(
        r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    if method == "lora":
        module = rt_model.attach_lora(module, lora)
    else:
        module.requires_grad_(True)
    model = rt_model.to_jax(module, placement)
    specs = {name: _spec(value.sharding) for name, value in {**model.weights, **model.buffers}.items()}
    shapes = {name: list(value.shape) for name, value in {**model.weights, **model.buffers}.items()}
    initial = {name: np.asarray(value) for name, value in model.weights.items()}  # training donates them

    ids, labels = rows()
    cfg = TrainConfig(
        method=method, max_steps=STEPS, batch_size=8, learning_rate=1e-3, warmup_steps=1, log_every=1, seed=0
    )
    recorder.take()
    # The memory plan compiles the step once more: for the fully fine-tuned runs only, at one row
    # of PLAN_LENGTH tokens a device, so that XLA's bytes are the state's (the test says why).
    # The policy train.remat auto takes where no memory is reported (the CPU), as the run below does.
    plan = (
        memory.memory_plan(
            model,
            steps.make_optimizer(cfg),
            cfg.model_copy(update={"remat": "matmuls"}),
            PLAN_LENGTH,
            rows=placement.batch_shards,
        )
        if method == "full"
        else None
    )
    counter.train_steps = 0
    result = training.train(model, ids, labels, cfg, PAD, 64, check_memory=False)
    compiles = counter.train_steps

    trained = rt_model.to_jax(module, placement, result.weights)
    evaluation = inference.evaluate(trained, ids[:16], labels[:16], [""] * 16, 8, PAD, progress=False)
    tokens = inference.greedy_generate(trained, [ids[0][:5], ids[1][:9], ids[2][:3], ids[3][:7]] * 2, 8, 6, (EOS,), PAD)
    batches, xla, moments = recorder.take()

    folder = out / f"{method}-{'x'.join(map(str, sizes))}"
    if method == "lora":  # what the export stage writes: PEFT's save_pretrained of the trained adapter
        import torch

        module.load_state_dict({k: torch.from_numpy(v) for k, v in result.weights.items()}, strict=False)
        module.save_pretrained(folder)
    records = [r for r in result.log if "loss" in r]
    return {
        "method": method,
        "mesh": list(sizes),
        "devices": placement.mesh.size,
        "losses": [r["loss"] for r in records],
        "lrs": [r["lr"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "train_step_compiles": compiles,
        "specs": specs,
        "shapes": shapes,
        "optimizer_specs": _optimizer_specs(cfg, model),
        "eval_loss": evaluation["loss"],
        "eval_tokens": evaluation["tokens"],
        "generated": tokens,
        "adapter": str(folder) if method == "lora" else None,
        "weights": str(
            _save_weights(result.weights, out, method, sizes, initial, moments if sizes in HISTORY_MESHES else [])
        ),
        "summary_mesh": result.summary.mesh,
        "batch_shape": result.summary.batch_shape,
        "batches": batches,
        "memory": plan.record() if plan else None,
        "xla_memory": xla,
    }


def _optimizer_specs(cfg, model) -> dict:
    """{weight: [spec of each optimizer-state leaf kept for it]} (Adam: mu and nu; SGD: the momentum)."""
    import jax

    from jaxtune.runtime.compiled import steps

    state = steps.init_optimizer(model, steps.make_optimizer(cfg))
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = getattr(path[-1], "key", None)
        if name in model.weights:
            specs.setdefault(name, []).append(_spec(leaf.sharding))
    return specs


def _save_weights(weights, out: Path, method: str, sizes, initial: dict, moments: list[dict]) -> Path:
    """The trained weights (NAME), the weights before training ("initial/NAME") and Adam's
    moments after each step t = 1, 2, ... ("step-t/mu/NAME", "step-t/nu/NAME")."""
    from safetensors.numpy import save_file

    tensors = {**weights, **{f"initial/{name}": value for name, value in initial.items()}}
    for step, found in enumerate(moments, 1):
        tensors.update({f"step-{step}/{key}": value for key, value in found.items()})
    path = out / f"weights-{method}-{'x'.join(map(str, sizes))}.safetensors"
    save_file(tensors, str(path))
    return path


def overridden(sizes: tuple[int, int, int]) -> dict:
    """The tiny Llama placed (nothing trained) on a mesh of `sizes` with OVERRIDES in its config:
    {weight: its jax.Array's spec and per-device shape}."""
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling import model as rt_model

    data, fsdp, tensor = sizes
    placement = make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor, shardings=OVERRIDES))
    model = rt_model.to_jax(tiny_llama(), placement)
    return {
        name: {"spec": _spec(value.sharding), "shard_shape": list(value.sharding.shard_shape(value.shape))}
        for name, value in model.weights.items()
    }


def main(out: Path) -> None:
    import jax

    assert jax.device_count() == 8, f"{jax.device_count()} devices: set XLA_FLAGS before starting"
    counter, recorder = CompileCounter(), Recorder()
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(counter)
    logger.setLevel(logging.WARNING)
    results = []
    with jax.log_compiles():
        for method in METHODS:
            for sizes in MESHES:
                results.append(run(method, sizes, out, counter, recorder))
    results.append({"method": "overrides", "mesh": list(OVERRIDE_MESH), "placed": overridden(OVERRIDE_MESH)})
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
