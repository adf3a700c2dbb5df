"""train.remat auto planned for a chip this machine lacks: `fit.choose` on XLA:TPU's compile-only
v5e devices takes the least recomputation whose plan, compiled by libtpu, fits the chip's memory."""

from __future__ import annotations

import dataclasses

import pytest

from jaxtune.runtime import fit, memory, steps, targets

pytestmark = pytest.mark.target

LENGTH = 256


@pytest.fixture(scope="module")
def planned(tiny_folder):
    """(config, model on one compile-only v5e, {policy: bytes its XLA:TPU plan needs}) at 4 x LENGTH."""
    from tests.targets.test_targets import _placed_model

    config, model = _placed_model(tiny_folder, ["train.batch_size=4", f"data.max_length={LENGTH}"], "v5e-1")
    optimizer = steps.make_optimizer(config.train)
    needs = {policy: fit._needed(memory.memory_plan(model, optimizer, config.train.model_copy(update={"remat": policy}),
                                                    LENGTH)) for policy in fit.POLICIES}
    print({policy: f"{n / 2**20:.2f} MiB" for policy, n in needs.items()})
    return config, model, needs


@pytest.mark.parametrize("fitting", fit.POLICIES)
def test_auto_on_a_compile_only_v5e_takes_the_first_policy_whose_plan_fits(planned, fitting):
    config, model, needs = planned
    assert needs["none"] > needs["layer"] and needs["matmuls"] >= needs["layer"]
    limit = int(needs[fitting] / (1 - fit.HEADROOM)) + 1  # the chip's memory: `fitting`'s plan just fits
    expected = next(policy for policy in fit.POLICIES if needs[policy] <= needs[fitting])
    chosen = fit.choose(model, steps.make_optimizer(config.train), config.train, lambda run: (None, LENGTH, 0), limit=limit)
    assert (chosen.remat, chosen.split, chosen.chosen_by) == (expected, 1, "auto")
    assert [t["remat"] for t in chosen.tried] == list(fit.POLICIES[: fit.POLICIES.index(expected) + 1])
    assert chosen.plan["platform"] == "tpu" and fit._needed(chosen.plan) == needs[expected]


def test_the_doctor_shows_what_auto_chose_for_the_target(planned, tiny_folder, capsys, monkeypatch):
    from jaxtune import cli

    _, _, needs = planned
    hbm = int(needs["layer"] / (1 - fit.HEADROOM)) + 1  # a v5e whose memory only layer remat fits
    monkeypatch.setitem(targets.CHIPS, "v5e", dataclasses.replace(targets.CHIPS["v5e"], hbm=hbm))
    code = cli.main(["doctor", str(tiny_folder), "--target", "v5e-1", "--set", "train.batch_size=4",
                     "--set", f"data.max_length={LENGTH}"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("train step runs as"))
    assert "train.remat auto: layer (auto)" in row and "1 x 4 rows per step" in row, row
    assert "did not fit: remat none" in row and "remat matmuls" in row, row
    train = next(line for line in out.splitlines() if line.startswith("train step memory, peak"))
    assert "(bfloat16, adamw, remat layer, 1 x 4 x 256)" in train and train.endswith("HBM  ok"), train
    assert code in (0, 1)  # 1 where the eval or decode step does not fit so small a memory: not this test's point
