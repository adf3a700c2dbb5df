"""`make bench`: jaxtune against PyTorch eager and against the published torchax recipe, side by side.

    python -m benchmarks.cpu.bench                 # everything; writes benchmarks/results/latest.{json,md}
    python -m benchmarks.cpu.bench --quick         # fewer rows and repetitions (development)
    python -m benchmarks.cpu.bench --only decode_vs_torch --only mfu
    python -m benchmarks.cpu.bench --model demo    # the SmolLM2 comparisons on the demo model (development)

Each comparison is one function `bench_<name>(ctx) -> {ratio key: entry}`; an entry holds the
two absolute figures, their ratio and what was measured. Both sides of a comparison run in this
process, on the same model, rows and shapes, as the median of >= 3 repetitions after warm-up;
the compile-cache comparison alone runs in fresh child processes (`--child compile`), and the
re-run comparison runs the flow in a child process with its own PREFECT_HOME (`--child rerun`).
Against PyTorch, both sides are built and warmed up (PyTorch first), then timed in alternating
rounds (PyTorch on its default thread count, PyTorch on one thread, jaxtune), so that on a shared
machine every side sees the same load; PyTorch's figure is its faster thread count. Progress goes
to stderr, the figures and the table to stdout.

The jaxtune train step's calling convention lives in ONE place: see `STEP_TAKES_LR` and
`call_train_step` in benchmarks/common/train_step.py.

This file holds the list of comparisons, the table and the command line; the comparisons live in
its neighbours in benchmarks/cpu/: compare_train.py, compare_memory.py, compare_decode.py, compare_rerun.py,
compare_compile.py and compare_quant.py, on the shared models and rows (models.py) and training sides
(training.py), and on what the accelerator benchmark shares with them in benchmarks/common/: the harness
(harness.py), the train-step adapter (train_step.py) and PyTorch's greedy decoding (generate.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from benchmarks.common.harness import RESULTS, Context, fmt, log, machine_info, provenance, say, show, skipped  # noqa: E402
from benchmarks.common.train_step import api_state  # noqa: E402
from benchmarks.cpu.compare_compile import bench_warm_vs_cold_compile, child_compile  # noqa: E402
from benchmarks.cpu.compare_decode import bench_decode_vs_recipe, bench_decode_vs_torch  # noqa: E402
from benchmarks.cpu.compare_memory import bench_activation_memory_vs_eager  # noqa: E402
from benchmarks.cpu.compare_quant import bench_quantized_base  # noqa: E402
from benchmarks.cpu.compare_rerun import bench_rerun_vs_first, child_rerun  # noqa: E402
from benchmarks.cpu.compare_train import (  # noqa: E402
    bench_mfu,
    bench_train_vs_recipe,
    bench_train_vs_torch_fp32,
    bench_train_vs_torch_fp32_same_shape,
)
from benchmarks.cpu.models import SKIP_SMOLLM2, model_label, smollm2_gguf  # noqa: E402

COMPARISONS: dict[str, Callable[[Context], dict]] = {
    "train_vs_torch_fp32": bench_train_vs_torch_fp32,
    "train_vs_torch_fp32_same_shape": bench_train_vs_torch_fp32_same_shape,
    "train_vs_recipe": bench_train_vs_recipe,
    "mfu": bench_mfu,  # reuses train_vs_torch_fp32's jaxtune measurement
    "activation_memory_vs_eager": bench_activation_memory_vs_eager,
    "decode_vs_torch": bench_decode_vs_torch,
    "decode_vs_recipe": bench_decode_vs_recipe,
    "rerun_vs_first": bench_rerun_vs_first,
    "warm_vs_cold_compile": bench_warm_vs_cold_compile,
    "quantized_base": bench_quantized_base,
}
RATIO_KEYS = [
    "train_vs_torch_fp32",
    "train_vs_torch_fp32_same_shape",
    "train_vs_recipe",
    "nonpad_fraction",
    "activation_memory_vs_eager",
    "decode_vs_torch_b1",
    "decode_vs_torch_b8",
    "decode_vs_torch",
    "decode_vs_recipe",
    "rerun_vs_first",
    "warm_vs_cold_compile",
    "mfu",
    "mfu_vs_measured_peak",
    "quantized_base_int8",
    "quantized_base_int4",
]


def table(results: dict) -> str:
    lines = ["| comparison | jaxtune | baseline | unit | ratio | better | notes |", "|---|---|---|---|---|---|---|"]
    for key in RATIO_KEYS:
        e = results.get(key)
        if e is None or key == "decode_vs_torch" and e.get("alias_of"):
            if key == "decode_vs_torch" and e is not None:
                lines.append(f"| decode_vs_torch | = decode_vs_torch_b8 | | | {fmt(e.get('ratio'))} | | |")
            continue
        if e.get("ratio") is None:
            lines.append(f"| {key} | | | | skipped | | {str(e.get('skipped', ''))[:160]} |")
            continue
        note = []
        for name in ("model", "same_tokens", "packed_shape", "shape", "note"):
            if name in e:
                note.append(f"{name}: {e[name]}")
        lines.append(
            f"| {key} | {fmt(e['jaxtune'])} ({e['jaxtune_is']}) | {fmt(e['baseline'])} ({e['baseline_is']}) | "
            f"{e['unit']} | {e['ratio']:.3g} | {e['better']} | {'; '.join(note)[:300]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", action="append", choices=sorted(COMPARISONS), help="run this comparison only (repeatable)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rows, tokens and repetitions (development)")
    parser.add_argument(
        "--model",
        choices=("smollm2", "demo"),
        default="smollm2",
        help="model of the SmolLM2 comparisons; demo: the offline demo model (development)",
    )
    parser.add_argument("--store", default=".jaxtune/store", help="store the SmolLM2 GGUF is imported into (once)")
    parser.add_argument("--out", help="output stem (default benchmarks/results/latest for a full run, else .../dev)")
    parser.add_argument("--child", choices=("rerun", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rerun-steps", type=int, default=50, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "rerun":
        child_rerun(args.child_dir, args.rerun_steps)
        return 0
    if args.child == "compile":
        child_compile(args.child_dir)
        return 0

    ctx = Context.make(args.quick, args.model, args.store)
    names = args.only or list(COMPARISONS)
    full = not args.only and not args.quick and args.model == "smollm2"
    stem = Path(args.out) if args.out else RESULTS / ("latest" if full else "dev")
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    import jaxtune.runtime  # noqa: F401  (torchax under the torch 2.13 shim)

    if ctx.model == "smollm2" and smollm2_gguf() is None:
        say(f"SmolLM2 entries skipped: {SKIP_SMOLLM2}")
    results, timings, loads = {}, {}, {}
    for name in names:
        log(f"[bold]{name}")
        start = time.perf_counter()
        try:
            out = COMPARISONS[name](ctx)
        except Exception as e:  # one broken comparison must not lose the others
            import traceback

            traceback.print_exc()
            out = {name: skipped(f"error: {type(e).__name__}: {e}"[:500])}
        timings[name] = time.perf_counter() - start
        loads[name] = os.getloadavg()
        for key, e in out.items():
            results[key] = e
            show(key, e)
        log(f"{name}: {timings[name]:.0f} s, load average {loads[name][0]:.2f}")

    ratios = {key: results[key]["ratio"] if key in results else None for key in RATIO_KEYS if key in results}
    report = {
        "date": started.isoformat(timespec="seconds"),
        "seconds": round(sum(timings.values()), 1),
        "quick": ctx.quick,
        "model": model_label(ctx),
        "comparisons_run": names,
        "provenance": provenance(machine=False),
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": os.getloadavg(), "after_each": loads},
        "api": api_state(),
        "train_step_adapter": "benchmarks/common/train_step.py: STEP_TAKES_LR / call_train_step",
        "ratios": ratios,
        "skipped": {k: e["skipped"] for k, e in results.items() if e.get("skipped")},
        "mfu_derivation": results.get("mfu", {}).get("mfu_derivation"),
        "settings": {k: v for k, v in vars(ctx).items() if k != "memo"},
        "results": results,
        "seconds_per_comparison": timings,
    }
    md = "\n".join(
        [
            f"# jaxtune benchmarks ({report['date']})",
            "",
            f"{report['machine']['cpu_model']}, {report['machine']['cores']} "
            f"cores, flags {' '.join(report['machine']['flags'])}; "
            f"jax {report['machine']['versions'].get('jax')}, torch {report['machine']['versions'].get('torch')}, "
            f"transformers {report['machine']['versions'].get('transformers')}; "
            f"load average {load_before[0]:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after; {report['api']}{'; QUICK run' if ctx.quick else ''}",
            "",
            table(results),
            "",
        ]
    )
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(f"{stem}.md").write_text(md)
    say()
    say(md)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
