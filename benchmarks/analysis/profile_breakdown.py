"""Where a profiled train step's device time goes: the XLA ops of a `jax.profiler` trace of a few
steps, by category, per step, with each category's share of the step.

    python -m benchmarks.analysis.profile_breakdown TRACE_DIR   # a folder jax.profiler.trace wrote (the accelerator bench's --profile)

What is read: the `*.trace.json.gz` that `jax.profiler.trace(TRACE_DIR)` writes under
TRACE_DIR/plugins/profile/RUN/ beside the `.xplane.pb` (TSL's xplane_to_trace_events: a process per
plane, a thread per line, an event per op run; `perfetto_trace.json.gz`, written with
create_perfetto_trace=True, is the same events without the file's metadata). The steps are the host
events named `STEP`, which `jax.profiler.StepTraceAnnotation(STEP, step_num=i)` leaves around each
step; the trace is taken around those steps alone, so every op in it is counted as theirs.

Where the ops are, and what they say of themselves:

- TPU: the process "/device:TPU:0", thread "XLA Ops" (beside "Steps" and "XLA Modules"): an event
  per op run, named by its HLO instruction ("fusion.12"), with args long_name (the instruction's HLO
  text), hlo_category ("convolution fusion", "loop fusion", "data formatting", ...), tf_op (JAX's
  op_name) and model_flops. A control-flow op (while, call, conditional) spans the ops it runs, so an
  op's own time is its span less its children's, as XProf counts it. Sources: TSL's
  xla/tsl/profiler/convert/xplane_to_trace_events.cc (names, long_name, which stats become args:
  flops, bytes_accessed, program_id and symbol_id do not), XProf's
  xprof/convert/events_db/tpu_trace_parser.cc and its test (the lines, nested ops and self time) and
  xprof/utils/flat_op_metrics_db_utils.cc (the stats an op carries).
- CPU: the host process "/host:CPU", on XLA's client threads: an event per op run whose args name
  the op (hlo_op) and its program (hlo_module), and nothing of what it does.

What an op is, where the trace does not say, comes from the program's optimized HLO text
(`compiled.as_text()`), read from the `*.hlo` files in TRACE_DIR: its opcode, the opcodes a fusion
fuses, its op_name and its matmuls' flops. The categories, first match wins (`classify`):

| category | ops |
|---|---|
| attention kernel | flash or splash in the op's name, or a custom call's attributes or op_name (the Pallas kernels) |
| collectives | all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, or a fusion calling one |
| host transfer | infeed, outfeed, send, recv, and XLA:TPU's host categories |
| loss | op_name under jaxtune's chunked loss scope (forward and backward, its head matmuls included) |
| optimizer | op_name under jaxtune's optimizer scope: the update after the step's micro-batches |
| matmuls | dot and convolution, fusions holding one, XLA:TPU's convolution categories |
| copies / layout | copy, transpose, bitcast-convert, reshape, slice, pad, concatenate, ..., fusions of those alone, "data formatting" |
| other | control flow's own time (while, call, conditional), other custom calls, sort, rng |
| elementwise / reduce | everything else: loop and reduction fusions, elementwise ops |
| idle | the steps' wall time less the time some op ran |

Each category's share is of the sum of all rows: on a TPU, whose ops run one at a time, that sum is
the steps' wall time; on a CPU, ops of one program may run at once on several threads and their
times add up.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

STEP = "train"  # the StepTraceAnnotation around each profiled step
# jaxtune's name scopes in the train step's op names (jaxtune.runtime.modeling.loss.SCOPE,
# jaxtune.runtime.compiled.steps.OPTIMIZER_SCOPE), here as text so that reading a trace needs no JAX.
LOSS_SCOPE, OPTIMIZER_SCOPE = "chunked_loss", "optimizer"

MATMULS, ATTENTION, LOSS, ELEMENTWISE, LAYOUT = (
    "matmuls",
    "attention kernel",
    "loss",
    "elementwise / reduce",
    "copies / layout",
)
COLLECTIVES, OPTIMIZER, TRANSFER, OTHER, IDLE = "collectives", "optimizer", "host transfer", "other", "idle"
CATEGORIES = (
    MATMULS,
    ATTENTION,
    LOSS,
    ELEMENTWISE,
    LAYOUT,
    COLLECTIVES,
    OPTIMIZER,
    TRANSFER,
    OTHER,
    IDLE,
)  # table order

MATMUL_OPS = frozenset({"dot", "convolution"})
COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute")
TRANSFER_OPS = frozenset({"infeed", "outfeed", "send", "send-done", "recv", "recv-done"})
LAYOUT_OPS = frozenset(
    {
        "copy",
        "copy-start",
        "copy-done",
        "transpose",
        "bitcast",
        "bitcast-convert",
        "reshape",
        "broadcast",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "concatenate",
        "pad",
        "reverse",
        "iota",
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
    }
)
OTHER_OPS = frozenset({"while", "call", "conditional", "custom-call", "sort", "rng", "rng-bit-generator", "after-all"})
TOP_OPS = 8  # the ops with the most time, kept with the breakdown


@dataclass(frozen=True)
class Op:
    """What one op is, from the trace and, where given, the program's HLO."""

    name: str  # the HLO instruction, "fusion.12"
    opcode: str  # "fusion", "copy", "custom-call", ...
    fused: frozenset  # the opcodes a fusion runs (from the HLO); empty where unknown
    category: str  # XLA:TPU's hlo_category; "" elsewhere
    op_name: str  # JAX's op_name: the name scopes it ran under
    attributes: str  # the instruction's attributes: calls=, custom_call_target=, kernel_name=, ...
    flops: float  # one run's


def classify(op: Op) -> str:
    """The category of one op (the module's table)."""
    kernel = op.name if op.opcode != "custom-call" else f"{op.name} {op.attributes} {op.op_name}"
    if re.search("flash|splash", kernel, re.IGNORECASE):  # the kernel itself: not the ops around it under its op_name
        return ATTENTION
    if COLLECTIVE.search(f"{op.opcode} {op.category}") or re.search(rf"calls=%({COLLECTIVE.pattern})", op.attributes):
        return COLLECTIVES
    if op.opcode in TRANSFER_OPS or re.search("host|infeed|outfeed", op.category):
        return TRANSFER
    if LOSS_SCOPE in op.op_name:
        return LOSS
    if re.search(rf"\b{OPTIMIZER_SCOPE}\b", op.op_name):
        return OPTIMIZER
    if op.opcode in MATMUL_OPS or op.fused & MATMUL_OPS or re.search("convolution|dot", op.category):
        return MATMULS
    if (
        op.opcode in LAYOUT_OPS
        or op.category == "data formatting"
        or (op.opcode == "fusion" and op.fused and op.fused <= LAYOUT_OPS)
    ):
        return LAYOUT
    if op.opcode in OTHER_OPS:
        return OTHER
    return ELEMENTWISE


def _step_hlo():
    # Imported here, not at the top: importing it defaults JAX_PLATFORMS to cpu, which the accelerator
    # benchmark's driver (which imports this module for its report) must not pass on to its children.
    from benchmarks.analysis import step_hlo

    return step_hlo


def hlo_ops(text: str) -> dict[str, dict]:
    """{instruction: {module, opcode, fused, op_name, attributes, flops}} of a program's optimized HLO text."""
    step_hlo = _step_hlo()
    computations = step_hlo.parse(text)
    module = re.match(r"HloModule ([^\s,]+)", text)
    out = {}
    for computation in computations.values():
        for instruction in computation.instructions:
            calls = step_hlo.called(instruction, "calls")
            fused = frozenset().union(*(step_hlo.opcodes(computations, c) for c in calls))
            op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
            out[instruction.name] = {
                "module": module[1] if module else "",
                "opcode": instruction.opcode,
                "fused": fused,
                "op_name": op_name[1] if op_name else "",
                "attributes": instruction.attributes,
                "flops": sum(step_hlo.dot_flops(computations, c)[0] for c in calls),
            }
    return out


def describe(event: dict, hlo: dict[str, dict]) -> Op:
    """One op event as an `Op`: the HLO's account of it where the HLO has it (and, on a CPU, the event
    is of the same program), else the trace's own (XLA:TPU's long_name, hlo_category, tf_op)."""
    args = event.get("args", {})
    name = args.get("hlo_op") or event["name"]
    known = hlo.get(name)
    if known and args.get("hlo_module", known["module"]) != known["module"]:
        known = None
    flops = float(args.get("model_flops") or 0) or (known["flops"] if known else 0.0)
    if known:
        return Op(
            name,
            known["opcode"],
            known["fused"],
            args.get("hlo_category", ""),
            known["op_name"],
            known["attributes"],
            flops,
        )
    parsed = _step_hlo().INSTRUCTION.match(args.get("long_name", ""))  # "%fusion.3 = bf16[..] fusion(..), kind=.."
    base = re.sub(r"\.\d+$", "", name)
    opcode = parsed[3] if parsed else "fusion" if base.endswith("fusion") else base
    return Op(
        name,
        opcode,
        frozenset(),
        args.get("hlo_category", ""),
        args.get("tf_op", ""),
        (parsed[5] or "") if parsed else "",
        flops,
    )


def read_trace(path: Path) -> tuple[Path, list[dict]]:
    """(file, events) of `path`, a trace file, or the newest `*.trace.json.gz` under the folder `path`."""
    files = [path] if path.is_file() else sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}")
    with gzip.open(files[-1], "rt") as f:
        return files[-1], json.load(f)["traceEvents"]


def processes(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}


def step_events(events: list[dict]) -> list[dict]:
    """The host's `STEP` annotations, one per profiled step."""
    names = processes(events)
    return [
        e
        for e in events
        if e.get("ph") == "X" and e["name"] == STEP and not names.get(e["pid"], "").startswith("/device:")
    ]


def op_events(events: list[dict]) -> list[dict]:
    """The op runs: those on the first device's "XLA Ops" thread where the trace has one (TPU), else
    the events that name an HLO op (CPU)."""
    names = processes(events)
    threads = [
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"] == "XLA Ops"
    ]
    if threads:
        device = min(threads, key=lambda thread: names.get(thread[0], ""))
        return [e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) == device]
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def _span_ns(event: dict) -> tuple[int, int]:
    start = round(event["ts"] * 1e3)  # the trace's times are microseconds
    return start, start + round(event["dur"] * 1e3)


def own_seconds(events: list[dict]) -> list[float]:
    """Each event's own time: its span less those of the events it directly encloses on its thread."""
    own = [e["dur"] * 1e-6 for e in events]
    threads = defaultdict(list)
    for i, e in enumerate(events):
        threads[(e["pid"], e.get("tid"))].append(i)
    for indices in threads.values():
        indices.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        enclosing: list[tuple[int, int]] = []  # (end, index) of the events open at this one's start
        for i in indices:
            start, end = _span_ns(events[i])
            while enclosing and enclosing[-1][0] <= start:
                enclosing.pop()
            if enclosing:
                own[enclosing[-1][1]] -= events[i]["dur"] * 1e-6
            enclosing.append((end, i))
    return own


def busy_seconds(events: list[dict]) -> float:
    """The time at least one of `events` ran: the union of their spans."""
    busy, reached = 0, None
    for start, end in sorted(_span_ns(e) for e in events):
        if reached is None or start > reached:
            busy, reached = busy + end - start, end
        elif end > reached:
            busy, reached = busy + end - reached, end
    return busy * 1e-9


def breakdown(path: Path) -> dict:
    """The breakdown of the trace at `path` (a folder jax.profiler.trace wrote, with the program's `*.hlo`
    beside, or a trace file): per step, each category's seconds, share, op runs and flops, and the
    ops with the most time."""
    path = Path(path)
    file, events = read_trace(path)
    steps = step_events(events)
    if not steps:
        raise ValueError(
            f"{file}: no {STEP!r} events; profile each step inside "
            f"jax.profiler.StepTraceAnnotation({STEP!r}, step_num=i)"
        )
    hlo: dict[str, dict] = {}
    hlo_files = sorted((path if path.is_dir() else file.parent).glob("*.hlo"))
    for text in hlo_files:
        hlo.update(hlo_ops(text.read_text()))
    ops = op_events(events)
    if not ops:
        threads = sorted({e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"})
        raise ValueError(
            f'{file}: no XLA op events (no "XLA Ops" thread, no event naming an hlo_op); threads: {threads}'
        )
    n, wall = len(steps), sum(e["dur"] for e in steps) * 1e-6
    seconds, runs, flops = defaultdict(float), defaultdict(int), defaultdict(float)
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    for event, own in zip(ops, own_seconds(ops)):
        op = describe(event, hlo)
        category = classify(op)
        seconds[category] += own
        runs[category] += 1
        flops[category] += op.flops
        by_op[op.name, category] += own
    busy = busy_seconds(ops)
    seconds[IDLE] = max(wall - busy, 0.0)
    total = sum(seconds.values())
    rows = [
        {
            "category": c,
            "seconds": seconds[c] / n,
            "share": seconds[c] / total,
            "ops": runs[c] / n,
            "flops": flops[c] / n,
        }
        for c in CATEGORIES
        if seconds[c] > 0 or runs[c]
    ]
    top = sorted(by_op.items(), key=lambda item: -item[1])[:TOP_OPS]
    return {
        "trace": str(file),
        "steps": n,
        "step_seconds": wall / n,
        "busy_seconds": busy / n,
        "hlo": [f.name for f in hlo_files],
        "rows": rows,
        "top_ops": [{"op": name, "category": c, "seconds": s / n} for (name, c), s in top],
    }


def row(found: dict, category: str) -> dict:
    """The row of `category` (zeros where the steps ran none of its ops)."""
    return next(
        (r for r in found["rows"] if r["category"] == category),
        {"category": category, "seconds": 0.0, "share": 0.0, "ops": 0.0, "flops": 0.0},
    )


def markdown(found: dict) -> str:
    """The breakdown as a Markdown table, then its top ops."""
    wall, busy = found["step_seconds"], found["busy_seconds"]
    lines = [
        f"{found['steps']} profiled steps of {wall * 1e3:,.3f} ms; an op ran {min(busy / wall, 1):.1%} of that time.",
        "",
        "| category | ms / step | share | ops / step | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for r in found["rows"]:
        rate = f"{r['flops'] / r['seconds'] / 1e12:,.3g}" if r["flops"] and r["seconds"] else ""
        runs = f"{r['ops']:,.0f}" if r["category"] != IDLE else ""
        lines.append(f"| {r['category']} | {r['seconds'] * 1e3:,.3f} | {r['share']:.1%} | {runs} | {rate} |")
    total = sum(r["seconds"] for r in found["rows"])
    lines.append(f"| **all** | {total * 1e3:,.3f} | 100% | {sum(r['ops'] for r in found['rows']):,.0f} | |")
    lines += [
        "",
        "Ops with the most time: "
        + "; ".join(f"{t['op']} ({t['category']}) {t['seconds'] * 1e3:,.3f} ms" for t in found["top_ops"])
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "trace", type=Path, help="a folder jax.profiler.trace wrote (its *.hlo beside), or a *.trace.json.gz"
    )
    args = parser.parse_args(argv)
    print(markdown(breakdown(args.trace)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
