"""train.remat auto (`runtime.measures.fit`): the cheapest way to run a batch whose compiled plan fits the
device, and a split batch that trains as the whole one did.

The CPU reports no memory, so each test names the device's memory (`limit`) from the plans the
candidates compile to here: between two candidates' needs, exactly one side fits.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures import fit, memory
from jaxtune.runtime.modeling import loss
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train import training
from tests.conftest import PAD, VOCAB, tiny_model
from tests.mesh.bounds import RHO

pytestmark = pytest.mark.training

LENGTH = 256  # long enough that activations outweigh the tiny model's weights and code
CFG = TrainConfig(
    batch_size=4,
    max_steps=1,
    warmup_steps=0,
    optimizer="sgd",
    learning_rate=0.5,
    weight_decay=0.0,
    max_grad_norm=1e9,
    log_every=1,
    checkpoint_every=1,
)


def fresh_model():
    module = rt_model.attach_lora(tiny_model("llama", layers=2), LoraConfig(r=4, target_modules="all-linear"))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def shape(run: TrainConfig) -> tuple[int, int, int]:
    return run.batch_size, LENGTH, 0


@pytest.fixture(scope="module")
def needs():
    """(model, {candidate: bytes its plan needs}) for none, matmuls and layer at 4 rows, layer at 2 and 1, none at 2."""
    model = fresh_model()
    optimizer = steps.make_optimizer(CFG)
    found = {}
    for remat, rows in (("none", 4), ("matmuls", 4), ("layer", 4), ("layer", 2), ("layer", 1), ("none", 2)):
        run = CFG.model_copy(update={"remat": remat, "batch_size": rows, "grad_accumulation": 4 // rows})
        found[(remat, rows)] = memory.memory_plan(model, optimizer, run, LENGTH, rows=rows).needed
    print({f"{r} x{n}": f"{b / 2**20:.2f} MiB" for (r, n), b in found.items()})
    return model, found


def device_between(low: int, high: int) -> int:
    """A device's memory whose budget (less `fit.HEADROOM`) holds `low` bytes and not `high`."""
    assert low < high, "the candidates' needs are not ordered as the policies' recomputation is"
    return int((low + high) / 2 / (1 - fit.HEADROOM))


def test_needs_fall_with_each_policy_and_with_smaller_micro_batches(needs):
    _, found = needs
    order = [("none", 4), ("matmuls", 4), ("layer", 4), ("layer", 2), ("layer", 1)]
    assert [found[c] for c in order] == sorted((found[c] for c in order), reverse=True)
    assert len({found[c] for c in order}) == len(order)


@pytest.mark.parametrize(
    ("between", "remat", "split"),
    [
        ((("none", 4), None), "none", 1),
        ((("matmuls", 4), ("none", 4)), "matmuls", 1),
        ((("layer", 4), ("matmuls", 4)), "layer", 1),
        ((("layer", 2), ("layer", 4)), "layer", 2),
        ((("layer", 1), ("layer", 2)), "layer", 4),
    ],
)
def test_auto_takes_the_least_recomputation_that_fits(needs, between, remat, split, monkeypatch):
    model, found = needs
    monkeypatch.setattr(fit, "MAX_NONE_SPLIT", 1)  # the policies' order alone (none on fewer rows: the next tests)
    low, high = between
    limit = device_between(found[low], found[high] if high else 2 * found[low])
    chosen = fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit)
    assert (chosen.remat, chosen.split, chosen.chosen_by) == (remat, split, "auto")
    assert chosen.plan.needed == found[(remat, 4 // split)] <= chosen.budget < limit
    # Every policy with less recomputation was tried first and did not fit; matmuls is not compiled
    # where none needs more than the budget by more than matmuls could save.
    earlier = fit.POLICIES[: fit.POLICIES.index(remat) + (1 if split > 1 else 0)]
    assert [t.remat for t in chosen.tried if t.split == 1] == list(earlier if split > 1 else (*earlier, remat))[:3]
    skipped = [t.remat for t in chosen.tried if t.skipped is not None]
    assert skipped == (
        ["matmuls"] if "matmuls" in earlier and found[("none", 4)] * fit.MATMULS_OF_NONE > chosen.budget else []
    )
    assert all(t.needed > chosen.budget for t in chosen.tried[:-1] if t.skipped is None)
    run = chosen.train_config(CFG)
    assert (run.remat, run.batch_size, run.grad_accumulation) == (remat, 4 // split, split)


def compiling(monkeypatch) -> list[tuple[str, int]]:
    """(policy, rows) of every plan `fit.choose` compiles from now on."""
    compiled, compile_plan = [], memory.memory_plan
    monkeypatch.setattr(
        memory,
        "memory_plan",
        lambda model, optimizer, cfg, *a, **k: (
            compiled.append((cfg.remat, k["rows"])) or compile_plan(model, optimizer, cfg, *a, **k)
        ),
    )
    return compiled


def test_where_none_does_not_fit_it_runs_on_fewer_rows_before_any_recomputation(needs, monkeypatch):
    model, found = needs
    compiled = compiling(monkeypatch)
    # Room for none at 2 rows, not at 4 (nor for matmuls at 4): two micro-batches of 2 rows, no recomputation,
    # the update of the whole batch.
    limit = device_between(found[("none", 2)], found[("matmuls", 4)])
    assert found[("none", 2)] < limit * (1 - fit.HEADROOM) < found[("matmuls", 4)] < found[("none", 4)]
    chosen = fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit)
    assert (chosen.remat, chosen.split, chosen.plan.needed) == ("none", 2, found[("none", 2)])
    assert compiled == [("none", 4), ("none", 2)]
    run = chosen.train_config(CFG)
    assert (run.remat, run.batch_size, run.grad_accumulation) == ("none", 2, 2)
    assert "batch_size 4 split into 2 micro-batches" in chosen.describe(CFG)


def test_none_on_fewer_rows_is_not_compiled_where_no_split_would_fit_by_estimate(needs, monkeypatch):
    model, found = needs
    compiled = compiling(monkeypatch)
    # Room for layer at 1 row, and not, with the margin, for none at 1 row (about half its need at 2): the estimate
    # (the unsplit plan's state and a quarter of its activations: 6.38 MiB here, 6.43 compiled) says no split of
    # none fits, so none is compiled once, then the recomputing policies as before.
    limit = int(1.1 * found[("layer", 1)] / (1 - fit.HEADROOM))
    assert found[("none", 2)] / 2 > fit.NONE_SPLIT_MARGIN * limit * (1 - fit.HEADROOM)
    chosen = fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit)
    assert (chosen.remat, chosen.split) == ("layer", 4)
    assert [c for c in compiled if c[0] == "none"] == [("none", 4)]


def test_matmuls_is_not_compiled_where_none_needs_far_more_than_there_is(needs, monkeypatch):
    model, found = needs
    monkeypatch.setattr(fit, "MAX_NONE_SPLIT", 1)  # none on fewer rows would fit here: not what this test is about
    compiled = compiling(monkeypatch)
    policies = lambda: [remat for remat, _ in compiled]  # noqa: E731
    # A budget that holds layer and is less than 3/4 of what none needs: matmuls is skipped, as on a TPU,
    # where a refused candidate is a whole compile lost.
    limit = int(found[("none", 4)] * fit.MATMULS_OF_NONE * 0.99 / (1 - fit.HEADROOM))
    chosen = fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit)
    assert chosen.remat == "layer" and "matmuls" not in policies() and policies()[0] == "none"
    assert [t.remat for t in chosen.tried][:3] == ["none", "matmuls", "layer"]
    assert "not compiled" in chosen.tried[1].skipped
    assert "matmuls chunk" in chosen.describe(CFG) and "not compiled" in chosen.describe(CFG)
    # Where none needs less than the budget over 3/4, matmuls is compiled and tried as before.
    compiled.clear()
    limit = device_between(found[("matmuls", 4)], found[("none", 4)])
    assert found[("none", 4)] * fit.MATMULS_OF_NONE <= limit * (1 - fit.HEADROOM)
    assert fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit).remat == "matmuls"
    assert policies()[:2] == ["none", "matmuls"]


def test_nothing_fits_says_so_in_one_line_with_what_would(needs):
    model, found = needs
    limit = int(found[("layer", 1)] * 0.9)
    with pytest.raises(fit.NothingFits) as refused:
        fit.choose(model, steps.make_optimizer(CFG), CFG, shape, limit=limit)
    message = str(refused.value)
    assert "\n" not in message and "with 1 row per micro-batch" in message
    assert refused.value.fit.split == 4 and refused.value.fit.plan.needed == found[("layer", 1)]
    # The length it names does fit: one row of it, compiled, within the budget.
    shorter = int(re.search(r"Try data\.max_length=(\d+) \(about", message)[1])
    assert 128 <= shorter < LENGTH
    run = CFG.model_copy(update={"remat": "layer", "batch_size": 1, "grad_accumulation": 4})
    plan = memory.memory_plan(model, steps.make_optimizer(CFG), run, shorter, rows=1)
    assert plan.needed <= limit * (1 - fit.HEADROOM)


def test_a_fixed_policy_is_obeyed_and_refused_before_the_first_step(needs, monkeypatch):
    model, found = needs
    limit = device_between(found[("layer", 4)], found[("matmuls", 4)])  # auto would take layer
    chosen = fit.choose(
        model, steps.make_optimizer(CFG), CFG.model_copy(update={"remat": "matmuls"}), shape, limit=limit
    )
    assert (chosen.remat, chosen.split, chosen.chosen_by, len(chosen.tried)) == ("matmuls", 1, "fixed", 1)
    monkeypatch.setattr(memory, "device_limit", lambda: found[("matmuls", 4)] // 2)
    ids = [list(range(3, 3 + LENGTH))] * 8
    calls = []
    monkeypatch.setattr(steps, "make_train_step", lambda *a, **k: calls.append(1))
    with pytest.raises(MemoryError, match="training needs .* GiB per device"):
        training.train(model, ids, ids, CFG.model_copy(update={"remat": "matmuls"}), PAD, LENGTH, packing=False)
    assert not calls, "no step was built"


def test_a_fixed_policy_takes_a_grown_loss_chunk_where_it_fits_and_the_smallest_where_not(needs, monkeypatch):
    model, found = needs
    optimizer, run = steps.make_optimizer(CFG), CFG.model_copy(update={"remat": "layer"})
    monkeypatch.setattr(
        loss, "chunk_tokens_on", lambda platform, vocab: 64
    )  # as small as an accelerator's, for this vocab
    roomy = fit.choose(model, optimizer, run, shape, limit=4 * found[("none", 4)])
    assert (roomy.remat, roomy.chosen_by, len(roomy.tried)) == ("layer", "fixed", 1) and roomy.chunk_tokens > 64
    # Where the compiler refuses the grown chunk (as XLA:TPU does a program past the chip), the smallest runs.
    compile_plan = memory.memory_plan

    def refusing(*args, chunk_tokens, **kwargs):
        if chunk_tokens > 64:
            raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory")
        return compile_plan(*args, chunk_tokens=chunk_tokens, **kwargs)

    monkeypatch.setattr(memory, "memory_plan", refusing)
    tight = fit.choose(model, optimizer, run, shape, limit=4 * found[("none", 4)])
    assert [t.chunk_tokens for t in tight.tried] == [roomy.chunk_tokens, 64] and tight.tried[0].refused
    assert (tight.remat, tight.chunk_tokens, tight.chosen_by) == ("layer", 64, "fixed")


def test_without_a_reported_memory_auto_is_matmuls_and_compiles_once(needs):
    model, found = needs
    chosen = fit.choose(model, steps.make_optimizer(CFG), CFG, shape)  # the CPU: no limit
    assert (chosen.remat, chosen.split, chosen.chosen_by, chosen.budget) == (
        "matmuls",
        1,
        "no device memory reported",
        None,
    )
    assert len(chosen.tried) == 1 and chosen.plan.needed == found[("matmuls", 4)]


def test_the_loss_chunk_grows_into_what_memory_is_left():
    gemma = 262_144  # Gemma 3's vocabulary: a 512-token chunk's backward pass holds 1.25 GiB
    assert loss.chunk_tokens_on("tpu", gemma) == loss.chunk_tokens_on("gpu", gemma) == 512
    assert loss.chunk_tokens_on("cpu", gemma) == 64  # 64 MiB of float32 logits
    per_token = gemma * loss.CHUNK_BYTES_PER_LOGIT
    assert loss.grown_chunk_tokens(512, gemma, 0, 4096) == 512
    assert loss.grown_chunk_tokens(512, gemma, 512 * per_token - 1, 4096) == 512  # 1024 needs 512 more tokens' worth
    assert loss.grown_chunk_tokens(512, gemma, 512 * per_token, 4096) == 1024
    assert loss.grown_chunk_tokens(512, gemma, 10**12, 4096) == 4096  # never past the micro-batch's tokens
    assert loss.grown_chunk_tokens(512, gemma, 10**12, 700) == 512


def test_a_split_batch_trains_as_the_whole_batch_does(needs, monkeypatch):
    """One SGD step (momentum's first step is the gradient) from the same weights: the run auto
    splits into 2 micro-batches of 2 rows moves every weight as the whole batch of 4 does, up to
    float32 summation order: the gradients may differ by RHO of their tensor's RMS
    (`tests.mesh.bounds`: splitting a sum in two changes its order as a mesh does), so the weights by
    lr x RHO x RMS, plus half an ulp of each weight's rounding per run."""
    model, found = needs
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(LENGTH // 2, LENGTH + 1, 8)]
    initial = {name: np.asarray(value) for name, value in model.weights.items()}

    records = []

    def trained(cfg, limit):
        monkeypatch.setattr(memory, "device_limit", lambda: limit)
        model.weights = {
            name: model.placement.put(value, model.weights[name].sharding) for name, value in initial.items()
        }
        records.clear()
        return training.train(model, ids, ids, cfg, PAD, LENGTH, packing=False, on_log=records.extend)

    whole = trained(CFG.model_copy(update={"remat": "layer"}), None)
    split = trained(CFG, device_between(found[("layer", 2)], found[("layer", 4)]))
    assert split.memory["fit"]["split"] == 2 and split.summary.batch_shape[:2] == [2, 2]
    told = records[0]  # the log hears the choice, and the steps the split run takes, before any step
    assert "batch_size 4 split into 2 micro-batches" in told["message"] and told["total_steps"] == 1
    assert whole.summary.batch_shape[:2] == [1, 4] and split.summary.rows_per_step == 4
    assert split.log[0]["loss"] == pytest.approx(whole.log[0]["loss"], rel=1e-6)
    moved = 0
    for name, before in initial.items():
        gradient = (before - whole.weights[name]) / CFG.learning_rate
        moved += np.abs(gradient).max() > 0
        bound = CFG.learning_rate * RHO * np.sqrt(np.mean(gradient**2)) + np.spacing(np.abs(whole.weights[name]))
        assert (np.abs(split.weights[name] - whole.weights[name]) <= bound).all(), name
    assert moved == sum(".lora_B." in name for name in initial)  # B starts at 0, so A's first gradient is 0


def test_none_is_tried_on_fewer_rows_where_the_estimate_says_it_just_fits():
    """Gemma 3 4B, layers stacked, LoRA 8 x 1024 on a v5e: none refused at 27.2 GiB of temporaries, 7.9 GB
    of weights, a 15.28 GiB budget. None in 4 micro-batches then planned 14.3 GiB (MFU 80% unrolled, where
    layer's recomputing gave 51%): the estimate tries it, with no margin that would have ruled it out."""
    state, activations, budget = 7.9e9, 27.2 * 2**30, 15.28 * 2**30
    assert fit._least_split(state, activations, budget * fit.NONE_SPLIT_MARGIN) == 4 <= fit.MAX_NONE_SPLIT
    assert fit._least_split(state, activations, budget * 0.9) > fit.MAX_NONE_SPLIT  # the margin it had before
