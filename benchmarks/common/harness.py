"""The harness every comparison of `make bench` shares: the settings (`Context`), progress and
result lines (`log`, `say`), the result entries (`entry`, `skipped`, `show`, `fmt`), timing
(`median_time`, `rounds`, `fastest`, PyTorch's thread counts), and the machine record."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CONSOLE = Console(stderr=True, highlight=False)  # progress: stderr
BENCH = "benchmarks.cpu.bench"  # the entry point: child processes run it (python -m, from ROOT) with --child


def log(message: str) -> None:
    CONSOLE.log(message)


def say(line: str = "") -> None:
    """A result line: stdout."""
    print(line, flush=True)


# --------------------------------------------------------------------------------------------
# Context: the settings, and the measurements comparisons share (memo)
# --------------------------------------------------------------------------------------------


@dataclass
class Context:
    quick: bool
    model: str  # "smollm2" or "demo": which model the SmolLM2 comparisons use
    store: str
    reps: int = 3
    train_rows: int = 32
    same_shape_steps: int = 5
    recipe_steps: int = 3
    decode_tokens: int = 64
    recipe_tokens: int = 8
    rerun_steps: int = 50
    rerun_reps: int = 3
    compile_reps: int = 3
    memo: dict = field(default_factory=dict)

    @classmethod
    def make(cls, quick: bool, model: str, store: str) -> "Context":
        if quick:
            return cls(
                quick=True,
                model=model,
                store=store,
                reps=3,
                train_rows=16,
                same_shape_steps=3,
                recipe_steps=3,
                decode_tokens=16,
                recipe_tokens=4,
                rerun_steps=10,
                rerun_reps=1,
                compile_reps=1,
            )
        return cls(quick=False, model=model, store=store)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def median_time(run: Callable[[], Any], reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """(median seconds, all timings) of `run()` after `warmup` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def matmul_run(n: int, dtype=None) -> Callable[[], None]:
    """One (n, n) @ (n, n) jnp.dot (float32 unless `dtype`), compiled and warmed up: the measured peak of the MFU."""
    import jax
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return lambda: jax.block_until_ready(dot(a, b))


def rounds(runs: dict[str, Callable[[], Any]], reps: int, what: str) -> dict[str, list[float]]:
    """`reps` rounds, each timing every one of `runs` once, in turn: on a shared machine all sides
    then see the same load over time. {name: seconds of each round}."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
            log(f"{what} round {r + 1}/{reps}: {name} {times[name][-1]:.2f} s (load {os.getloadavg()[0]:.1f})")
    return times


def fastest(times: dict[str, list[float]]) -> tuple[str, float]:
    """(name, median seconds) of the run with the lowest median."""
    name = min(times, key=lambda k: statistics.median(times[k]))
    return name, statistics.median(times[name])


def torch_thread_counts() -> list[int]:
    """PyTorch's default thread count and one. On a loaded machine each OpenMP region waits for its
    slowest thread and one thread can be much faster: the baseline is whichever is faster."""
    import torch

    return list(dict.fromkeys((torch.get_num_threads(), 1)))


@contextlib.contextmanager
def torch_threads(count: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Result entries
# --------------------------------------------------------------------------------------------


def entry(ratio, ours, theirs, unit: str, ours_label: str, theirs_label: str, better: str, **details) -> dict:
    """One ratio with the two absolute figures it divides."""
    return {
        "ratio": None if ratio is None else float(ratio),
        "jaxtune": ours,
        "baseline": theirs,
        "unit": unit,
        "jaxtune_is": ours_label,
        "baseline_is": theirs_label,
        "better": better,
        **details,
    }


def skipped(reason: str, **details) -> dict:
    log(f"[yellow]skipped: {reason}")
    return {"ratio": None, "skipped": reason, **details}


def show(name: str, e: dict) -> None:
    """The two absolute figures and the ratio of one comparison, on stdout."""
    if e.get("ratio") is None:
        say(f"{name}: skipped ({e.get('skipped', 'no result')})")
        return
    if e.get("jaxtune") is None:
        say(f"{name}: {e['ratio']:.4g}")
        return
    say(
        f"{name}: jaxtune {fmt(e['jaxtune'])} {e['unit']} ({e['jaxtune_is']}) vs {fmt(e['baseline'])} {e['unit']} "
        f"({e['baseline_is']}) -> ratio {e['ratio']:.3g} ({e['better']})"
    )


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.4g}" if abs(x) < 1e5 else f"{x:,.0f}"
    return str(x)


def free_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        import jax

        jax.clear_caches()


# --------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field_of(name):
        return next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith(name)), None)

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    max_mhz = re.search(r"CPU max MHz:\s*([\d.]+)", lscpu)
    flags = (field_of("flags") or "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    versions = {}
    for name in ("jax", "jaxlib", "torch", "torchax", "transformers", "peft", "optax", "numpy", "prefect"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    mhz = float(max_mhz.group(1)) if max_mhz else float(field_of("cpu MHz") or 0)
    return {
        "cpu_model": field_of("model name"),
        "cpu_family": field_of("cpu family"),
        "cpu_model_number": field_of("model"),
        "cores": os.cpu_count(),
        "cpu_mhz": mhz,
        "cpu_mhz_source": "lscpu max MHz" if max_mhz else "/proc/cpuinfo cpu MHz",
        "flags": [f for f in wanted if f in flags],
        "amx": any(f.startswith("amx") for f in flags),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def commit() -> str:
    """What JAXTUNE_COMMIT says, where it is set (the copy a TPU machine runs, named by whoever copied
    it: that copy may sit in a stale checkout of its own, whose HEAD is not what runs); else the commit
    this checkout is at, '+ changes' when its tracked files differ from it; else that it is not known."""
    if named := os.environ.get("JAXTUNE_COMMIT"):
        return named
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "not known (no git checkout, JAXTUNE_COMMIT unset)"
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head.stdout.strip() + (" + changes" if changed.stdout.strip() else "")


def command() -> str:
    """The command this process runs, as typed from the repository's root: `python -m benchmarks.x ...`."""
    program = Path(sys.argv[0]).resolve()
    if program.suffix == ".py" and program.is_relative_to(ROOT):
        module = ".".join(program.relative_to(ROOT).with_suffix("").parts)
        words = ["python", "-m", module.removesuffix(".__main__")]
    else:
        words = [Path(sys.argv[0]).name]
    return shlex.join([*words, *sys.argv[1:]])


def provenance(machine: bool = True) -> dict:
    """Where a result comes from: its commit, its exact command and (unless the result keeps `machine_info`
    beside it) its machine, which the docs name beside every figure they quote (docs/hooks/figures.py)."""
    return {"commit": commit(), "command": command(), **({"machine": machine_info()} if machine else {})}
