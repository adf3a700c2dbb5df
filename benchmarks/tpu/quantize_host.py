"""Quantizing a base on the TPU machine's host, which holds JAX and (installed as docs say) a CPU torch but not
jaxtune's other dependencies: `quantize.py` is loaded from its file. One decoder layer of Llama 3.1 8B's shape (its
seven weights, random bfloat16) quantized by the reference `quantize` (1024 rows at a time, torch's own threads, as
`load_quantized` did before) and by `Quantizing` (`quantize_fast` on threads of its own) at several thread counts,
the codes compared; each figure is per layer, over 4 layers for `Quantizing`.

    python3 benchmarks/tpu/quantize_host.py [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYER = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
LAYERS = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--schemes", nargs="+", default=["nf4", "int4", "int8"])
    args = parser.parse_args(argv)
    import torch

    spec = importlib.util.spec_from_file_location("quantize", ROOT / "jaxtune" / "runtime" / "modeling" / "quantize.py")
    q = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)
    generator = torch.Generator().manual_seed(0)
    layer = {
        name: (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16) for name, shape in LAYER.items()
    }
    cores = len(os.sched_getaffinity(0))
    result = {"cores": cores, "torch_threads": torch.get_num_threads(), "default_threads": q.THREADS, "schemes": {}}

    def clock(run):
        wall, cpu = time.perf_counter(), time.process_time()
        value = run()
        return value, time.perf_counter() - wall, time.process_time() - cpu

    def reference(weight, scheme):
        parts = [q.quantize(weight[row : row + 1024], scheme) for row in range(0, weight.shape[0], 1024)]
        return {k: torch.cat([p[k] for p in parts]) if k != "levels" else parts[0][k] for k in parts[0]}

    def pooled(scheme, threads):
        with q.Quantizing(scheme, threads) as pool:
            for i in range(LAYERS):
                for name, weight in layer.items():
                    pool.add(f"{i}.{name}", weight)
            return pool.fields()

    for scheme in args.schemes:
        for weight in layer.values():
            q.quantize_by_rows(weight, scheme)  # compiled once per shape: not what is timed
        expected, wall, cpu = clock(lambda: {name: reference(w, scheme) for name, w in layer.items()})
        found = {"reference": {"wall": wall, "cpu": cpu}}
        identical = True
        for threads in sorted({1, 2, 4, 8, cores}):
            fields, wall, cpu = clock(lambda threads=threads: pooled(scheme, threads))
            found[f"threads {threads}"] = {"wall": wall / LAYERS, "cpu": cpu / LAYERS}
            identical &= all(
                torch.equal(expected[n][k].view(torch.uint8), fields[f"{LAYERS - 1}.{n}"][k].view(torch.uint8))
                for n in layer
                for k in expected[n]
            )
        found["identical"] = identical
        result["schemes"][scheme] = found
        print(
            f"{scheme}, a layer of 218M weights: "
            + ", ".join(
                f"{how} {f['wall']:.2f} s ({f['cpu']:.1f} CPU s)" for how, f in found.items() if how != "identical"
            )
            + f"; identical {identical}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
