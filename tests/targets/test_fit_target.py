"""train.remat auto planned for a chip this machine lacks: `fit.choose` on XLA:TPU's compile-only
v5e devices takes the first policy (least recomputation first) whose plan, compiled by libtpu,
fits the chip's memory, and splits the batch where none does.

XLA:TPU orders the policies' memory differently from XLA:CPU: left free (`none`), it schedules and
rematerialises on its own, and a forced policy can keep more. The rule holds whatever the order."""

from __future__ import annotations

import dataclasses

import pytest

from jaxtune.runtime.compiled import steps
from jaxtune.runtime.devices import targets
from jaxtune.runtime.measures import fit, memory

pytestmark = pytest.mark.target

LENGTH = 256
SETTINGS = ["train.batch_size=4", f"data.max_length={LENGTH}"]


@pytest.fixture(scope="module")
def planned(tiny_folder):
    """(config, model on one compile-only v5e, {(policy, rows): bytes its XLA:TPU plan needs}) at 4 x LENGTH
    for every policy, and layer at 2 rows a micro-batch (2 micro-batches)."""
    from jaxtune.checks.doctor import as_trained
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.config import config_from_dict
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import to_jax

    config = config_from_dict({}, SETTINGS)  # as `jaxtune doctor --set` reads them
    dtype = config.model.model_copy(update={"name": str(tiny_folder)}).compute_dtype
    module = as_trained(meta_model(str(tiny_folder), None, False, dtype), config, randomize_lora=False)
    model = to_jax(module, make_placement(config.mesh, targets.devices(targets.resolve("v5e-1"))), shapes_only=True)
    optimizer = steps.make_optimizer(config.train)
    needs = {}
    for policy, rows in [*((p, 4) for p in fit.POLICIES), ("layer", 2)]:
        run = config.train.model_copy(update={"remat": policy, "batch_size": rows, "grad_accumulation": 4 // rows})
        needs[(policy, rows)] = memory.memory_plan(model, optimizer, run, LENGTH).needed
    print({f"{p} x{r}": f"{n / 2**20:.2f} MiB" for (p, r), n in needs.items()})
    return config, model, needs


def fitting_exactly(need: int) -> int:
    """A chip's memory whose budget (less `fit.HEADROOM`) holds `need` bytes and not a byte more."""
    return int(need / (1 - fit.HEADROOM)) + 1


@pytest.mark.parametrize("fitting", fit.POLICIES)
def test_auto_on_a_compile_only_v5e_takes_the_first_policy_whose_plan_fits(planned, fitting):
    config, model, needs = planned
    assert len({needs[(p, 4)] for p in fit.POLICIES}) == 3, "the policies plan alike: the test shows nothing"
    expected = next(p for p in fit.POLICIES if needs[(p, 4)] <= needs[(fitting, 4)])
    chosen = fit.choose(
        model,
        steps.make_optimizer(config.train),
        config.train,
        lambda run: (None, LENGTH, 0),
        limit=fitting_exactly(needs[(fitting, 4)]),
    )
    assert (chosen.remat, chosen.split, chosen.chosen_by) == (expected, 1, "auto")
    assert [t.remat for t in chosen.tried] == list(fit.POLICIES[: fit.POLICIES.index(expected) + 1])
    assert chosen.plan.platform == "tpu" and chosen.plan.needed == needs[(expected, 4)]


def test_where_no_policy_fits_the_doctor_shows_the_split_auto_chose(planned, tiny_folder, monkeypatch):
    from jaxtune.checks.doctor import render
    from jaxtune.checks.target_plan import plan_for_target

    config, _, needs = planned
    smallest = min(needs[(p, 4)] for p in fit.POLICIES)
    assert needs[("layer", 2)] < smallest  # half the rows: half the activations
    monkeypatch.setitem(
        targets.CHIPS, "v5e", dataclasses.replace(targets.CHIPS["v5e"], hbm=fitting_exactly(needs[("layer", 2)]))
    )
    diagnosis = plan_for_target(str(tiny_folder), config, "v5e-1", train_only=True)  # the doctor's train rows
    out = render(diagnosis)
    row = next(line for line in out.splitlines() if line.startswith("train step runs as"))
    # none, tried whole first, did not fit; its plan said two micro-batches of 2 rows would, with no recomputation
    assert "train.remat auto: none (auto)" in row and "2 x 2 rows per step, batch_size 4 split into 2" in row, row
    assert "did not fit: remat none chunk" in row, row
    train = next(line for line in out.splitlines() if line.startswith("train step memory, peak"))
    assert "(bfloat16, adamw, remat none, 2 x 2 x 256)" in train and train.endswith("HBM  ok"), train
    assert diagnosis.ok


@pytest.mark.parametrize("scan", [False, True])
def test_the_plan_is_of_the_program_the_run_compiles_with_or_without_scanned_layers(tiny_folder, monkeypatch, scan):
    """model.scan_layers reaches the model the doctor plans (as `open_model` sets it on the model a run trains):
    a scanned step is another program, with other memory."""
    from jaxtune.checks.target_plan import plan_for_target
    from jaxtune.config import config_from_dict

    class Planned(Exception):
        pass

    def choose(model, *args, **kwargs):
        raise Planned(model.scan_layers)

    monkeypatch.setattr(fit, "choose", choose)
    config = config_from_dict({}, [*SETTINGS, f"model.scan_layers={str(scan).lower()}"])
    with pytest.raises(Planned) as planned:
        plan_for_target(str(tiny_folder), config, "v5e-1", train_only=True)
    assert planned.value.args == (scan,)
