"""DPO training keeps the trainer's guarantees: a resumed run ends bit for bit where an
uninterrupted one does, and the NaN guard stops a run naming the step and the kept checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, PreferenceConfig, TrainConfig
from jaxtune.errors import NonFiniteLoss
from jaxtune.runtime.compiled import preference, steps
from jaxtune.runtime.decoding.inference import row_nll
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train import checkpoint, training
from tests.conftest import PAD, tiny_model
from tests.preference.test_pair_step import pair_rows
from tests.training.test_loop import Killed, nan_loss_at, stops_after

pytestmark = [pytest.mark.preference, pytest.mark.training]
CFG = TrainConfig(
    max_steps=6,
    batch_size=4,
    grad_accumulation=2,
    learning_rate=5e-3,
    warmup_steps=1,
    log_every=1,
    checkpoint_every=2,
    seed=3,
)
DPO = preference.Objective("dpo", PreferenceConfig(beta=0.5))


def fresh_model():
    module = rt_model.attach_lora(tiny_model("llama"), LoraConfig(r=4, target_modules="all-linear"))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def run(checkpoint_dir=None):
    model = fresh_model()
    ids, labels = pair_rows(24, seed=5)
    eval_ids, eval_labels = pair_rows(4, seed=6)
    reference = [
        -row_nll(model, i, l, batch_size=8, pad_id=PAD, progress=False)[0].astype(np.float32)
        for i, l in ((ids, labels), (eval_ids, eval_labels))
    ]
    return training.train(
        model,
        ids,
        labels,
        CFG,
        PAD,
        64,
        eval_data=(eval_ids, eval_labels),
        check_memory=False,
        checkpoint_dir=checkpoint_dir,
        objective=DPO,
        reference=tuple(reference),
    )


@pytest.fixture(scope="module")
def uninterrupted():
    return run()


def losses(result):
    return [r["loss"] for r in result.log if "loss" in r]


def test_a_resumed_dpo_run_ends_where_an_uninterrupted_one_does(uninterrupted, tmp_path, monkeypatch):
    first = losses(uninterrupted)
    assert len(first) == 6 and first[0] == pytest.approx(math.log(2), abs=1e-6) and first[-1] < first[0]
    real_step = steps.make_train_step
    monkeypatch.setattr(steps, "make_train_step", stops_after(3))
    with pytest.raises(Killed):
        run(checkpoint_dir=tmp_path)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000002"]
    monkeypatch.setattr(steps, "make_train_step", real_step)
    resumed = run(checkpoint_dir=tmp_path)
    assert resumed.summary.resumed_from == 2 and losses(resumed) == first
    for name, value in uninterrupted.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)


def test_the_nan_guard_stops_a_dpo_run_naming_the_step_and_the_kept_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "make_train_step", nan_loss_at(5))
    with pytest.raises(NonFiniteLoss, match=r"train step 5: loss nan.*step-00000004 \(kept\)"):
        run(checkpoint_dir=tmp_path)


def test_dpo_on_a_mesh_of_four_devices_trains_as_on_one():
    """A process of its own: JAX fixes its device count when it starts."""
    from tests.fake_devices import run_with_devices

    runs = run_with_devices("tests.preference.pair_mesh_runs", 4)
    assert runs["one"][0] == pytest.approx(math.log(2), abs=1e-6) and runs["one"][-1] < runs["one"][0]
    # As tests/mesh: the log's 6-decimal rounding, and float32 sums in another order.
    np.testing.assert_allclose(runs["mesh"], runs["one"], rtol=1e-6, atol=1e-6)
