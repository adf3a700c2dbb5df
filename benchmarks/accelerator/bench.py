"""`make bench-accelerator`: jaxtune's train step and decoder against PyTorch eager and torch.compile, on
whatever accelerator JAX and torch see, with the same weights and batches on each side.

    python -m benchmarks.accelerator.bench                        # Gemma 3 1B's shape:
                                                                  # results/accelerator-latest.{json,md}
    python -m benchmarks.accelerator.bench --model qwen2.5-0.5b   # another shape of benchmarks/configs
    python -m benchmarks.accelerator.bench --minutes 15 --parts jaxtune --parts torch-compile
    python -m benchmarks.accelerator.bench --tiny --out /tmp/acc  # every part on the CPU with a toy model
                                                                  # (make test runs it)
    python -m benchmarks.accelerator.bench --parts jaxtune --section lora --cases 8x512 --profile --out /tmp/acc
                                                                  # + /tmp/acc-profile/
    python -m benchmarks.accelerator.bench --parts jaxtune --section grpo --cases 8x8x256 --minutes 9   # a GRPO step
    TUNIX_SITE=/tmp/tunix-site python -m benchmarks.accelerator.bench   # with Tunix's side
                                                                  # (benchmarks/accelerator/tunix_wheels.sh install)

The driver builds the model's random weights once (one seed) from a config-only folder and saves
them; then each part runs in a child process of its own (`--child PART`), one after another, each
within its share of the run's time: a child past its limit is killed, and keeps every result line
it wrote. The report is computed from those lines (report.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.accelerator.shared import CONFIGS, DEFAULT_MODEL, Settings, build_weights
from benchmarks.common.harness import RESULTS, ROOT, log, say
from jaxtune.config import REMAT_SETTINGS

# Parts (child processes) in the order they run, each with the seconds it needs on one H200 for the
# Gemma 3 1B shape's first cases (from the run: jaxtune's first LoRA step 54 s at 8 x 512,
# torch.compile's 107 s, PyTorch eager's 6 s, plus each process's imports and loading; jaxtune's is the
# sum of its sections, jaxtune_side.SECTIONS). A part's limit is the time left shared in these
# proportions among the parts still to run: one that ends early leaves its time to the rest.
# Tunix's (not measured on an H200: its LoRA step compiles as one XLA program, as jaxtune's does) is taken
# as torch.compile's.
PARTS = {"jaxtune": 255, "torch-eager": 35, "torch-compile": 125, "tunix": 125}
MINIMUM_PART_SECONDS = 10  # the least a part is given; with less left, it is not started
DEVICE_MINUTES, TINY_MINUTES = 7.0, 10.0


def run_child(part: str, work: Path, until: float) -> None:
    """One part, in this process, which its parent kills at `until` (seconds since the epoch)."""
    import jaxtune  # noqa: F401  (first: where no accelerator is present, JAX stays on the CPU, quietly)

    settings, folder = Settings.load(work), work / "model"
    if part == "jaxtune":
        from benchmarks.accelerator import jaxtune_side

        jaxtune_side.run(settings, folder, work, until)
    elif part == "tunix":
        from benchmarks.accelerator import tunix_side

        tunix_side.run(settings, folder, work)
    else:
        from benchmarks.accelerator import torch_side

        torch_side.run_train(settings, folder, work, compiled=part == "torch-compile")


def default_parts() -> list[str]:
    """Every part, less Tunix's where its site folder holds no Tunix (it is not among jaxtune's dependencies)."""
    from benchmarks.accelerator.tunix_side import site

    return [p for p in PARTS if p != "tunix" or (site() / "tunix").is_dir()]


def run_part(part: str, work: Path, limit: float) -> dict:
    """Run `part` in a child process for at most `limit` seconds; its output goes to stderr as it comes."""
    limit = round(limit)
    start = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=15)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.accelerator.bench",
            "--child",
            part,
            "--work",
            str(work),
            "--until",
            f"{time.time() + limit:.1f}",
        ],
        # PYTHONHASHSEED=0 as the `jaxtune` command runs (jaxtune.cli.entry): transformers iterates a
        # set of strings while tracing Gemma 3 (its layer types), so under random string hashing a
        # second run's program can differ and miss the persistent compilation cache.
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )  # its own group: a kill takes its compile workers too

    def relay() -> None:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=10)
    seconds = time.perf_counter() - start
    if code == 0:
        status = "done"
    elif code is None:
        status = f"cut at its limit of {limit} s"
    else:
        status = f"failed (exit {code}): {next((t for t in reversed(tail) if t.strip()), '')[:300]}"
    return {
        "status": status,
        "seconds": round(seconds, 1),
        "limit_seconds": limit,
        **({"output_tail": list(tail)} if code != 0 else {}),
    }


def run_parts(parts: list[str], work: Path, deadline: float) -> dict:
    """Every part in turn, each limited to its share of the time left (`PARTS`)."""
    out = {}
    for i, part in enumerate(parts):
        left = deadline - time.perf_counter()
        if left < MINIMUM_PART_SECONDS:
            out[part] = {
                "status": f"not started: {left:.0f} s of the run's time left",
                "seconds": 0,
                "limit_seconds": 0,
            }
            continue
        limit = max(left * PARTS[part] / sum(PARTS[p] for p in parts[i:]), MINIMUM_PART_SECONDS)
        log(f"[bold]{part}[/bold]: up to {limit:.0f} s")
        out[part] = run_part(part, work, limit)
        log(f"{part}: {out[part]['status']} after {out[part]['seconds']:.0f} s")
    return out


def parse_case(text: str) -> tuple[int, ...]:
    """'8x512': a train case (rows, length); '8x8x256': a GRPO case (prompts, generations, new tokens)."""
    sizes = tuple(int(n) for n in text.split("x"))
    if len(sizes) not in (2, 3):
        raise argparse.ArgumentTypeError(f"a case is ROWSxLENGTH or PROMPTSxGENERATIONSxNEW_TOKENS, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=sorted(p.name for p in CONFIGS.iterdir()),
        help="the shape: a config-only folder of benchmarks/configs",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a toy model of the family, on the CPU, in float32 (make test)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="the shape's first N decoder layers, at its width (a deep model's cost per layer, on a smaller host)",
    )
    parser.add_argument(
        "--parts",
        action="append",
        choices=list(PARTS),
        help="run only these parts (repeatable; default all, Tunix's where TUNIX_SITE holds it)",
    )
    parser.add_argument(
        "--cases",
        action="append",
        type=parse_case,
        help="train cases ROWSxLENGTH and GRPO cases PROMPTSxGENERATIONSxNEW_TOKENS, in order (repeatable)",
    )
    parser.add_argument(
        "--remat",
        action="append",
        choices=REMAT_SETTINGS,
        help="train.remat of jaxtune's train cases (repeatable: each runs every case; default auto)",
    )
    parser.add_argument(
        "--set",
        action="append",
        dest="overrides",
        metavar="KEY=VALUE",
        help="a setting of the recipes jaxtune's side runs, as `jaxtune run --set` (repeatable)",
    )
    parser.add_argument(
        "--section",
        action="append",
        choices=["lora", "full", "decode", "grpo"],
        help="jaxtune's sections to run (repeatable; default lora, full and decode; --tiny adds grpo)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each jaxtune train case's timed steps, 3 more inside jax.profiler.trace: the traces in "
        "STEM-profile/SIDE-CASE/, their breakdown by kind of op in the report",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        help=f"the parts' time, after the weights are built (default {DEVICE_MINUTES:g}; --tiny {TINY_MINUTES:g})",
    )
    parser.add_argument(
        "--out", help="output stem (default benchmarks/results/accelerator-latest, or accelerator-tiny)"
    )
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child, Path(args.work), args.until)
        return 0

    if any(o.partition("=")[0].strip() == "train.remat" for o in args.overrides or ()):
        parser.error("--set train.remat=...: the train cases' remat is --remat (each runs every case; default auto)")
    from benchmarks.accelerator.report import write_report

    began = time.perf_counter()
    minutes = args.minutes or (TINY_MINUTES if args.tiny else DEVICE_MINUTES)
    stem = Path(args.out) if args.out else RESULTS / ("accelerator-tiny" if args.tiny else "accelerator-latest")
    cases = args.cases or []
    settings = Settings.make(
        args.model,
        args.tiny,
        tuple(c for c in cases if len(c) == 2) or None,
        tuple(args.remat or ("auto",)),
        tuple(args.section) if args.section else None,
        tuple(args.overrides or ()),
        str(Path(f"{stem}-profile").resolve()) if args.profile else "",
        tuple(c for c in cases if len(c) == 3) or None,
        args.layers,
    )
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="jaxtune-accelerator-") as folder:
        work = Path(folder)
        settings.save(work)
        layers = f", {settings.layers} layers" if settings.layers is not None else ""
        log(f"building {settings.model}{' (tiny)' if settings.tiny else ''} weights, {settings.dtype}{layers}")
        weights = build_weights(settings, work / "model")
        log(f"built {weights['parameters']:,} parameters' weights in {weights['seconds']:.1f} s")
        # the parts' time starts once the weights are built: building is the benchmark's own, and took from the
        # parts' share before (on a 2-core CPU Llama 3.1 8B's first 2 layers took 47 s, 4 layers 59 s)
        parts = run_parts(args.parts or default_parts(), work, time.perf_counter() + 60 * minutes)
        md = write_report(stem, settings, weights, parts, work, date, time.perf_counter() - began, minutes)
    say(md)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
