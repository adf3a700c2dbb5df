"""Kept executables (`devices.executables`): a program compiled once is loaded by a later process
with no trace, lowering or compile; every input of its key gives a new key; a damaged or foreign
entry is refused, said so, and compiled again; a compile says what it compiles while it runs."""

from __future__ import annotations

import logging
import shutil

import jax
import jax.experimental.compilation_cache.compilation_cache
import numpy as np
import pytest

from jaxtune.config import LoraConfig, MeshConfig, TrainConfig
from jaxtune.runtime.compiled import programs, steps
from jaxtune.runtime.devices import compile_cache, executables
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.train import training
from tests.conftest import PAD, VOCAB, tiny_model

pytestmark = pytest.mark.training

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A fresh cache folder for this test (JAX's cache and the kept executables), the suite's put back after."""
    monkeypatch.delenv(executables.OFF_VARIABLE, raising=False)
    previous = jax.config.jax_compilation_cache_dir
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    before = executables.folder()
    programs.clear()
    compile_cache.enable(tmp_path / "xla-cache")
    yield executables.folder()
    programs.clear()
    executables.enable(before.parent) if before else executables.disable()
    jax.config.update("jax_compilation_cache_dir", previous)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    jax.experimental.compilation_cache.compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def recorded():
    """Every trace, lowering and compile from now on, as (what, function name)."""
    found: list[tuple[str, str]] = []

    def listen(event, duration, **kwargs):
        if event in EVENTS:
            found.append((EVENTS[event], str(kwargs.get("fun_name", ""))))

    jax.monitoring.register_event_duration_secs_listener(listen)
    return found


def of(recorded, name: str) -> list[str]:
    return [what for what, fun in recorded if name in fun]


def lora_model(layers: int = 2):
    module = rt_model.attach_lora(tiny_model("llama", layers=layers), LoraConfig(r=4, alpha=8))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def new_process() -> None:
    """What a new process starts with: no program traced or compiled in memory (the disk kept)."""
    programs.clear()
    jax.clear_caches()


def forget_jax_cache(kept) -> None:
    """Empty JAX's own cache beside the kept executables: XLA:CPU's executables loaded from it are not
    kept (`executables.save`), and these tests compile again to keep."""
    for path in kept.parent.iterdir():
        if path != kept:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    jax.experimental.compilation_cache.compilation_cache.reset_cache()


def rows():
    """Rows of one length: a packed batch's shape depends on how the seed's order packs rows of
    varied lengths, and this test changes the seed."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, VOCAB, 60).tolist() for _ in range(16)]
    return ids, [list(r) for r in ids]


def run(cfg: TrainConfig) -> list[float]:
    result = training.train(lora_model(), *rows(), cfg, PAD, 64)
    return [r["loss"] for r in result.log if "loss" in r]


def test_a_run_changing_only_rate_seed_and_steps_loads_its_step_untraced(kept, recorded, caplog):
    """The plan and the step of a run are kept; a second process changing the learning rate, seed and
    step count recalls the plan and loads the step: no trace, lowering or compile of it at all."""
    first = TrainConfig(max_steps=2, batch_size=4, learning_rate=1e-3, warmup_steps=0, seed=0, log_every=1)
    losses = run(first)
    assert of(recorded, "train_step") == ["trace", "lower", "compile"]
    assert len([p for p in kept.iterdir() if p.is_dir()]) == 1, "one executable kept: the step"
    new_process()
    recorded.clear()
    with caplog.at_level(logging.INFO, logger="jaxtune.compile"):
        again = run(first.model_copy(update={"learning_rate": 5e-4, "seed": 3, "max_steps": 3}))
    assert of(recorded, "train_step") == []
    assert any("loaded the kept train_step" in r.getMessage() for r in caplog.records)
    assert any("recalled with no compile" in r.getMessage() for r in caplog.records)
    assert len(again) == 3 and all(np.isfinite(again))
    new_process()
    recorded.clear()
    assert run(first) == pytest.approx(losses, rel=1e-6)  # the loaded step computes what the compiled one did
    assert of(recorded, "train_step") == []


def test_every_input_of_a_key_gives_a_new_key():
    """Each thing a compiled program depends on changes its key: the model, the settings it closes over,
    the arguments' shapes, the code, the libraries, the backend's flags and the process's place."""
    model = lora_model()
    optimizer = steps.make_optimizer(TrainConfig())
    step = steps.shared_train_step(model, optimizer)
    batch = lambda n: (model.weights, {"ids": jax.ShapeDtypeStruct((1, 2, n), np.int32)})  # noqa: E731
    base = (step.kind, step.structure, step.settings, executables.signature(batch(16)))
    first = executables.key(*base)
    assert executables.key(*base) == first

    changed = {
        "the model's layers": (
            step.kind,
            steps.shared_train_step(lora_model(layers=3), optimizer).structure,
            *base[2:],
        ),
        "the remat policy": (
            *base[:2],
            steps.shared_train_step(model, optimizer, steps.StepSpec("layer")).settings,
            base[3],
        ),
        "the loss chunk": (
            *base[:2],
            steps.shared_train_step(model, optimizer, steps.StepSpec(chunk_tokens=64)).settings,
            base[3],
        ),
        "the optimizer's rule": (
            *base[:2],
            steps.shared_train_step(model, steps.make_optimizer(TrainConfig(optimizer="sgd"))).settings,
            base[3],
        ),
        "the weight decay": (
            *base[:2],
            steps.shared_train_step(model, steps.make_optimizer(TrainConfig(weight_decay=0.5))).settings,
            base[3],
        ),
        "the batch's length": (*base[:3], executables.signature(batch(32))),
        "the program's kind": ("eval_step", *base[1:]),
    }
    for what, parts in changed.items():
        assert executables.key(*parts) != first, what
    # the learning rate is an argument: the same optimizer, the same key
    assert steps.shared_train_step(model, steps.make_optimizer(TrainConfig(learning_rate=0.5))).settings == base[2]

    versions = executables.library_versions()
    outside = {
        "jaxtune's code": lambda patch: patch.setattr(executables, "code_digest", lambda: "edited"),
        "a library's version": lambda patch: patch.setattr(
            executables, "library_versions", lambda: {**versions, "transformers": "9.9"}
        ),
        "XLA's flags": lambda patch: patch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/elsewhere"),
        "libtpu's flags": lambda patch: patch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler"),
        "the process's place": lambda patch: patch.setattr(jax, "process_count", lambda: 2),
    }
    for what, change in outside.items():
        with pytest.MonkeyPatch.context() as patch:
            change(patch)
            assert executables.key(*base) != first, what
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        assert executables.key(*base) != first, "the matmul precision"
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert executables.key(*base) == first


def step_loss(model, length: int = 16) -> float:
    optimizer = steps.make_optimizer(TrainConfig())
    step = steps.make_train_step(model, optimizer)
    ids = np.arange(2 * length, dtype=np.int32).reshape(1, 2, length) % VOCAB
    batch = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "segment_ids": np.ones_like(ids),
        "position_ids": np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy(),
        "labels": ids,
    }
    batch = model.placement.shard_micro_batches(batch)
    labels = batch.pop("labels")
    weights = {k: v.copy() for k, v in model.weights.items()}
    return float(
        step(weights, model.buffers, steps.init_optimizer(model, optimizer), batch, labels, steps.step_key(0, 1), 1e-3)[
            0
        ]
    )


@pytest.mark.parametrize("damage", ["bytes", "foreign", "unloadable"])
def test_a_damaged_or_foreign_entry_is_refused_named_and_compiled_again(kept, recorded, caplog, damage):
    model = lora_model()
    loss = step_loss(model)
    (entry,) = [p for p in kept.iterdir() if p.is_dir()]
    if damage == "bytes":
        data = bytearray((entry / executables.EXECUTABLE).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (entry / executables.EXECUTABLE).write_bytes(bytes(data))
        why = "does not match the sha256"
    elif damage == "foreign":  # another program's entry under this one's name
        new_process()
        step_loss(model, length=32)
        (other,) = [p for p in kept.iterdir() if p.is_dir() and p != entry]
        shutil.rmtree(entry)
        other.rename(entry)
        why = "names another key"
    else:  # bytes whose digest matches but that no backend loads
        (entry / executables.EXECUTABLE).write_bytes(b"not an executable")
        record = (entry / executables.ENTRY).read_text()
        import hashlib
        import json

        (entry / executables.ENTRY).write_text(
            json.dumps({**json.loads(record), "sha256": hashlib.sha256(b"not an executable").hexdigest()})
        )
        why = "UnpicklingError"
    new_process()
    forget_jax_cache(kept)
    recorded.clear()
    with caplog.at_level(logging.INFO, logger="jaxtune.compile"):
        assert step_loss(model) == pytest.approx(loss, rel=1e-6)
    refusals = [
        r for r in caplog.records if r.levelno == logging.WARNING and "refused the kept executable" in r.getMessage()
    ]
    assert len(refusals) == 1 and str(entry) in refusals[0].getMessage() and why in refusals[0].getMessage()
    assert of(recorded, "train_step") == ["trace", "lower", "compile"]
    new_process()
    recorded.clear()
    assert step_loss(model) == pytest.approx(loss, rel=1e-6)  # kept again, whole this time
    assert of(recorded, "train_step") == []


def test_a_compile_says_what_it_compiles_while_it_runs(caplog):
    with caplog.at_level(logging.INFO, logger="jaxtune.compile"):
        with executables.watching("train_step (int32[1,8,512]; none)", every=0.05):
            import time

            time.sleep(0.22)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "compiling train_step (int32[1,8,512]; none)"
    assert sum(line.startswith("still compiling train_step (int32[1,8,512]; none): ") for line in lines) >= 2
    assert lines[-1].startswith("compiled train_step (int32[1,8,512]; none) in 0.2")
