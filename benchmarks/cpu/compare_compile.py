"""warm_vs_cold_compile: the demo train step's first call in fresh child processes (`bench.py --child compile`),
with an empty and with a filled persistent compilation cache."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.harness import BENCH, ROOT, Context, entry, log, skipped
from benchmarks.common.train_step import JaxtuneTrainer, api_state, micro_batch, step_takes_lr, with_segments
from benchmarks.cpu.models import demo_torch_model, dolly_rows, right_pad


def bench_warm_vs_cold_compile(ctx: Context) -> dict:
    """The demo train step's first call (trace + lower + compile + run) in a fresh process: empty vs filled persistent cache.

    Run as a user runs it (PYTHONHASHSEED unset), and again with PYTHONHASHSEED=0: the lowered step
    has been seen to differ between processes with Python's string hashing, so a warm process can
    miss the cache; a warm child that writes a new cache file missed."""
    key = "warm_vs_cold_compile"
    variants = {}
    for variant, extra in (("default", {}), ("PYTHONHASHSEED=0", {"PYTHONHASHSEED": "0"})):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update({"PYTHONPATH": str(ROOT), **extra})
        pairs = []
        for rep in range(ctx.compile_reps):
            with tempfile.TemporaryDirectory(prefix="jaxtune-bench-cache-") as cache:
                pair = {}
                for which in ("cold", "warm"):
                    log(f"warm_vs_cold_compile ({variant}): {which} child {rep + 1}/{ctx.compile_reps}")
                    child = subprocess.run(
                        [sys.executable, "-m", BENCH, "--child", "compile", "--child-dir", cache],
                        env=env,
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                    )
                    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
                    if child.returncode != 0 or not lines:
                        return {key: skipped(f"child failed (exit {child.returncode}): {child.stderr[-2000:]}")}
                    pair[which] = json.loads(lines[-1])
                pair["warm_hit"] = pair["warm"]["cache_files_after"] == pair["warm"]["cache_files_before"]
                pairs.append(pair)
        cold = statistics.median(p["cold"]["first_call_seconds"] for p in pairs)
        warm = statistics.median(p["warm"]["first_call_seconds"] for p in pairs)
        variants[variant] = {
            "cold_seconds": cold,
            "warm_seconds": warm,
            "ratio": warm / cold,
            "warm_hits": sum(p["warm_hit"] for p in pairs),
            "pairs": pairs,
        }
        log(
            f"warm_vs_cold_compile ({variant}): cold {cold:.2f} s, warm {warm:.2f} s, "
            f"{variants[variant]['warm_hits']}/{len(pairs)} warm children hit the cache"
        )
    # The `jaxtune` command runs under PYTHONHASHSEED=0 (jaxtune.cli.main.entry): that is the headline.
    fixed, main = variants["default"], variants["PYTHONHASHSEED=0"]
    first = main["pairs"][0]["cold"]
    return {
        key: entry(
            main["ratio"],
            main["warm_seconds"],
            main["cold_seconds"],
            "s to first result",
            "fresh process, filled cache",
            "fresh process, empty cache",
            "lower: warm cache faster",
            how=first["how"],
            shape=first["shape"],
            model="demo model (offline default shape and LoRA)",
            warm_hits=f"{main['warm_hits']}/{len(main['pairs'])}",
            variants=variants,
            ratio_with_random_hash_seed=fixed["ratio"],
            note=f"warm children that hit the cache: {main['warm_hits']}/{len(main['pairs'])} with "
            f"PYTHONHASHSEED=0 (as the jaxtune command runs), {fixed['warm_hits']}/{len(fixed['pairs'])} "
            f"with it unset (ratio {fixed['ratio']:.3g} there)",
        )
    }


def child_compile(cache_dir: str) -> None:
    """(child) Enable the persistent cache in `cache_dir`, build the demo step, time its first call."""
    import jax

    try:
        from jaxtune.runtime.devices import compile_cache

        compile_cache.enable(cache_dir)
        how = "jaxtune.runtime.devices.compile_cache.enable"
    except ImportError:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        how = "jax.config (jax_compilation_cache_dir, min compile time 0, min entry size -1)"
    from jaxtune.config import MeshConfig, load_config
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import attach_lora, to_jax

    cfg = load_config()
    model = to_jax(attach_lora(demo_torch_model(), cfg.lora), make_placement(MeshConfig()))
    trainer = JaxtuneTrainer(model, lr=cfg.train.learning_rate)
    b, t = cfg.train.batch_size, cfg.data.max_length
    ids, labels = dolly_rows(b, cfg.model.tiny.vocab_size, seed=3, median=t // 2, longest=t)
    feed = micro_batch(with_segments(right_pad(ids, labels, 0, t)))
    before = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file())
    jitted = getattr(trainer.step_fn, "jitted", None)
    phases = {}
    if jitted is not None and step_takes_lr(trainer.step_fn):
        # The same first call, ahead of time, to see its phases: trace + lower, compile (or cache load), run.
        import jax.numpy as jnp

        from jaxtune.runtime.compiled import steps

        batch, labels = feed
        placed = model.placement.shard_micro_batches({**batch, "labels": labels})
        placed_labels = placed.pop("labels")
        args = (
            trainer.weights,
            model.buffers,
            trainer.opt_state,
            placed,
            placed_labels,
            steps.step_key(0, 1),
            jnp.float32(trainer.lr),
        )
        with model.env:
            start = time.perf_counter()
            lowered = jitted.lower(*args)
            phases["trace_and_lower"] = time.perf_counter() - start
            compiled = lowered.compile()
            phases["compile_or_load"] = time.perf_counter() - start - phases["trace_and_lower"]
            jax.block_until_ready(compiled(*args))
        seconds = time.perf_counter() - start
        phases["run"] = seconds - phases["trace_and_lower"] - phases["compile_or_load"]
    else:
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(*feed))
        seconds = time.perf_counter() - start
    after = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file())
    print(
        json.dumps(
            {
                "first_call_seconds": seconds,
                "phases": phases,
                "cache_files_before": before,
                "cache_files_after": after,
                "how": how,
                "shape": [1, b, t],
                "api": api_state(trainer.step_fn),
            }
        )
    )
