"""jaxtune's model in the accelerator benchmark, as jaxtune's side (jaxtune_side.py) and its GRPO step (grpo.py)
both open it: the recipe's config with the run's overrides, the model opened as the train stage opens it, and
where its compiling's seconds go."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

from benchmarks.accelerator.shared import RECIPES, Settings
from benchmarks.common.harness import log

TICK_SECONDS = 10.0  # a phase with no lines of its own says it is still running this often


def recipe(settings: Settings, method: str):
    """The published recipe's config (configs/gemma3-1b-dolly-*.yaml), computing in the run's dtype, with the
    run's `--set` overrides (for example model.scan_layers=true)."""
    from jaxtune.config import load_config

    return load_config(RECIPES[method], overrides=[f"model.dtype={settings.dtype}", *settings.overrides])


def open_benchmark_model(settings: Settings, folder: Path, method: str | None):
    """The model as the train stage opens it (`method` None: the base, as the generate stage does), on one device:
    the other side runs on one too."""
    import jax

    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import open_model

    cfg = recipe(settings, method or "lora")
    placement = make_placement(cfg.mesh, devices=jax.devices()[:1])
    lora = cfg.lora if method == "lora" else None
    return cfg, open_model(str(folder), None, cfg.model, placement, lora=lora, train_all=method == "full")


# Where choosing's seconds go, from JAX's own monitoring events, summed over the process: tracing to a
# jaxpr, lowering it to StableHLO, XLA's compile, reading the persistent compilation cache, and that
# cache's hits and misses.
COMPILING: dict[str, float] = {}
MONITORED = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds",
    "/jax/core/compile/backend_compile_duration": "compile_seconds",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_seconds",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}


def monitor_compiling() -> None:
    import jax

    def add(event: str, amount: float = 1.0, **_) -> None:
        if event in MONITORED:
            COMPILING[MONITORED[event]] = COMPILING.get(MONITORED[event], 0.0) + amount

    jax.monitoring.register_event_listener(add)
    jax.monitoring.register_event_duration_secs_listener(add)


class RuntimeLines(logging.Handler):
    """jaxtune's INFO lines (the `jaxtune` loggers': what it reads, quantizes, compiles, and for how long so
    far) shown as the benchmark's own progress, and the phases they report (`extra={"phase": ..., "seconds":
    ...}`: `read`, `quantized`) kept for the result lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.phases: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "phase"):
            self.phases[record.phase] = record.seconds
        log(f"[dim]{record.name}[/dim] {record.getMessage()}")

    def taken(self) -> dict[str, float]:
        """The phases reported since the last call."""
        phases, self.phases = self.phases, {}
        return phases


RUNTIME = RuntimeLines()


def show_runtime_lines() -> RuntimeLines:
    """Route jaxtune's INFO lines to the benchmark's output (by default Python shows none below WARNING)."""
    source = logging.getLogger("jaxtune")
    if RUNTIME not in source.handlers:
        source.addHandler(RUNTIME)
        source.setLevel(logging.INFO)
        source.propagate = False
    return RUNTIME


def load_phases(reported: dict[str, float], seconds: float) -> dict[str, float]:
    """The phases of opening the model, in order, each the seconds after the one before, from what the runtime
    reported and the whole's `seconds`: reading the checkpoint, quantizing what was left to quantize once it was read
    (a base quantized on the way is quantized while it is read), then the rest (LoRA attached, the tensors placed on
    the device). A base not streamed (a float base LoRA reads with from_pretrained) is one phase, `read_and_placed`."""
    phases, done = {}, 0.0
    for name, phase in (("read", "read"), ("quantized", "quantized_after_read")):
        if name in reported:
            phases[phase], done = max(reported[name] - done, 0.0), max(reported[name], done)
    return {**phases, ("placed" if phases else "read_and_placed"): max(seconds - done, 0.0)}


def describe_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in phases.items())


@contextlib.contextmanager
def ticking(what: str, every: float = TICK_SECONDS):
    """Say `what: N s so far` every `every` seconds while the block runs, and `what: done in N s` after it."""
    started, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log(f"{what}: {time.perf_counter() - started:.0f} s so far")

    thread = threading.Thread(target=tick, daemon=True, name="benchmark-progress")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
