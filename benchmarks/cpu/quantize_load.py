"""Quantizing a base as it loads: the reference `quantize` against `quantize_fast` on the same weight, and a
checkpoint of a few layers of Llama 3.1 8B's shape read and quantized as `load_quantized` did before (each linear
layer quantized by `quantize`, 1024 rows at a time, in the reading thread) and as it does now (`quantize_fast` on
threads of their own while the next layers are read), in one run, the codes compared.

    .venv/bin/python -m benchmarks.cpu.quantize_load                       # 2 layers, nf4
    .venv/bin/python -m benchmarks.cpu.quantize_load --layers 4 --scheme int4 --out /tmp/quantize-load.json

Seconds are wall and process CPU (every thread's), each the best of `--repeats`; a layer's cost is the difference
between two layer counts' (the embedding and the head are read whatever the depth), so run two.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common.harness import log, provenance

SHAPE = "llama-3.1-8b"
WEIGHTS = {"gate_proj": (14336, 4096), "down_proj": (4096, 14336)}  # the largest of a layer's seven


def timed(run, repeats: int) -> tuple[object, float, float]:
    """(run()'s value, best wall seconds, best CPU seconds) over `repeats` calls."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        value = run()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - wall), min(best_cpu, time.process_time() - cpu)
    return value, best_wall, best_cpu


def same(a: dict, b: dict) -> bool:
    import torch

    return list(a) == list(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def one_weight(scheme: str, shape: tuple[int, int], repeats: int) -> dict:
    import torch

    from jaxtune.runtime.modeling.quantize import quantize, quantize_fast

    weight = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    quantize_fast(weight, scheme)  # compiled once per shape: not what is timed
    reference, ref_wall, ref_cpu = timed(lambda: quantize(weight, scheme), repeats)
    fast, fast_wall, fast_cpu = timed(lambda: quantize_fast(weight, scheme), repeats)
    return {
        "shape": list(shape),
        "reference": {"wall": ref_wall, "cpu": ref_cpu},
        "fast": {"wall": fast_wall, "cpu": fast_cpu},
        "ratio_wall": ref_wall / fast_wall,
        "ratio_cpu": ref_cpu / fast_cpu,
        "identical": same(reference, fast),
    }


def load_before(folder: Path, scheme: str) -> tuple[dict, dict]:
    """`load_quantized` as it was: each layer quantized by `quantize`, 1024 rows at a time, in the reading thread."""
    import torch

    from jaxtune.runtime.modeling.quantize import held_quantized, quantize
    from jaxtune.runtime.modeling.streaming import load_model

    stored, seconds = {}, {"quantize": 0.0}

    def take(layer: str, linear: torch.nn.Linear) -> bool:
        if not held_quantized(layer, linear):
            return False
        started = time.perf_counter()
        weight = linear.weight
        parts = [quantize(weight[row : row + 1024], scheme) for row in range(0, weight.shape[0], 1024)]
        stored[layer] = {
            field: torch.cat([part[field] for part in parts]) if field != "levels" else parts[0][field]
            for field in parts[0]
        }
        seconds["quantize"] += time.perf_counter() - started
        return True

    load_model(str(folder), None, False, "bfloat16", take)
    return stored, seconds


def load_now(folder: Path, scheme: str) -> tuple[dict, dict]:
    from jaxtune.runtime.modeling.model import load_quantized

    _, (stored, _) = load_quantized(str(folder), None, False, "bfloat16", scheme)
    by_layer: dict = {}
    for key, tensor in stored.items():
        layer, _, field = key.rpartition(".")
        by_layer.setdefault(layer, {})[field] = tensor
    return by_layer, {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help=f"decoder layers of {SHAPE}'s shape (default 2)")
    parser.add_argument("--scheme", default="nf4", choices=["int8", "int4", "nf4"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", help="the checkpoint folder, built there unless it holds one (default: temporary)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)

    import jaxtune  # noqa: F401  (first: JAX on the CPU, quietly)
    from benchmarks.accelerator.shared import Settings, build_weights

    result: dict = {"provenance": provenance(), "shape": SHAPE, "layers": args.layers, "scheme": args.scheme}
    result["weights"] = {}
    for name, shape in WEIGHTS.items():
        for scheme in ("int8", "int4", "nf4"):
            found = result["weights"][f"{name} {scheme}"] = one_weight(scheme, shape, args.repeats)
            log(
                f"{name} {tuple(shape)} {scheme}: quantize {found['reference']['cpu']:.2f} CPU s, quantize_fast "
                f"{found['fast']['cpu']:.2f} ({found['ratio_cpu']:.1f}x CPU, {found['ratio_wall']:.1f}x wall), "
                f"identical {found['identical']}"
            )
    with tempfile.TemporaryDirectory(prefix="jaxtune-quantize-load-") as temporary:
        folder = Path(args.folder or temporary)
        if not (folder / "config.json").is_file():
            settings = Settings.make(SHAPE, False, layers=args.layers)
            built = build_weights(settings, folder)
            log(f"built {args.layers} layers of {SHAPE}: {built['parameters']:,} parameters, {built['seconds']:.0f} s")
        loads = {}
        for how, load in (("before", load_before), ("now", load_now)):
            (stored, parts), wall, cpu = timed(lambda load=load: load(folder, args.scheme), 1)
            loads[how] = {"stored": stored, "wall": wall, "cpu": cpu, **{f"{k}_wall": v for k, v in parts.items()}}
            log(f"load_quantized {how}: {wall:.1f} s ({cpu:.1f} CPU s)")
    before, now = loads["before"], loads["now"]
    result["load"] = {
        "before": {k: v for k, v in before.items() if k != "stored"},
        "now": {k: v for k, v in now.items() if k != "stored"},
        "ratio_wall": before["wall"] / now["wall"],
        "ratio_cpu": before["cpu"] / now["cpu"],
        "identical": list(before["stored"]) == list(now["stored"])
        and all(same(before["stored"][layer], now["stored"][layer]) for layer in before["stored"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
