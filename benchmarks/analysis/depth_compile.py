"""How the LoRA train step's trace, lowering and compile grow with depth, unrolled and with the layers held
stacked (`model.scan_layers`), compiled here for a chip this machine lacks.

    JAX_PLATFORMS=cpu python -m benchmarks.analysis.depth_compile    # Llama, v5e-1, 4 and 32 layers
    JAX_PLATFORMS=cpu python -m benchmarks.analysis.depth_compile --family gemma3 --out results.json

Each case is a model of one width (`WIDTH`) on the meta device, LoRA on q and v, one step of 8 x 512, built and
compiled in this process from shapes alone for the target's compile-only devices (XLA:TPU through libtpu, as
`jaxtune doctor --target` compiles). It prints seconds per phase and, for each layout, the deep model's over
the shallow one's: the stacked step's should stay near 1, the unrolled one's grows with the layers. Seconds
vary with the machine and its load; compare the ratios of one run. Needs the tpu-plan extra (`make test`
installs it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

WIDTH = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2}


def meta_model(family: str, layers: int):
    """A bfloat16 model of `family` with `layers` layers at `WIDTH` on the meta device, LoRA r8 on q and v."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    from jaxtune.config import LoraConfig
    from jaxtune.runtime.modeling.model import attach_lora

    shape = {**WIDTH, "num_hidden_layers": layers, "vocab_size": 4096, "head_dim": 128}
    config = Gemma3TextConfig(**shape, sliding_window=128) if family == "gemma3" else LlamaConfig(**shape)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return attach_lora(module, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def phases(family: str, layers: int, stacked: bool, target: str, rows: int, length: int) -> dict:
    """Seconds to trace, lower and compile the step, and its plan's temporaries."""
    from jaxtune.config import MeshConfig, TrainConfig
    from jaxtune.runtime.compiled import programs, steps
    from jaxtune.runtime.devices import targets
    from jaxtune.runtime.devices.mesh import lowering, make_placement
    from jaxtune.runtime.modeling.model import to_jax

    programs.clear()
    placement = make_placement(MeshConfig(), targets.devices(targets.resolve(target)))
    model = to_jax(meta_model(family, layers), placement, shapes_only=True, scan_layers=stacked)
    optimizer = steps.make_optimizer(TrainConfig())
    program = steps.shared_train_step(model, optimizer)
    arguments = steps.train_step_arguments(model, optimizer, 1, rows, length)
    program.ref.point_at(model)
    with model.env, lowering(placement.mesh):
        started = time.perf_counter()
        traced = program.jitted.trace(*arguments)
        lowered_at = time.perf_counter()
        lowered = traced.lower()
        compiling_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
    plan = steps.compiled_memory(compiled)
    return {
        "trace_seconds": round(lowered_at - started, 2),
        "lower_seconds": round(compiling_at - lowered_at, 2),
        "compile_seconds": round(done - compiling_at, 2),
        "total_seconds": round(done - started, 2),
        "temp_bytes": plan["temp_bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("llama", "gemma3"), default="llama")
    parser.add_argument("--target", default="v5e-1")
    parser.add_argument("--layers", type=int, nargs=2, default=(4, 32), metavar=("SHALLOW", "DEEP"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--out", type=Path, help="keep the cases and ratios as a result (JSON)")
    args = parser.parse_args(argv)
    cases = {}
    for stacked in (False, True):
        for layers in args.layers:
            name = f"{'stacked' if stacked else 'unrolled'}-{layers}"
            cases[name] = phases(args.family, layers, stacked, args.target, args.rows, args.length)
            print(name, json.dumps(cases[name]), flush=True)
    shallow, deep = args.layers
    ratios = {
        layout: round(cases[f"{layout}-{deep}"]["total_seconds"] / cases[f"{layout}-{shallow}"]["total_seconds"], 2)
        for layout in ("unrolled", "stacked")
    }
    grown = ", ".join(f"{layout} {ratio}x" for layout, ratio in ratios.items())
    print(f"{deep} layers over {shallow}, trace + lower + compile: {grown}")
    if args.out:
        from benchmarks.common.harness import provenance

        date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        result = {"date": date, "family": args.family, "target": args.target, "width": WIDTH, "rows": args.rows}
        result |= {"length": args.length, "cases": cases, "deep_over_shallow": ratios, "provenance": provenance()}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
