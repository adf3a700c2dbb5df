"""Decoder layers held stacked and traced once (`runtime.modeling.stacked`): one SGD step with the layers as a
scan over groups of alike layers gives the unrolled step's loss and updated weights, for every family.

Bound: the scan runs the same float32 operations on the same values; only XLA's fusion and
summation order may differ, so the loss may move by a few float32 ulps of its ~5.6 (6e-7 seen)
and each updated weight (lr 1, |w| < 1) by about as much: 1e-5 leaves an order of magnitude and
is far below what a wrong layer or weight does (a layer run twice moves the loss by ~1e-2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
from jaxtune.offline.architectures import FAMILIES
from jaxtune.runtime.compiled import programs, steps
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.modeling import stacked as scan
from tests.conftest import VOCAB, tiny_model

pytestmark = pytest.mark.training

BOUND = 1e-5
LAYERS = 6  # Gemma 3's tiny pattern alternates sliding and global layers: 3 groups of 2


def step(
    family: str, remat: str, scanned: bool, monkeypatch, module=None, optimizer: str = "sgd"
) -> tuple[float, dict, list[int]]:
    programs.clear()
    groups = []
    real_scan = scan.jax.lax.scan

    def counting(body, init, xs=None, **kwargs):
        if body.__module__ == scan.__name__:  # the layers' scan, not the loss's chunks or the micro-batches'
            groups.append(len(scan.jax.tree.leaves(xs)[0]))
        return real_scan(body, init, xs, **kwargs)

    monkeypatch.setattr(scan.jax.lax, "scan", counting)
    module = rt_model.attach_lora(
        module or tiny_model(family, layers=LAYERS), LoraConfig(r=4, target_modules="all-linear")
    )
    for dropout in (m for m in module.modules() if isinstance(m, torch.nn.Dropout)):
        dropout.p = 0.0  # GPT-2's default 0.1: a scan's groups draw other keys, so other masks
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=scanned)
    cfg = TrainConfig(
        batch_size=2,
        max_steps=1,
        warmup_steps=0,
        optimizer=optimizer,
        learning_rate=1.0,
        weight_decay=0.0,
        max_grad_norm=1e9,
        remat=remat,
    )
    optimizer = steps.make_optimizer(cfg)
    ids = np.random.default_rng(0).integers(3, VOCAB, (1, 2, 48)).astype(np.int32)
    batch = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "segment_ids": np.ones_like(ids),
        "position_ids": np.broadcast_to(np.arange(48, dtype=np.int32), ids.shape).copy(),
    }
    weights = {k: v.copy() for k, v in model.weights.items()}
    train_step = steps.make_train_step(model, optimizer, steps.StepSpec(remat))
    loss, weights, _ = train_step(
        weights, model.buffers, steps.init_optimizer(model, optimizer, weights), batch, ids, steps.step_key(0, 0), 1.0
    )
    monkeypatch.undo()
    return float(loss), {k: np.asarray(v) for k, v in model.flat(weights).items()}, groups


@pytest.mark.parametrize(
    ("family", "remat"), [(f, "none") for f in FAMILIES] + [("gemma3", "layer"), ("llama", "matmuls")]
)
def test_a_scanned_step_is_the_unrolled_one(family, remat, monkeypatch):
    loss, weights, unrolled_scans = step(family, remat, False, monkeypatch)
    scanned_loss, scanned_weights, groups = step(family, remat, True, monkeypatch)
    assert unrolled_scans == [] and len(groups) == 1 and groups[0] >= 2, groups  # the layers did run as one scan
    assert abs(scanned_loss - loss) <= BOUND * abs(loss)
    assert scanned_weights.keys() == weights.keys()
    assert max(float(np.max(np.abs(scanned_weights[k] - weights[k]))) for k in weights) <= BOUND


def full_adafactor_step(scanned: bool) -> dict:
    """One full fine-tuning Adafactor step of a tiny Llama wide enough (128) for Adafactor to factor its
    matrices' second moments, so that its updates' root mean square is not 1 and its clipping acts."""
    programs.clear()
    module = tiny_model("llama", layers=LAYERS, hidden_size=128, intermediate_size=256)
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=scanned)
    cfg = TrainConfig(batch_size=2, max_steps=1, warmup_steps=0, optimizer="adafactor", learning_rate=1e-2)
    optimizer = steps.make_optimizer(cfg)
    ids = np.random.default_rng(0).integers(3, VOCAB, (1, 2, 48)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    weights = {k: v.copy() for k, v in model.weights.items()}
    opt_state = steps.init_optimizer(model, optimizer, weights)
    _, weights, _ = steps.make_train_step(model, optimizer)(
        weights, model.buffers, opt_state, batch, ids, steps.step_key(0, 0), 1.0
    )
    return {k: np.asarray(v) for k, v in model.flat(weights).items()}


def test_adafactor_clips_a_stacked_weights_update_a_layer_at_a_time(monkeypatch):
    """Adafactor scales each weight's update to a root mean square of at most 1: a stacked weight's layers
    are clipped each on its own, as the unrolled model's weights are, not as one block."""
    weights = full_adafactor_step(False)
    assert max(float(np.max(np.abs(full_adafactor_step(True)[k] - weights[k]))) for k in weights) <= BOUND
    monkeypatch.setattr(scan, "leading_axes", lambda name: 0)  # the whole stack one block: another update
    as_one_block = full_adafactor_step(True)
    assert max(float(np.max(np.abs(as_one_block[k] - weights[k]))) for k in weights) > 100 * BOUND


def gemma_in_runs(groups: int = 2):
    """A tiny Gemma 3 of Gemma's own pattern, shortened: two sliding-window layers then one global, twice."""
    from transformers import AutoModelForCausalLM

    from jaxtune.config import TinyModelConfig
    from jaxtune.offline.architectures import tiny_config
    from tests.conftest import BOS, EOS, PAD

    shape = TinyModelConfig(
        architecture="gemma3", hidden_size=64, intermediate_size=128, num_hidden_layers=3 * groups,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16, vocab_size=VOCAB,
    )  # fmt: skip
    config = tiny_config("gemma3", shape, VOCAB, PAD, BOS, EOS)
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * groups
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_the_alike_layers_of_a_run_trace_once_and_the_step_is_the_unrolled_one(remat, monkeypatch):
    """Gemma's sliding-window layers of a group are one run, one stack: the group's body traces one sliding
    layer and one global, whatever the run's length, and the step is the unrolled one."""
    loss, weights, _ = step("gemma3", remat, False, monkeypatch, gemma_in_runs())
    module = gemma_in_runs()
    layer_class = type(module.model.layers[0])
    traced = []
    real_forward = layer_class.forward

    def counted(self, *args, **kwargs):
        traced.append(self.config.layer_types[self.layer_idx])
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", counted)
    scanned_loss, scanned_weights, scans = step("gemma3", remat, True, monkeypatch, module)
    assert scans == [2], scans  # one scan, over the 2 groups
    assert sorted(set(traced)) == ["full_attention", "sliding_attention"]
    assert traced.count("sliding_attention") == traced.count("full_attention"), traced  # not twice as many
    assert abs(scanned_loss - loss) <= BOUND * abs(loss)
    assert scanned_weights.keys() == weights.keys()
    assert max(float(np.max(np.abs(scanned_weights[k] - weights[k]))) for k in weights) <= BOUND


def test_layers_group_by_the_period_of_what_they_are_called_with():
    alike = [("a", 1)] * 6
    assert scan.period(alike) == 1
    gemma = [("sliding", 1)] * 5 + [("global", 2)]
    assert scan.period(gemma * 4 + gemma[:2]) == 6  # Gemma 3 1B: 26 layers, 4 groups of 6 and 2 more
    assert scan.period([("a",), ("b",), ("c",)]) == 3  # nothing repeats: one group, run unrolled
    assert scan._plain(((torch.zeros(2), None), {"mask": torch.ones(1), "window": 16}))
    assert not scan._plain(((torch.zeros(2),), {"cache": object()}))  # decoding's KV cache: unrolled


def test_decoding_a_scanned_model_gives_the_unrolled_tokens():
    """Decoding's layers update a KV cache at their own index, so they stay unrolled: the same tokens."""
    from jaxtune.runtime.decoding.inference import greedy_generate

    module = tiny_model("gemma3", layers=LAYERS)
    model = rt_model.to_jax(module, make_placement(MeshConfig()))
    prompts = np.random.default_rng(1).integers(3, VOCAB, (2, 9)).tolist()
    unrolled = greedy_generate(model, prompts, 2, 6, eos_ids=(), pad_id=0)
    programs.clear()
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=True)
    assert model.layout is not None and model.layout.groups >= 2
    assert greedy_generate(model, prompts, 2, 6, eos_ids=(), pad_id=0) == unrolled


@pytest.mark.parametrize("remat", ["layer", "matmuls"])
def test_a_scanned_step_over_a_quantized_base_is_the_unrolled_one(remat):
    """A quantized base's codes are integer buffers of each layer: inside a scan over layers they are values of
    the scan's trace, which layer remat must take as inputs like the float weights (JAX's closure_convert hoists
    floats only: the scanned step failed to lower, "No constant handler for type: DynamicJaxprTracer")."""
    from jaxtune.runtime.modeling import quantize

    module = rt_model.attach_lora(tiny_model("llama", layers=4), LoraConfig(r=4, target_modules="all-linear"))
    assert quantize.quantize_base(module, "nf4")
    cfg = TrainConfig(batch_size=2, max_steps=1, warmup_steps=0, optimizer="sgd", learning_rate=1.0, remat=remat)
    optimizer = steps.make_optimizer(cfg)
    ids = np.random.default_rng(0).integers(3, VOCAB, (1, 2, 48)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    losses = []
    for scanned in (False, True):
        programs.clear()
        model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=scanned)
        weights = {k: v.copy() for k, v in model.weights.items()}
        step = steps.make_train_step(model, optimizer, steps.StepSpec(remat))
        opt_state = steps.init_optimizer(model, optimizer, weights)
        loss, _, _ = step(weights, model.buffers, opt_state, batch, ids, steps.step_key(0, 0), 1.0)
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) <= BOUND * abs(losses[0]), losses


def test_a_layout_stacks_each_run_of_alike_layers_and_gives_back_per_layer_names():
    """Gemma 3's 1B pattern: 26 layers, groups of six (a run of five sliding, one global), two layers left
    unrolled. The five sliding layers of a group are one stack's rows [g, j], the global ones another's [g]."""
    assert scan.runs_of(["s"] * 5 + ["g"]) == (5, 1) and scan.runs_of(["a"]) == (1,)
    assert scan.runs_of(["a", "b", "b", "a"]) == (1, 2, 1)
    layout = scan.Layout(tuple(f"model.layers.{i}." for i in range(26)), period=6, groups=4, runs=(5, 1))
    flat = {f"model.layers.{i}.mlp.up_proj.weight": np.full((3, 2), i, np.float32) for i in range(26)}
    flat["model.norm.weight"] = np.ones(2, np.float32)
    held = layout.stacked(flat)
    assert held["model.layers.stack1.mlp.up_proj.weight"].shape == (4, 3, 2)
    assert held["model.layers.stack1.mlp.up_proj.weight"][:, 0, 0].tolist() == [5, 11, 17, 23]
    assert held["model.layers.stack0.mlp.up_proj.weight"].shape == (4, 5, 3, 2)
    assert held["model.layers.stack0.mlp.up_proj.weight"][2, :, 0, 0].tolist() == [12, 13, 14, 15, 16]
    assert layout.member("model.layers.15.mlp.up_proj.weight") == ("model.layers.stack0.mlp.up_proj.weight", (2, 3))
    assert "model.layers.24.mlp.up_proj.weight" in held and "model.norm.weight" in held  # after the last group
    back = layout.flat(held)
    assert back.keys() == flat.keys() and all(np.array_equal(back[k], flat[k]) for k in flat)
    # an optimizer state's arrays, keyed by pytree paths, split and stacked again the same way
    state = {f"[0].mu['{k}']": v for k, v in held.items()} | {"[0].count": np.int32(3)}
    per_layer = layout.flat_paths(state)
    assert "[0].mu['model.layers.23.mlp.up_proj.weight']" in per_layer and "[0].count" in per_layer
    again = layout.stacked_paths(per_layer, list(state))
    assert again.keys() == state.keys() and all(np.array_equal(again[k], state[k]) for k in state)


def test_a_stacked_run_writes_the_unrolled_runs_checkpoint_and_resumes_from_either(tmp_path):
    """Files keep per-layer names: a checkpoint written from stacked weights and optimizer state has the names,
    shapes and values of the unrolled one's, and each layout resumes from the other's."""
    from jaxtune.runtime.train import checkpoint

    module = rt_model.attach_lora(tiny_model("llama", layers=4), LoraConfig(r=4, target_modules="all-linear"))
    optimizer = steps.make_optimizer(TrainConfig())
    models, states, written = {}, {}, {}
    for scanned in (False, True):
        model = models[scanned] = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=scanned)
        opt_state = states[scanned] = steps.init_optimizer(model, optimizer)
        moved = jax_tree_map(lambda a: a + 0.5 if np.issubdtype(a.dtype, np.floating) else a, opt_state)
        checkpoint.save(tmp_path / str(scanned), 1, model.weights, moved, {"log": []}, model.layout)
        path = checkpoint.complete(tmp_path / str(scanned))[-1]
        written[scanned] = {name: load(path / name) for name in ("weights.safetensors", "optimizer.safetensors")}
    assert models[True].layout is not None and models[True].weights.keys() != models[False].weights.keys()
    for name, unrolled in written[False].items():
        stacked = written[True][name]
        assert stacked.keys() == unrolled.keys(), name
        assert all(np.array_equal(stacked[k], unrolled[k]) for k in unrolled), name
    for scanned, model in models.items():
        resumed = checkpoint.latest(tmp_path / str(not scanned), states[scanned], model.layout)
        assert resumed.weights.keys() == model.weights.keys()
        assert all(np.array_equal(resumed.weights[k], np.asarray(v)) for k, v in model.weights.items())
        expected = jax_tree_map(lambda a: a + 0.5 if np.issubdtype(a.dtype, np.floating) else a, states[scanned])
        assert all(np.array_equal(a, b) for a, b in zip(jax_tree_leaves(resumed.opt_state), jax_tree_leaves(expected)))


def jax_tree_leaves(tree):
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def jax_tree_map(fn, tree):
    import jax

    return jax.tree.map(lambda a: fn(np.asarray(a)), tree)


def load(path):
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_stacked_programs_size_does_not_grow_with_depth(family):
    """The scanned step traces one group, whatever the depth: its lowered program and the decoder layers'
    forward calls while tracing are the same for 4 groups and 16; unrolled, both grow with the layers."""
    from torchax import interop  # noqa: F401  (the step traces through torchax)

    def traced(layers: int, scanned: bool) -> tuple[int, int]:
        programs.clear()
        module = rt_model.attach_lora(tiny_model(family, layers=layers), LoraConfig(r=4))
        model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=scanned)
        layer_class = type(rt_model_layers(module)[0])
        calls = []
        original = layer_class.forward

        def counted(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        layer_class.forward = counted
        try:
            optimizer = steps.make_optimizer(TrainConfig())
            arguments = steps.train_step_arguments(model, optimizer, 1, 2, 32)
            with model.env:
                lowered = steps.shared_train_step(model, optimizer).lower(model, *arguments)
        finally:
            layer_class.forward = original
        return len(lowered.as_text()), len(calls)

    period = 2 if family == "gemma3" else 1  # the tiny Gemma 3 alternates sliding and global layers
    (short, short_calls), (deep, deep_calls) = traced(4 * period, True), traced(16 * period, True)
    assert short_calls == deep_calls == period, (short_calls, deep_calls)
    assert deep <= 1.05 * short, (short, deep)
    (unrolled_short, _), (unrolled_deep, unrolled_calls) = traced(4 * period, False), traced(16 * period, False)
    assert unrolled_calls == 16 * period and unrolled_deep > 2 * unrolled_short  # what the scan spares


def rt_model_layers(module):
    from jaxtune.runtime.modeling.remat import decoder_layers

    return decoder_layers(module)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_stacked_model_counts_the_flops_of_its_layers(quantized):
    """MFU's model FLOPs count each row of a stack as the layer it is: the unrolled model's count."""
    from jaxtune.runtime.measures.flops import train_flops_per_token
    from jaxtune.runtime.modeling import quantize

    module = rt_model.attach_lora(tiny_model("gemma3", layers=LAYERS), LoraConfig(r=4, target_modules="all-linear"))
    if quantized:
        assert quantize.quantize_base(module, "int8")
    counts = [
        train_flops_per_token(rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=s), 24.0)
        for s in (False, True)
    ]
    assert counts[0] == counts[1] and counts[0]["total"] > 0, counts


def test_a_scanned_group_keeps_no_unpacked_codes_of_a_quantized_base(monkeypatch):
    """What the scan keeps for the backward pass, once a group: the group's input, its arguments and the outputs of
    its matmuls; never a quantized base's unpacked codes (a byte a weight, the base's size again over nf4's half
    byte) nor what its dequantizing's barrier passes through, which are recomputed from the codes."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxtune.runtime.modeling import quantize

    module = rt_model.attach_lora(tiny_model("llama", layers=4, hidden_size=256, intermediate_size=512), LoraConfig())
    assert quantize.quantize_base(module, "nf4")
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=True)
    kept = []
    checkpoint = scan.jax.checkpoint

    def recording(fn, **kwargs):
        wrapped = checkpoint(fn, **kwargs)

        def run(*args):
            shapes = scan.jax.tree.map(lambda a: scan.jax.ShapeDtypeStruct(a.shape, a.dtype), args)
            kept.extend((str(aval.dtype), why) for aval, why in saved_residuals(wrapped, *shapes))
            return wrapped(*args)

        return run

    monkeypatch.setattr(scan.jax, "checkpoint", recording)
    monkeypatch.setattr(scan, "traced_once", lambda fn: fn)  # the layers' bodies in sight of `saved_residuals`
    optimizer = steps.make_optimizer(TrainConfig())
    programs.clear()
    with model.env:
        steps.shared_train_step(model, optimizer).lower(model, *steps.train_step_arguments(model, optimizer, 1, 2, 64))
    outputs = [(dtype, why) for dtype, why in kept if not why.startswith("from the argument")]
    assert any("dot_general" in why for _, why in outputs), kept  # the matmuls' outputs are kept
    assert not [why for dtype, why in outputs if dtype == "uint8" or "optimization_barrier" in why], outputs


def test_a_stacked_model_matches_pytorch_logits_and_gradients():
    """The parity checks run PyTorch's own forward on the per-layer tensors a stacked model holds as stacks:
    the eval stage's logits parity, and the loss and gradients, named per layer, against PyTorch's."""
    from jaxtune.runtime.measures import parity

    module = rt_model.attach_lora(tiny_model("gemma3", layers=LAYERS), LoraConfig(r=4, target_modules="all-linear"))
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=True)
    assert model.layout is not None
    rows = np.random.default_rng(2).integers(3, VOCAB, (2, 24))
    found = parity.logits_parity(model, rows.tolist(), pad_id=0)
    assert found["max_abs_diff"] <= BOUND * max(found["max_abs_logit"], 1.0), found
    batch = {"input_ids": rows.astype(np.int32), "attention_mask": np.ones_like(rows, np.int32)}
    loss, grads = parity.jax_loss_and_grads(model, batch, batch["input_ids"])
    torch_loss, torch_grads = parity.torch_loss_and_grads(model, batch, batch["input_ids"])
    assert grads.keys() == torch_grads.keys() and abs(loss - torch_loss) <= BOUND * abs(torch_loss)
    assert max(float(np.max(np.abs(grads[k] - torch_grads[k]))) for k in grads) <= BOUND


def test_a_stacked_eval_step_draws_no_keys(monkeypatch):
    """Only keyed layers (training, or remat) draw keys, as unrolled: a stacked eval step draws none from torchax's
    generator, whose concrete seed a traced draw would close over (the offline pipeline's final_eval then called
    its logits program with one argument fewer than it was compiled for)."""
    from jaxtune.runtime.modeling import remat

    drawn = []
    real = remat.next_key
    monkeypatch.setattr(remat, "next_key", lambda: drawn.append(1) or real())
    module = rt_model.attach_lora(tiny_model("gemma3", layers=LAYERS), LoraConfig(r=4))
    model = rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=True)
    rows = np.random.default_rng(3).integers(3, VOCAB, (2, 16)).astype(np.int32)
    batch = {"input_ids": rows, "attention_mask": np.ones_like(rows)}
    programs.clear()
    with model.env:
        steps.shared_eval_step(model).lower(model, model.weights, model.buffers, batch, rows)
    assert drawn == []
    optimizer = steps.make_optimizer(TrainConfig())
    with model.env:  # a train step's layers are keyed: each group position of each group draws its own
        steps.shared_train_step(model, optimizer).lower(model, *steps.train_step_arguments(model, optimizer, 1, 2, 16))
    assert len(drawn) >= model.layout.groups * model.layout.period
