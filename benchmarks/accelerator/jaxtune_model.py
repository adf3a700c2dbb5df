"""jaxtune's model in the accelerator benchmark, as jaxtune's side (jaxtune_side.py) and its GRPO step (grpo.py)
both open it: the recipe's config with the run's overrides, the model opened as the train stage opens it, and
where its compiling's seconds go."""

from __future__ import annotations

from pathlib import Path

from benchmarks.accelerator.shared import RECIPES, Settings


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
