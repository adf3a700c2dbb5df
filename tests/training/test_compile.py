"""Compilation: one train-step program per distinct batch shape, one eval and one decode program
whatever the rows' lengths, a learning rate that never recompiles, and a persistent cache that a
later process (here: a cleared in-memory cache) reads."""

from __future__ import annotations

import logging

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
from jaxtune.runtime.train.feed import make_feed
from tests.conftest import PAD, VOCAB, tiny_model

pytestmark = pytest.mark.training

LENGTHS = [9, 14, 22, 30, 41, 47, 60, 12, 18, 35, 50, 25] * 2  # one to four 16-token buckets per batch of 4


@pytest.fixture(autouse=True)
def fresh_programs():
    """Each test counts what its own steps compile: no program kept from a test before it (see `programs`)."""
    programs.clear()


def lora_model():
    module = rt_model.attach_lora(tiny_model("llama"), LoraConfig(r=4, alpha=8))
    return rt_model.to_jax(module, make_placement(MeshConfig()))


def rows():
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, VOCAB, n).tolist() for n in LENGTHS]
    return ids, [list(r) for r in ids]


def train_step_compiles(caplog, packing: bool, cfg: TrainConfig, check_memory: bool = False) -> int:
    ids, labels = rows()
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax._src.interpreters.pxla"):
        training.train(lora_model(), ids, labels, cfg, PAD, 64, check_memory=check_memory, packing=packing)
    return sum("Compiling jit(train_step)" in r.getMessage() for r in caplog.records)


def test_the_memory_plan_compiles_the_very_step_that_trains(caplog, monkeypatch):
    """The plan lowers the jitted step training then calls: the model is traced and compiled once, not twice."""
    traced = []
    step_fn = steps._train_step_fn

    def counted(*args, **kwargs):
        step = step_fn(*args, **kwargs)

        def train_step(*inputs):
            traced.append(1)
            return step(*inputs)

        return train_step

    monkeypatch.setattr(steps, "_train_step_fn", counted)
    cfg = TrainConfig(max_steps=3, batch_size=4, warmup_steps=1, log_every=3)
    assert train_step_compiles(caplog, packing=True, cfg=cfg, check_memory=True) == 1
    assert len(traced) == 1


def test_a_packed_run_compiles_its_step_once_a_padded_one_once_per_length_bucket(caplog):
    cfg = TrainConfig(max_steps=6, batch_size=4, warmup_steps=2, log_every=3)
    assert train_step_compiles(caplog, packing=True, cfg=cfg) == 1
    feed = make_feed(LENGTHS, cfg, 64, 1, packed=False)
    batches = feed.micro_batches(*rows(), PAD)
    buckets = {next(batches)["input_ids"].shape for _ in range(cfg.max_steps)}
    assert len(buckets) > 1
    assert train_step_compiles(caplog, packing=False, cfg=cfg) == len(buckets)


def compiled(caplog, name: str, run) -> int:
    """How many programs named `name` `run()` compiles (torchax names a jitted torch function call_torch)."""
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax._src.interpreters.pxla"):
        run()
    return sum(f"Compiling jit({name})" in r.getMessage() for r in caplog.records)


def test_eval_and_greedy_decoding_compile_one_program_over_rows_of_every_length(caplog):
    from jaxtune.runtime.compiled.batches import bucket_length
    from jaxtune.runtime.decoding import inference

    model = lora_model()
    ids, labels = rows()
    assert len({bucket_length(n) for n in LENGTHS}) == 4  # sorted batches of 4 rows span all four
    assert (
        compiled(
            caplog,
            "call_torch",
            lambda: inference.evaluate(model, ids, labels, [""] * len(ids), 4, PAD, progress=False),
        )
        == 1
    )
    prompts = [row[:n] for row, n in zip(ids, (3, 5, 20, 40))]  # two batches, 16 and 48 tokens long alone
    assert compiled(caplog, "generate", lambda: inference.greedy_generate(model, prompts, 2, 4, (), PAD)) == 1


def test_on_a_tpu_eval_batches_pad_to_splash_tiles_and_lose_nothing(monkeypatch):
    """Where the kernel takes only 128-token tiles (splash), eval pads every batch to them: the same
    losses, one program of length 128 (here the CPU's XLA attention computes it)."""
    from jaxtune.runtime.decoding import inference
    from jaxtune.runtime.modeling import attention

    model = lora_model()
    ids, labels = rows()
    plain = inference.row_nll(model, ids, labels, 4, PAD, progress=False)
    lengths = []
    step = steps.make_eval_step(model)

    def recording(weights, buffers, batch, batch_labels):
        lengths.append(batch_labels.shape[-1])
        return step(weights, buffers, batch, batch_labels)

    monkeypatch.setattr(attention, "length_multiple", lambda module, mesh: 128)
    tiled = inference.row_nll(model, ids, labels, 4, PAD, eval_step=recording, progress=False)
    assert max(LENGTHS) < 128 and set(lengths) == {128}
    np.testing.assert_allclose(tiled[0], plain[0], rtol=1e-5)
    np.testing.assert_array_equal(tiled[1], plain[1])


def test_the_learning_rate_is_an_input_of_the_step_not_a_constant():
    """Two runs differing only in rate and schedule lower to the very same program, so the second
    finds the first's in the persistent cache; one jitted step serves every rate."""
    model = lora_model()
    batch = {name: np.zeros((1, 2, 16), np.int32) for name in steps.BATCH_KEYS}
    labels = np.zeros((1, 2, 16), np.int32)

    def lowered(cfg: TrainConfig) -> str:
        optimizer = steps.make_optimizer(cfg)
        step = steps.make_train_step(model, optimizer)
        with model.env:
            return step.program.lower(
                model,
                model.weights,
                model.buffers,
                optimizer.init(model.weights),
                batch,
                labels,
                steps.step_key(0, 1),
                np.float32(cfg.learning_rate),
            ).as_text()

    first = lowered(TrainConfig(learning_rate=1e-4, warmup_steps=10, lr_schedule="warmup_cosine"))
    assert first == lowered(TrainConfig(learning_rate=3e-3, warmup_steps=0, lr_schedule="linear"))
    # the very same optimizer, so the very same program in this process too
    assert steps.make_optimizer(TrainConfig(learning_rate=1e-4)) is steps.make_optimizer(
        TrainConfig(learning_rate=3e-3)
    )

    optimizer = steps.make_optimizer(TrainConfig())
    step = steps.make_train_step(model, optimizer)
    weights, state = {k: v.copy() for k, v in model.weights.items()}, steps.init_optimizer(model, optimizer)
    for i, lr in enumerate((0.0, 1e-3, 2e-3), start=1):
        _, weights, state = step(weights, model.buffers, state, batch, labels, steps.step_key(0, i), lr)
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(lr)
    assert len(step.program.compiled) == 1


@pytest.fixture
def restored_cache_settings():
    """The process's cache folder and threshold put back after the test (the suite's own)."""
    previous = jax.config.jax_compilation_cache_dir
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    kept = executables.folder()
    yield
    executables.enable(kept.parent) if kept else executables.disable()
    jax.config.update("jax_compilation_cache_dir", previous)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    jax.experimental.compilation_cache.compilation_cache.reset_cache()


@pytest.mark.usefixtures("restored_cache_settings")
def test_the_persistent_cache_serves_a_step_compiled_before(tmp_path):
    hits = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event))
    compile_cache.enable(tmp_path / "xla-cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # a toy model compiles fast
    model = lora_model()
    optimizer = steps.make_optimizer(TrainConfig())
    batch = {name: np.ones((1, 2, 32), np.int32) for name in steps.BATCH_KEYS}
    labels = np.ones((1, 2, 32), np.int32)

    def run():
        weights = {k: v.copy() for k, v in model.weights.items()}
        step = steps.make_train_step(model, optimizer)
        return float(
            step(weights, model.buffers, optimizer.init(weights), batch, labels, steps.step_key(0, 1), 1e-3)[0]
        )

    first = run()
    assert any((tmp_path / "xla-cache").iterdir()), "the compiled step was written to the cache"
    jax.clear_caches()  # what a new process starts with, asking JAX's cache alone (not the kept executables)
    programs.clear()
    executables.disable()
    hits.clear()
    assert run() == first
    assert "/jax/compilation_cache/cache_hits" in hits


@pytest.mark.usefixtures("restored_cache_settings")
def test_the_threshold_for_caching_a_program_is_jaxs_own_setting_when_set(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.MIN_COMPILE_SECONDS_VARIABLE, raising=False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 7.0)
    compile_cache.enable(tmp_path / "a")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_SECONDS
    monkeypatch.setenv(compile_cache.MIN_COMPILE_SECONDS_VARIABLE, "3")  # JAX read it when it started
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 3.0)
    compile_cache.enable(tmp_path / "b")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 3.0


def test_one_folder_can_hold_the_compile_cache_of_every_store(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.SHARED_FOLDER_VARIABLE, raising=False)
    assert compile_cache.folder_of(tmp_path / "store") == tmp_path / "store" / "xla-cache"
    monkeypatch.setenv(compile_cache.SHARED_FOLDER_VARIABLE, str(tmp_path / "shared"))
    assert compile_cache.folder_of(tmp_path / "a") == compile_cache.folder_of(tmp_path / "b") == tmp_path / "shared"


@pytest.mark.usefixtures("restored_cache_settings")
def test_a_step_the_compiler_refused_is_refused_again_without_compiling(tmp_path, monkeypatch):
    """XLA:TPU refuses, at compile time, a step past the chip's memory; JAX caches only what compiled. The
    refusal is remembered beside the cache, so `train.remat: auto`'s next run skips that candidate."""
    compile_cache.enable(tmp_path / "xla-cache")
    model, optimizer = lora_model(), steps.make_optimizer(TrainConfig())
    words = (
        "Ran out of memory on HBM, the total memory required for "
        "HLO temporaries (17.10G) exceeds available HBM (15.75G)."
    )
    compiles = []

    def refuse(self):
        compiles.append(self)
        raise RuntimeError(f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. {words}")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    for attempt in range(2):
        with pytest.raises(RuntimeError) as refused:
            steps.train_step_memory(model, optimizer, 1, 2, 32)
        assert words in compile_cache.refusal(refused.value)
    assert len(compiles) == 1 and isinstance(refused.value, compile_cache.RefusedBefore)
    # Another program (another length) is compiled, and refused on its own account.
    with pytest.raises(RuntimeError):
        steps.train_step_memory(model, optimizer, 1, 2, 48)
    assert len(compiles) == 2
    monkeypatch.undo()  # the real compiler: a program it compiles is never held refused
    compile_cache.enable(tmp_path / "xla-cache")
    assert steps.train_step_memory(model, optimizer, 1, 2, 64)["peak_bytes"] > 0
