"""Where a train step's time would go on an accelerator, from the program XLA compiles for it here,
without the chip: the optimized HLO's kernels, grouped by what they do, with their count, the
bytes they move, the flops of their matmuls, and a roofline estimate of each group's time.

    JAX_PLATFORMS=cpu python -m benchmarks.analysis.step_hlo                  # Gemma 3 1B LoRA recipe, h200, 8 x 512
    JAX_PLATFORMS=cpu python -m benchmarks.analysis.step_hlo --rows 8 --length 2048 --attention xla
    JAX_PLATFORMS=cpu python -m benchmarks.analysis.step_hlo --recipe configs/gemma3-1b-dolly-full.yaml
    JAX_PLATFORMS=cpu python -m benchmarks.analysis.step_hlo --out benchmarks/results/step-hlo-h200.json

The step is the recipe's (method, optimizer, remat), on a meta model of its checkpoint
(tests/targets/recipes.py: nothing is downloaded), compiled by the target's compiler for a
compile-only device, as `jaxtune doctor --target` compiles it. A kernel is each instruction that
launches work in the program's executed computations (the entry, while bodies, calls): fusions,
custom calls (matmul libraries, Pallas kernels), copies. Its bytes are its operands' and
results' sizes; its flops those of the dots it contains (attention kernels: their matmuls over
the causal half). The estimate is max(flops / peak, bytes / bandwidth) per kernel, plus a launch
cost per kernel (`LAUNCH_SECONDS`): a model, not a measurement. Matmuls are told apart by their
operands: LoRA's (a 2-d operand with the rank), the head's (one spanning the vocabulary), the
model's (the rest); XLA rewrites some very thin dots (rank 4, say) as multiplies and sums, which
then count as elementwise work without flops. XLA:GPU without a device cannot
autotune, so it keeps its default matmul emitters (Triton gemm fusions) where a real GPU may
pick cuBLAS: kernel counts and bytes carry over, matmul speeds do not.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SECONDS = 4e-6  # a kernel launch and its tail on a Hopper GPU, roughly
BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "s4": 0.5,
    "u4": 0.5,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*?)\)(, .*)?$")
# A line break inside an instruction (XLA:TPU prints a Pallas kernel's kernel_metadata over several
# lines): every line that starts no instruction, computation or closing brace continues the one before.
CONTINUED = re.compile(r"\n(?![ \t]*(?:ROOT |%|ENTRY |\}[ \t]*$|$))", re.MULTILINE)
NOT_KERNELS = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
}


@dataclass
class Instruction:
    name: str
    shape: str  # the result type, "bf16[8,512]{1,0}" or a tuple of them
    opcode: str
    operands: list[str]
    attributes: str


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction] = field(default_factory=list)

    def shapes(self) -> dict[str, str]:
        return {i.name: i.shape for i in self.instructions}


def parse(text: str) -> dict[str, Computation]:
    computations, current = {}, None
    for line in CONTINUED.sub(" ", text).splitlines():
        header = HEADER.match(line)
        if header:
            current = computations.setdefault(header[2], Computation(header[2], bool(header[1])))
            continue
        if line.strip() == "}":
            current = None
            continue
        found = INSTRUCTION.match(line) if current else None
        if found:
            operands = re.findall(r"%([\w.\-]+)", found[4])
            current.instructions.append(Instruction(found[1], found[2], found[3], operands, found[5] or ""))
    return computations


def array_bytes(shape: str) -> float:
    return sum(
        BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in ARRAY.findall(shape)
    )


def dims_of(shape: str) -> list[int]:
    found = ARRAY.search(shape)
    return [int(d) for d in found[2].split(",") if d] if found else []


def called(instruction: Instruction, key: str) -> list[str]:
    return re.findall(rf"\b{key}=%([\w.\-]+)", instruction.attributes)


def trip_count(instruction: Instruction) -> int:
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
    return int(found[1]) if found else 1


def executed(computations: dict[str, Computation]) -> dict[str, int]:
    """Each computation that launches kernels, with how many times one step runs it."""
    entry = next(c for c in computations.values() if c.entry)
    runs, pending = {entry.name: 1}, [entry.name]
    while pending:
        name = pending.pop()
        for instruction in computations[name].instructions:
            targets = []
            if instruction.opcode == "while":
                targets = [(body, trip_count(instruction)) for body in called(instruction, "body")]
                targets += [(cond, trip_count(instruction) + 1) for cond in called(instruction, "condition")]
            elif instruction.opcode == "call":
                targets = [(c, 1) for c in called(instruction, "to_apply")]
            elif instruction.opcode == "conditional":
                targets = [
                    (c, 1)
                    for c in re.findall(
                        r"%([\w.\-]+)", instruction.attributes.split("branch_computations=")[-1].split("}")[0]
                    )
                ]
            for target, times in targets:
                if target in computations:
                    runs[target] = runs.get(target, 0) + runs[name] * times
                    pending.append(target)
    return runs


def contracted(instruction: Instruction, lhs: list[int]) -> int:
    """The entries each result entry of a dot or convolution sums: a dot's contracting dims; a
    convolution's input features (its lhs dim labelled f) times its window (XLA:TPU writes dots as
    convolutions, `dim_labels=bf_io->bf`)."""
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
    labels = re.search(r"dim_labels=([0-9a-z]+)_", instruction.attributes)
    if not lhs or not (contracting or labels):
        return 1
    if contracting:
        return math.prod(lhs[int(i)] for i in contracting[1].split(",") if i)
    window = re.search(r"window=\{size=([0-9x]+)", instruction.attributes)
    return lhs[labels[1].index("f")] * (math.prod(int(n) for n in window[1].split("x")) if window else 1)


def dot_flops(
    computations: dict[str, Computation], name: str, seen: set | None = None
) -> tuple[float, list[list[int]]]:
    """The flops of every dot in a fused computation (and the fusions it nests), and their operands' dims."""
    seen = seen if seen is not None else set()
    if name in seen or name not in computations:
        return 0.0, []
    seen.add(name)
    computation = computations[name]
    shapes = computation.shapes()
    flops, dims = 0.0, []
    for instruction in computation.instructions:
        if instruction.opcode in ("dot", "convolution"):
            lhs = dims_of(shapes.get(instruction.operands[0], ""))
            rhs = dims_of(shapes.get(instruction.operands[1], ""))
            flops += 2 * math.prod(dims_of(instruction.shape)) * contracted(instruction, lhs)
            dims += [lhs, rhs]
        for nested in called(instruction, "calls"):
            more, more_dims = dot_flops(computations, nested, seen)
            flops, dims = flops + more, dims + more_dims
    return flops, dims


def _vocabulary_wide(dims: list[int], vocabulary: int) -> bool:
    """Whether a dot operand spans the vocabulary: the head's weight or a chunk's logits, whole or
    split in two dims (XLA splits the long contraction of the hidden states' gradient)."""
    split = any(a * b == vocabulary for a, b in zip(dims, dims[1:])) and math.prod(dims) >= 64 * vocabulary
    return vocabulary in dims or split


def opcodes(computations: dict[str, Computation], name: str) -> set[str]:
    found = set()
    for instruction in computations.get(name, Computation(name, False)).instructions:
        found.add(instruction.opcode)
        for nested in called(instruction, "calls"):
            found |= opcodes(computations, nested)
    return found


def attention_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """A flash kernel's matmuls over the causal half: 2 in the forward pass, 3 for dq, 4 for dk and dv."""
    b, t, n, h = dims_of(shapes.get(instruction.operands[0], ""))[:4]
    kernel = re.search(r'name = \\?"(jaxtune_flash_\w+)', instruction.attributes)
    matmuls = {"jaxtune_flash_forward": 2, "jaxtune_flash_dq": 3, "jaxtune_flash_dkdv": 4}.get(
        kernel[1] if kernel else "", 2
    )
    return matmuls * 2 * b * n * t * t * h / 2


def kernels(text: str, rank: int | None, vocabulary: int) -> list[dict]:
    """Every kernel a step launches, with its group, count per step, bytes, flops."""
    computations = parse(text)
    found = []
    for name, runs in executed(computations).items():
        computation = computations[name]
        shapes = computation.shapes()
        for instruction in computation.instructions:
            if instruction.opcode in NOT_KERNELS:
                continue
            moved = array_bytes(instruction.shape) + sum(array_bytes(shapes.get(o, "")) for o in instruction.operands)
            flops, dims, group = 0.0, [], "other"
            if instruction.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)[1]
                if "jaxtune_flash" in instruction.attributes:
                    flops, group = attention_flops(instruction, shapes), "attention (flash kernel)"
                elif "gemm" in target or "matmul" in target:
                    lhs, rhs = (dims_of(shapes.get(o, "")) for o in instruction.operands[:2])
                    out = dims_of(instruction.shape)
                    flops, dims = 2 * math.prod(out) * (lhs[-1] if lhs else 1), [lhs, rhs]
                    group = "matmul"
                else:
                    group = f"custom call {target}"
            elif instruction.opcode == "fusion":
                inner = called(instruction, "calls")
                flops, dims = dot_flops(computations, inner[0]) if inner else (0.0, [])
                ops = opcodes(computations, inner[0]) if inner else set()
                if flops:
                    group = "matmul"
                elif ops <= {
                    "parameter",
                    "transpose",
                    "copy",
                    "bitcast",
                    "reshape",
                    "broadcast",
                    "slice",
                    "concatenate",
                    "dynamic-slice",
                    "dynamic-update-slice",
                    "pad",
                    "tuple",
                    "get-tuple-element",
                    "constant",
                }:
                    group = "copy / transpose / slice"
                elif "reduce" in ops:
                    group = "reduction (norms, softmax, sums)"
                else:
                    group = "elementwise"
            elif instruction.opcode in ("copy", "transpose", "copy-start", "copy-done"):
                group = "copy / transpose / slice"
            elif instruction.opcode in (
                "all-reduce",
                "all-gather",
                "reduce-scatter",
                "all-to-all",
                "collective-permute",
            ):
                group = "collective"
            if group == "matmul":
                if rank and any(len(d) == 2 and rank in d for d in dims):  # a LoRA factor, (r, in) or (out, r)
                    group = f"matmul: LoRA (rank {rank})"
                elif any(_vocabulary_wide(d, vocabulary) for d in dims):
                    group = "matmul: vocabulary (head and loss)"
                else:
                    group = "matmul: model"
            found.append(
                {"name": instruction.name, "group": group, "runs": runs, "bytes": moved * runs, "flops": flops * runs}
            )
    return found


def breakdown(found: list[dict], peak_flops: float, bandwidth: float) -> list[dict]:
    groups = defaultdict(lambda: {"kernels": 0, "bytes": 0.0, "flops": 0.0, "seconds": 0.0})
    for kernel in found:
        group = groups[kernel["group"]]
        group["kernels"] += kernel["runs"]
        group["bytes"] += kernel["bytes"]
        group["flops"] += kernel["flops"]
        group["seconds"] += (
            max(kernel["flops"] / peak_flops, kernel["bytes"] / bandwidth) + kernel["runs"] * LAUNCH_SECONDS
        )
    return sorted(({"group": name, **figures} for name, figures in groups.items()), key=lambda g: -g["seconds"])


def slug(group: str) -> str:
    """A group's key in a result, as a page's figure path can name it: 'matmul: LoRA (rank 8)' -> 'matmul-lora'."""
    return re.sub(r"[^a-z]+", "-", group.split(" (")[0].lower()).strip("-")


def table(groups: list[dict]) -> str:
    total = sum(g["seconds"] for g in groups)
    lines = ["| group | kernels | GB moved | TFLOP | estimate, ms | share |", "|---|---|---|---|---|---|"]
    for g in groups:
        lines.append(
            f"| {g['group']} | {g['kernels']:,} | {g['bytes'] / 1e9:.2f} | {g['flops'] / 1e12:.3f} | "
            f"{g['seconds'] * 1e3:.2f} | {g['seconds'] / total:.0%} |"
        )
    lines.append(
        f"| **all** | {sum(g['kernels'] for g in groups):,} | {sum(g['bytes'] for g in groups) / 1e9:.2f} | "
        f"{sum(g['flops'] for g in groups) / 1e12:.3f} | {total * 1e3:.2f} | |"
    )
    return "\n".join(lines)


def compile_step(
    recipe: Path, target_name: str, rows: int, length: int, attention_core: str | None, scan_layers: bool = False
):
    from jaxtune.checks.doctor import as_trained
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.config import load_config
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices import targets
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import fit
    from jaxtune.runtime.modeling import attention
    from jaxtune.runtime.modeling.model import to_jax
    from tests.targets.recipes import checkpoint

    config = load_config(recipe)
    dtype = config.model.compute_dtype
    module = as_trained(
        meta_model(str(checkpoint(config.model.name, ROOT / ".jaxtune" / "models")), None, False, dtype),
        config,
        randomize_lora=False,
    )
    target = targets.resolve(target_name)
    placement = make_placement(config.mesh, targets.devices(target))
    model = to_jax(module, placement, shapes_only=True, scan_layers=scan_layers or config.model.layers_stacked)
    with attention.choose(attention_core) if attention_core else _nothing():
        compiled = steps.compiled_train_step(
            model, steps.make_optimizer(config.train), 1, rows, length, steps.StepSpec(fit.fixed(config.train.remat))
        )
    rank = config.lora.r if config.train.method == "lora" else None
    return compiled, target, rank, module.config.get_text_config().vocab_size


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="configs/gemma3-1b-dolly-lora.yaml")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--attention", help="xla, gpu-flash or splash (default: the target's own)")
    parser.add_argument("--hlo", type=Path, help="also write the optimized HLO here")
    parser.add_argument("--scan-layers", action="store_true", help="the decoder layers as one scan (model.scan_layers)")
    parser.add_argument("--out", type=Path, help="also keep the groups as a result (JSON), for the docs to cite")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    compiled, target, rank, vocabulary = compile_step(
        ROOT / args.recipe, args.target, args.rows, args.length, args.attention, args.scan_layers
    )
    compile_seconds = time.perf_counter() - started
    text = compiled.as_text()
    if args.hlo:
        args.hlo.write_text(text)
    memory = compiled.memory_analysis()
    print(
        f"{args.recipe} on {args.target}, {args.rows} x {args.length}, attention {args.attention or 'default'}"
        f"{', layers scanned' if args.scan_layers else ''}: "
        f"compiled in {compile_seconds:.0f} s; temporaries {memory.temp_size_in_bytes / 2**30:.2f} GiB"
    )
    groups = breakdown(kernels(text, rank, vocabulary), target.chip.peak_flops, target.chip.hbm_bandwidth)
    print(table(groups))
    if args.out:
        from benchmarks.common.harness import provenance

        result = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "provenance": provenance(),
            "recipe": args.recipe,
            "target": args.target,
            "shape": [args.rows, args.length],
            "attention": args.attention or "default",
            "scan_layers": args.scan_layers,
            "temp_bytes": memory.temp_size_in_bytes,
            "seconds_to_compile": compile_seconds,
            "groups": {slug(g["group"]): g for g in groups},
            "all": {key: sum(g[key] for g in groups) for key in ("kernels", "bytes", "flops", "seconds")},
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
