"""The training loop: determinism, the NaN guard, checkpoints and resume, the memory plan, the log."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
from jaxtune.errors import NonFiniteLoss, TrainingGaveUp, TrainingStopped
from jaxtune.runtime.compiled import steps
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures import memory
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train import checkpoint, training
from tests.conftest import PAD, VOCAB, tiny_model

pytestmark = pytest.mark.training

CFG = TrainConfig(
    max_steps=8,
    batch_size=4,
    grad_accumulation=2,
    learning_rate=5e-3,
    warmup_steps=2,
    log_every=3,
    checkpoint_every=2,
    eval_every=4,
    seed=3,
)


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    ids = [
        rng.integers(3, VOCAB, int(rng.integers(6, 17))).tolist() for _ in range(n)
    ]  # one length bucket: one compile
    return ids, ids  # every token scored


def fresh_model(dropout: float = 0.1):
    module = rt_model.attach_lora(tiny_model("gemma3"), LoraConfig(r=4, dropout=dropout, target_modules="all-linear"))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def run(cfg=CFG, model=None, **kwargs):
    ids, labels = data()
    records = []
    result = training.train(
        model or fresh_model(),
        ids,
        labels,
        cfg,
        PAD,
        32,
        on_log=records.extend,
        eval_data=data(8, seed=1),
        check_memory=False,
        **kwargs,
    )
    return result, records


@pytest.fixture(scope="module")
def reference():
    """One uninterrupted run of CFG: (TrainResult, the records it reported)."""
    return run()


def test_same_config_and_seed_give_a_bit_identical_loss_trajectory(reference):
    first, _ = reference
    second, _ = run()
    losses = [r["loss"] for r in first.log if "loss" in r]
    assert len(losses) == 8 and losses == [r["loss"] for r in second.log if "loss" in r]
    for name, value in first.weights.items():
        np.testing.assert_array_equal(value, second.weights[name])
    third, _ = run(CFG.model_copy(update={"seed": 4}))  # the seed matters: data order and dropout
    assert [r["loss"] for r in third.log if "loss" in r] != losses


def test_log_has_every_step_and_the_periodic_eval(reference):
    result, records = reference
    steps_logged = [r["step"] for r in records if "loss" in r]
    assert steps_logged == list(range(1, 9))
    assert all({"loss", "lr", "grad_norm", "tokens", "tokens_per_second"} <= set(r) for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8]
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(5e-3)  # warmup of 2 steps
    assert result.summary.rows_per_step == 8 and result.summary.resumed_from == 0


class Killed(BaseException):
    """A kill, as the loop sees it: nothing saved, nothing noted (a BaseException, which no
    handler in the loop takes; not KeyboardInterrupt, which would end the whole test session)."""


def stops_after(limit: int):
    """`steps.make_train_step` whose steps after the `limit`-th raise `Killed`."""
    real_step = steps.make_train_step

    def make(*args, **kwargs):
        step, calls = real_step(*args, **kwargs), []

        def counted(*a):
            calls.append(1)
            if len(calls) > limit:
                raise Killed
            return step(*a)

        return counted

    return make


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(reference, tmp_path, monkeypatch):
    """Stop after step 5 (the newest checkpoint is step 4), run again: same final weights."""
    uninterrupted, _ = reference
    real_step = steps.make_train_step

    monkeypatch.setattr(steps, "make_train_step", stops_after(5))
    with pytest.raises(Killed):
        run(checkpoint_dir=tmp_path)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000002", "step-00000004"]
    monkeypatch.setattr(steps, "make_train_step", real_step)
    resumed, _ = run(checkpoint_dir=tmp_path)
    assert resumed.summary.resumed_from == 4
    # Step 4 was the last logged (a checkpoint step, so synced); step 5's loss never was.
    assert resumed.summary.model_dump()["interruptions"] == [
        {"reached": 4, "resumed_from": 4, "lost_steps": 0, "stopped_by": "killed", "restart": False}
    ]
    assert [r["step"] for r in resumed.log if "loss" in r] == list(range(1, 9))
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)


def test_a_stacked_run_checkpoints_per_layer_names_and_resumes_to_the_uninterrupted_runs_weights(tmp_path, monkeypatch):
    """Layers held stacked (`model.scan_layers`): the checkpoints and the result hold the unrolled model's per-layer
    names, and a run stopped after step 5 resumes from step 4's checkpoint to the very weights of a run never
    stopped."""

    def stacked_model():
        module = rt_model.attach_lora(tiny_model("gemma3", layers=4), LoraConfig(r=4, target_modules="all-linear"))
        return rt_model.to_jax(module, make_placement(MeshConfig()), scan_layers=True)

    names = set(rt_model.to_jax(stacked_model().module, make_placement(MeshConfig())).weights)
    model = stacked_model()
    assert model.layout is not None and set(model.weights) != names
    uninterrupted, _ = run(model=model)
    assert set(uninterrupted.weights) == names
    real_step = steps.make_train_step
    monkeypatch.setattr(steps, "make_train_step", stops_after(5))
    with pytest.raises(Killed):
        run(model=stacked_model(), checkpoint_dir=tmp_path)
    assert set(load_file(str(checkpoint.complete(tmp_path)[-1] / "weights.safetensors"))) == names
    monkeypatch.setattr(steps, "make_train_step", real_step)
    resumed, _ = run(model=stacked_model(), checkpoint_dir=tmp_path)
    assert resumed.summary.resumed_from == 4
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)


def test_automatic_restarts_stuck_at_one_checkpoint_give_up_and_a_run_by_hand_goes_on(reference, tmp_path, monkeypatch):
    """Killed after step 5 (checkpoint 4), then three automatic restarts each killed before a step:
    the fourth gives up before it trains. Started by hand, it resumes from step 4 and finishes."""
    uninterrupted, _ = reference
    real_step = steps.make_train_step
    monkeypatch.setattr(steps, "make_train_step", stops_after(5))
    with pytest.raises(Killed):
        run(checkpoint_dir=tmp_path)
    monkeypatch.setattr(steps, "make_train_step", stops_after(0))
    for _ in range(training.GIVE_UP_AFTER):
        with pytest.raises(Killed):
            run(checkpoint_dir=tmp_path, restart=True)
    with pytest.raises(TrainingGaveUp) as gave_up:
        run(checkpoint_dir=tmp_path, restart=True)
    assert str(gave_up.value) == (
        "gave up: 3 automatic restarts in a row resumed from step "
        "4 and none saved a later checkpoint (the last reached "
        "step 4, killed); not restarting again. Find the cause in those runs' logs, then run it again by hand: it "
        "resumes from step 4"
    )

    monkeypatch.setattr(steps, "make_train_step", real_step)
    resumed, _ = run(checkpoint_dir=tmp_path)
    # Each entry is one attempt's end, and whether the attempt after it was an automatic restart.
    stuck = {"reached": 4, "resumed_from": 4, "lost_steps": 0, "stopped_by": "killed", "restart": True}
    by_hand = {**stuck, "stopped_by": "gave up", "restart": False}
    assert resumed.summary.model_dump()["interruptions"] == [stuck] * 4 + [by_hand]
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)


def test_a_restart_after_a_run_by_hand_counts_afresh(tmp_path, monkeypatch):
    """The count of stuck restarts is of restarts in a row: a run started by hand in between resets it."""
    monkeypatch.setattr(steps, "make_train_step", stops_after(3))
    with pytest.raises(Killed):
        run(checkpoint_dir=tmp_path)
    monkeypatch.setattr(steps, "make_train_step", stops_after(0))
    for restart in [True] * training.GIVE_UP_AFTER + [False, True]:
        with pytest.raises(Killed):
            run(checkpoint_dir=tmp_path, restart=restart)
    assert [i["restart"] for i in checkpoint.read_interruptions(tmp_path)] == [True, True, True, False, True]


def nan_loss_at(call: int):
    """`steps.make_train_step` whose `call`-th step returns a NaN loss."""
    real_step = steps.make_train_step

    def poisoned(*args, **kwargs):
        step, calls = real_step(*args, **kwargs), []

        def run_step(*a):
            calls.append(1)
            loss, weights, state = step(*a)
            return (loss * np.nan if len(calls) == call else loss), weights, state

        return run_step

    return poisoned


def test_non_finite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "make_train_step", nan_loss_at(5))
    with pytest.raises(NonFiniteLoss, match=r"train step 5: loss nan.*step-00000004 \(kept\)"):
        run(checkpoint_dir=tmp_path)
    assert (tmp_path / "step-00000004" / "weights.safetensors").is_file()


def test_non_finite_gradient_with_a_finite_loss_stops_the_run(tmp_path, monkeypatch):
    """A NaN in one tensor's gradient at step 5: the loss is still finite, the gradient norm is not."""
    import jax.numpy as jnp
    import optax
    from safetensors.numpy import load_file

    real_optimizer = steps.make_optimizer

    def nan_in_one_gradient_at_step_5(cfg):
        real = real_optimizer(cfg)

        def update(grads, state, params=None):
            first = sorted(grads)[0]
            return real.update({**grads, first: jnp.where(state.count == 4, jnp.nan, grads[first])}, state, params)

        return optax.GradientTransformation(real.init, update)

    monkeypatch.setattr(steps, "make_optimizer", nan_in_one_gradient_at_step_5)
    with pytest.raises(NonFiniteLoss, match=r"train step 5: loss \d+\.\d+, gradient norm nan.*step-00000004 \(kept\)"):
        run(checkpoint_dir=tmp_path)
    kept = checkpoint.complete(tmp_path)[-1]
    assert kept.name == "step-00000004"
    assert all(np.isfinite(v).all() for v in load_file(str(kept / "weights.safetensors")).values())


def test_layer_remat_with_accumulation_and_dropout_trains_as_without():
    """Remat recomputes each layer in the backward pass: the recomputation must draw the same
    dropout mask as the forward did, across 2 micro-batches a step."""
    cfg = CFG.model_copy(update={"max_steps": 4, "eval_every": None})
    plain, _ = run(cfg)
    remat, _ = run(cfg.model_copy(update={"remat": "layer"}))
    losses = [r["loss"] for r in plain.log if "loss" in r]
    remat_losses = [r["loss"] for r in remat.log if "loss" in r]
    print(f"losses without remat {losses}, with {remat_losses}")
    np.testing.assert_allclose(remat_losses, losses, rtol=1e-6)
    # Recomputed activations may fuse differently, and Adam turns a rounding-sized gradient into a
    # step of up to lr (5e-3): allow 1e-5, while a different dropout mask moves weights by whole steps.
    for name, value in plain.weights.items():
        np.testing.assert_allclose(remat.weights[name], value, rtol=0, atol=1e-5, err_msg=name)
    no_dropout, _ = run(cfg, model=fresh_model(dropout=0.0))
    assert [r["loss"] for r in no_dropout.log if "loss" in r] != losses, "dropout was live"


def test_memory_plan_counts_each_part_and_refuses_what_cannot_fit():
    model = fresh_model()
    cfg = TrainConfig(method="lora", batch_size=4, grad_accumulation=2, remat="matmuls")
    plan = memory.memory_plan(model, steps.make_optimizer(cfg), cfg, 64)
    trainable = sum(v.size * 4 for v in model.weights.values())
    assert plan.gradients == trainable and plan.optimizer_state >= 2 * trainable  # AdamW: two moments
    assert plan.activations_per_micro_batch > 0 and plan.peak > plan.parameters
    memory.check_fits(plan, cfg)  # the CPU reports no limit: nothing to refuse
    full = TrainConfig(method="full", optimizer="adamw", batch_size=4, remat="matmuls")
    with pytest.raises(MemoryError) as refused:
        memory.check_fits(dataclasses.replace(plan, device_limit=plan.peak // 2), full)
    message = str(refused.value)
    for knob in ("train.method=lora", "train.optimizer=adafactor", "train.remat=layer", "train.grad_accumulation"):
        assert knob in message


def signalled_at(call: int, *signums: int):
    """`steps.make_train_step` whose `call`-th step, once run, sends this process `signums` in turn."""
    real_step = steps.make_train_step

    def make(*args, **kwargs):
        step, calls = real_step(*args, **kwargs), []

        def run_step(*a):
            calls.append(1)
            out = step(*a)
            if len(calls) == call:
                for signum in signums:
                    os.kill(os.getpid(), signum)
            return out

        return run_step

    return make


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_checkpoints_the_step_it_reached_and_the_rerun_resumes_there(
    reference, tmp_path, monkeypatch, signum
):
    """Step 5 is no checkpoint step (every 2): without the handler SIGTERM would end the process
    and SIGINT raise KeyboardInterrupt, with step 4 the newest checkpoint."""
    uninterrupted, _ = reference
    real_step, before = steps.make_train_step, signal.getsignal(signum)
    monkeypatch.setattr(steps, "make_train_step", signalled_at(5, signum))
    name = signal.Signals(signum).name
    with pytest.raises(TrainingStopped) as stopped:
        run(checkpoint_dir=tmp_path)
    assert (
        str(stopped.value)
        == f"stopped by {name} at step 5; checkpoint saved ({tmp_path / 'step-00000005'}); run again to resume"
    )
    assert (stopped.value.signal, stopped.value.step) == (name, 5)
    assert signal.getsignal(signum) is before, "the loop's handler outlived the loop"
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000004", "step-00000005"]

    monkeypatch.setattr(steps, "make_train_step", real_step)
    resumed, _ = run(checkpoint_dir=tmp_path)
    assert resumed.summary.resumed_from == 5
    assert resumed.summary.model_dump()["interruptions"] == [
        {"reached": 5, "resumed_from": 5, "lost_steps": 0, "stopped_by": name, "restart": False}
    ]
    assert [r["step"] for r in resumed.log if "loss" in r] == list(range(1, 9))
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)


def test_a_second_signal_while_stopping_goes_to_the_handler_there_before(tmp_path, monkeypatch):
    """The first SIGTERM only asks for a stop; the second is handled as it would have been
    without the loop, at once, so the step-3 checkpoint is never written."""

    class Escalated(Exception):
        pass

    calls = []

    def before(signum, frame):
        calls.append(signum)
        raise Escalated

    monkeypatch.setattr(steps, "make_train_step", signalled_at(3, signal.SIGTERM, signal.SIGTERM))
    previous = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(Escalated):
            run(checkpoint_dir=tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [signal.SIGTERM]  # once, for two signals
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000002"]


def test_checkpoint_minutes_saves_by_time_whatever_the_step(reference, tmp_path):
    """checkpoint_every past the run and a minutes bound already passed at every step: each step
    but the last is saved (the newest KEEP=2 stay), and saving changes nothing trained."""
    uninterrupted, _ = reference
    timed, _ = run(
        CFG.model_copy(update={"checkpoint_every": 100, "checkpoint_minutes": 1e-9}), checkpoint_dir=tmp_path
    )
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000006", "step-00000007"]
    assert [(r["step"], r["loss"]) for r in timed.log if "loss" in r] == [
        (r["step"], r["loss"]) for r in uninterrupted.log if "loss" in r
    ]
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(timed.weights[name], value, err_msg=name)
