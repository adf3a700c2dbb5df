"""The accelerator benchmark's report: its children's result lines gathered into figures per case and
side (tokens/s, MFU, memory, first step, step-0 loss), the ratios between sides, and the JSON and
Markdown files. A figure a part did not reach says why (the part's status) instead."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.accelerator.grpo import grpo_results
from benchmarks.accelerator.shared import Results, Settings, case_name, jaxtune_side
from benchmarks.analysis import profile_breakdown
from benchmarks.common.harness import fmt, machine_info, provenance

SIDES = {
    "jaxtune-lora": "lora",
    "jaxtune-full": "full",
    "torch-eager": "lora",
    "torch-compile": "lora",
    "tunix": "lora",
}
PART_OF = {
    "jaxtune-lora": "jaxtune",
    "jaxtune-full": "jaxtune",
    "torch-eager": "torch-eager",
    "torch-compile": "torch-compile",
    "tunix": "tunix",
}
BASELINES = ("torch-eager", "torch-compile", "tunix")  # each compared with jaxtune-lora, case by case
COLUMNS = ("jaxtune", "PyTorch eager", "torch.compile", "Tunix")
# The column a PyTorch-on-TPU side would fill, and why it is not there.
TORCH_XLA = (
    "PyTorch/XLA: not measured. torch_xla cannot be installed on the TPU machine: it has no network, and its "
    "package index holds no torch_xla wheel (none for its Python 3.11 with its torch and libtpu)."
)
GiB = 2**30
# What Tunix's LoRA step does otherwise than jaxtune's (tunix_side.py's docstring says why).
TUNIX_DIFFERS = (
    "what differs: no rematerialisation (Tunix's default), its einsum attention over a (rows, length, length) "
    "mask, the loss over all logits at once (jaxtune's is chunked), one qwix LoRA A shared by Gemma's fused "
    "k and v projections, LoRA weights and AdamW state in the weights' "
    "dtype (jaxtune's: float32), and no llama3 RoPE scaling in its Llama 3."
)


def gather(work: Path, parts: dict) -> list[dict]:
    """The result lines of every part that ran, each with its part's name."""
    return [{**line, "part": part} for part in parts for line in Results.read(work, part)]


def first_event(lines: list[dict], event: str, part: str | None = None) -> dict | None:
    return next((line for line in lines if line.get("event") == event and part in (None, line["part"])), None)


def flops_per_token(lines: list[dict]) -> dict:
    """{method: {case: model FLOPs per token}}, as jaxtune's child counted them (`flops.train_flops_per_token`)."""
    out: dict = {}
    for line in lines:
        if line.get("event") == "flops":
            out.setdefault(line["method"], {})[line["case"]] = line["per_token"]
    return out


def side_figures(
    lines: list[dict], side: str, case: str, per_token: float | None, peak: float | None, matmul: float | None
) -> dict:
    """One side's figures for one case, its lines merged; MFU = tokens/s x FLOPs per token / peak FLOP/s."""
    merged: dict = {}
    for line in lines:
        if line.get("case") == case and line.get("side") == side:
            merged.update({k: v for k, v in line.items() if k not in ("case", "side", "part")})
    if "tokens_per_second" in merged and per_token:
        achieved = merged["tokens_per_second"] * per_token
        merged["flops_per_token"] = per_token
        merged["mfu"] = achieved / peak if peak else None
        merged["mfu_vs_matmul"] = achieved / matmul if matmul else None
    return merged


def why_missing(figures: dict, side: str, parts: dict) -> str:
    if "error" in figures:
        return f"failed: {figures['error']}"
    if "skipped" in figures:
        return figures["skipped"]
    part = PART_OF.get(side, "jaxtune")
    return f"not measured: {part} {parts[part]['status']}"


def sides_of(settings: Settings) -> dict[str, str]:
    """{side: method}: the default sides, and jaxtune's with each fixed train.remat the run asked for."""
    fixed = [r for r in settings.remats if r != "auto"]
    return {**SIDES, **{jaxtune_side(method, remat): method for method in ("lora", "full") for remat in fixed}}


def train_results(settings: Settings, lines: list[dict], parts: dict, peak: float | None, matmul: float | None) -> dict:
    """{case: {side: figures, or {"missing": why}}, ratios and step-0 loss agreement}."""
    flops = flops_per_token(lines)
    out = {}
    for rows, length in settings.cases:
        case = case_name(rows, length)
        sides = {}
        for side, method in sides_of(settings).items():
            if PART_OF.get(side, "jaxtune") not in parts:
                if side == "tunix":
                    sides[side] = {"missing": "not run (no Tunix in its site folder, TUNIX_SITE, or not asked for)"}
                continue
            figures = side_figures(lines, side, case, flops.get(method, {}).get(case), peak, matmul)
            if "tokens_per_second" not in figures:
                figures["missing"] = why_missing(figures, side, parts)
            sides[side] = figures
        out[case] = {"sides": sides, **comparisons(sides)}
    return out


def comparisons(sides: dict) -> dict:
    """jaxtune's LoRA tokens/s over each baseline's, and their step-0 losses' relative difference."""
    ours = sides.get("jaxtune-lora", {})
    ratios, loss = {}, {}
    for side in BASELINES:
        theirs = sides.get(side, {})
        if ours.get("tokens_per_second") and theirs.get("tokens_per_second"):
            ratios[f"jaxtune_vs_{side}"] = ours["tokens_per_second"] / theirs["tokens_per_second"]
        if ours.get("step0_loss") is not None and theirs.get("step0_loss") is not None:
            loss[side] = abs(ours["step0_loss"] - theirs["step0_loss"]) / abs(theirs["step0_loss"])
    return {"ratios": ratios, "step0_loss_rel_diff": loss}


def decode_results(lines: list[dict], parts: dict) -> dict:
    def merged(side: str, part: str) -> dict:
        found = {
            k: v
            for line in lines
            if line.get("event") == "decode" and line.get("side") == side
            for k, v in line.items()
        }
        found.pop("part", None)
        return found or {"missing": f"not measured: {part} {parts.get(part, {}).get('status', 'not run')}"}

    ours, theirs = merged("jaxtune", "jaxtune"), merged("torch", "torch-eager")
    batches = [{k: v for k, v in line.items() if k != "part"} for line in lines if line.get("event") == "decode_batch"]
    out = {"jaxtune": ours, "torch_generate": theirs, "jaxtune_batches": batches}
    if ours.get("tokens") is not None and theirs.get("tokens") is not None:
        pairs = [(a, b) for row_a, row_b in zip(ours["tokens"], theirs["tokens"]) for a, b in zip(row_a, row_b)]
        out["tokens_identical"] = ours["tokens"] == theirs["tokens"]
        out["tokens_agreeing"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    if ours.get("new_tokens_per_second") and theirs.get("new_tokens_per_second"):
        out["jaxtune_vs_generate"] = ours["new_tokens_per_second"] / theirs["new_tokens_per_second"]
    return out


def build_report(
    settings: Settings, weights: dict, parts: dict, work: Path, date: str, seconds: float, minutes: float
) -> dict:
    lines = gather(work, parts)
    device = first_event(lines, "device", "jaxtune") or {}
    torch_device = first_event(lines, "device", "torch-eager") or first_event(lines, "device", "torch-compile") or {}
    peak = device.get("peak", {}).get("peak_flops")
    matmul = first_event(lines, "matmul") or {}
    return {
        "date": date,
        "seconds": round(seconds, 1),
        "time_limit_minutes": minutes,
        "tiny": settings.tiny,
        "model": settings.model,
        "parameters": weights["parameters"],
        "vocab_size": weights["vocab_size"],
        "settings": {
            **settings.__dict__,
            "weights": (f"random {settings.dtype}, seed {settings.seed}, _init_weights layer by layer (build_weights)"),
        },
        "provenance": provenance(machine=False),
        "machine": {
            **machine_info(),
            "jax_device": device,
            "torch_device": torch_device,
            "tunix_device": first_event(lines, "device", "tunix") or {},
        },
        "peak": device.get("peak"),
        "measured_matmul": matmul or None,
        "mfu_derivation": (
            "tokens/s x flops.train_flops_per_token (attention over flops.attended_keys: half the row causally, "
            "at most the window in a sliding-window layer) / peak FLOP/s of one device"
        ),
        "parts": parts,
        # jaxtune's model opened as the train stage opens it: seconds, and the process's peak host memory by then
        "loaded": {
            line["method"]: {k: v for k, v in line.items() if k not in ("event", "method", "part")}
            for line in lines
            if line.get("event") == "loaded" and line.get("part") == "jaxtune"
        },
        "train": (train := train_results(settings, lines, parts, peak, matmul.get("flops_per_second"))),
        "time_to_first_step": time_to_first_step(settings, weights, lines, train),
        "decode": decode_results(lines, parts),
        **(
            {"grpo": grpo_results(settings, lines, parts, device.get("hbm_bandwidth"))}
            if "grpo" in settings.sections
            else {}
        ),
    }


def time_to_first_step(settings: Settings, weights: dict, lines: list[dict], train: dict) -> dict:
    """{method: {phase: seconds}}: where the time before each method's first step went, in order: the benchmark's
    random weights built (the driver's, before any part), the checkpoint read, quantized (a quantized base: the read
    included, which it overlaps), the model placed on the device (LoRA attached), then for the first case: its
    program traced, lowered and compiled (every train.remat auto candidate's, summed), the rest of choosing, and the
    first step run. What a child cut before a phase finished has no entry for it."""
    out = {}
    for line in lines:
        if line.get("event") != "loaded" or line.get("part") != "jaxtune":
            continue
        phases = {"weights_built": weights.get("seconds"), **line.get("phases", {"opened": line["seconds"]})}
        case = case_name(*settings.cases[0])
        fig = train.get(case, {}).get("sides", {}).get(jaxtune_side(line["method"], settings.remats[0]), {})
        spent = fig.get("compiling") or {}
        for phase, key in (("traced", "trace_seconds"), ("lowered", "lower_seconds"), ("compiled", "compile_seconds")):
            if key in spent:
                phases[phase] = spent[key]
        if fig.get("fit_seconds") is not None:
            phases["chosen_otherwise"] = max(fig["fit_seconds"] - sum(spent.get(k, 0) for k in MONITORED_SECONDS), 0)
        if fig.get("first_step_seconds") is not None:
            phases["first_step_run"] = fig["first_step_seconds"]
        out[line["method"]] = {"case": case, **{k: v for k, v in phases.items() if v is not None}}
    return out


MONITORED_SECONDS = ("trace_seconds", "lower_seconds", "compile_seconds", "cache_read_seconds")


def time_to_first_step_rows(report: dict) -> list[str]:
    rows = []
    for method, phases in report.get("time_to_first_step", {}).items():
        timed = {k: v for k, v in phases.items() if k != "case"}
        before = ", ".join(f"{name.replace('_', ' ')} {fmt_seconds(v)}" for name, v in timed.items())
        rows.append(f"- {method}, first case {phases['case']}: {before}; {fmt_seconds(sum(timed.values()))} in all.")
    return ["", "Time to the first step, phase by phase:", *rows] if rows else []


def write_report(
    stem: Path, settings: Settings, weights: dict, parts: dict, work: Path, date: str, seconds: float, minutes: float
) -> str:
    report = build_report(settings, weights, parts, work, date, seconds, minutes)
    md = markdown(report)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(f"{stem}.md").write_text(md)
    return md


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def percent(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def throughput(fig: dict, ours: dict | None = None) -> str:
    if "tokens_per_second" not in fig:
        ran = fig.get("first_step_seconds") is not None  # a case cut during its timed steps still ran its first
        return (
            f"first step ran in {first_step(fig)}, loss {fmt(fig.get('step0_loss'))}"
            f"{'; ' + chosen(fig) if chosen(fig) else ''}; then "
            if ran
            else ""
        ) + fig.get("missing", "")
    text = f"{fig['tokens_per_second']:,.0f} ({fig['step_seconds'] * 1e3:,.1f} ms"
    text += f", MFU {percent(fig.get('mfu'))}, {percent(fig.get('mfu_vs_matmul'))} of the matmul)"
    if ours and ours.get("tokens_per_second"):
        text += f": jaxtune {ours['tokens_per_second'] / fig['tokens_per_second']:.2f}x"
    return text


def size(n: int | None) -> str:
    return "" if n is None else f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / 2**20:,.1f} MiB"


def memory(fig: dict) -> str:
    """A side's peak: XLA's plan of its step (jaxtune's and Tunix's), with the device's peak so far in its process."""
    measured = size(fig.get("peak_bytes"))
    if fig.get("plan_peak_bytes") is None:
        return measured
    return size(fig["plan_peak_bytes"]) + (f" ({measured} so far)" if measured else "")


def sections(report: dict) -> tuple[str, ...]:
    """The jaxtune sections the run asked for (reports from before `--section` ran all three)."""
    return tuple(report["settings"].get("sections") or ("lora", "full", "decode"))


def asked_auto(report: dict) -> bool:
    """Whether the run measured train.remat auto (the default), not only fixed policies."""
    return "auto" in report["settings"].get("remats", ("auto",))


def train_rows(report: dict) -> list[str]:
    rows = []
    for case, result in report["train"].items() if "lora" in sections(report) and asked_auto(report) else ():
        sides = result["sides"]
        ours = sides.get("jaxtune-lora", {})
        cells = lambda f: [f(sides.get(s, {})) for s in ("jaxtune-lora", *BASELINES)]  # noqa: E731
        rows.append(
            f"| LoRA {case}: tokens/s | {throughput(ours)} | "
            + " | ".join(throughput(sides.get(s, {}), ours) for s in BASELINES)
            + " |"
        )
        rows.append(f"| LoRA {case}: peak memory | " + " | ".join(cells(memory)) + " |")
        rows.append(f"| LoRA {case}: first step (trace + compile + run) | " + " | ".join(cells(first_step)) + " |")
        losses = [fmt(sides.get(s, {}).get("step0_loss")) for s in ("jaxtune-lora", *BASELINES)]
        for i, side in enumerate(BASELINES, start=1):
            diff = result["step0_loss_rel_diff"].get(side)
            losses[i] += f" (rel. diff {diff:.1e})" if diff is not None else ""
        rows.append(f"| LoRA {case}: step-0 loss | " + " | ".join(losses) + " |")
    for case, result in report["train"].items():
        full = result["sides"].get("jaxtune-full")
        if full is not None and "full" in sections(report) and asked_auto(report):
            extra = f"; {memory(full)}, first step {first_step(full)}" if "tokens_per_second" in full else ""
            rows.append(f"| full fine-tune {case}: tokens/s | {throughput(full)}{extra} | | | |")
    return rows


def first_step(fig: dict) -> str:
    """The first step's seconds (trace + compile + run), with the choice of train.remat auto before it."""
    if fig.get("first_step_seconds") is None:
        return ""
    fit = fig.get("fit_seconds") or 0.0
    parts = fig.get("compiling") or {}
    named = {
        "trace": "trace_seconds",
        "lower": "lower_seconds",
        "compile": "compile_seconds",
        "cache read": "cache_read_seconds",
    }
    spent = ", ".join(f"{name} {fmt_seconds(parts[key])}" for name, key in named.items() if parts.get(key))
    hits = (
        f", {parts.get('cache_hits', 0):.0f} cache hits of "
        f"{parts.get('cache_hits', 0) + parts.get('cache_misses', 0):.0f}"
        if "cache_hits" in parts or "cache_misses" in parts
        else ""
    )
    within = f": {spent}{hits}" if spent or hits else ""
    return fmt_seconds(fig["first_step_seconds"] + fit) + (
        f" (of which choosing {fmt_seconds(fit)}{within})" if fit > 1 else ""
    )


def chosen(fig: dict) -> str:
    """'none, chunk 1024' or 'layer, chunk 512, 2 micro-batches': how jaxtune ran the case."""
    if "remat" not in fig:
        return ""
    split = f", {fig['split']} micro-batches" if fig.get("split", 1) > 1 else ""
    return f"{fig['remat']}, chunk {fig.get('loss_chunk_tokens')}{split}"


def remat_rows(report: dict) -> list[str]:
    """Per method and case: tokens/s of train.remat auto (what it chose), where the run measured it, beside
    each fixed policy the run asked for."""
    fixed = [r for r in report["settings"].get("remats", []) if r != "auto"]
    if not fixed:
        return []
    auto_column = ["auto (chosen)"] if asked_auto(report) else []
    rows = [
        "",
        "| case | " + " | ".join(auto_column + [f"remat {r}" for r in fixed]) + " |",
        "|---|" + "---|" * (len(auto_column) + len(fixed)),
    ]
    for case, result in report["train"].items():
        for method in (m for m in ("lora", "full") if m in sections(report)):
            sides = result["sides"]
            auto = sides.get(jaxtune_side(method), {})
            cells = [f"{throughput(auto)}; {chosen(auto)}; {memory(auto)}".strip("; ")] if auto_column else []
            for remat in fixed:
                fig = sides.get(jaxtune_side(method, remat), {})
                cells.append(
                    f"{throughput(fig)}; {chosen(fig)}; {memory(fig)}".strip("; ")
                    if "tokens_per_second" in fig
                    else throughput(fig)
                )
            rows.append(f"| {method} {case} | " + " | ".join(cells) + " |")
    return rows


def fmt_seconds(x) -> str:
    return "" if x is None else f"{x:,.3g} s" if x < 100 else f"{x:,.0f} s"


def decode_row(report: dict) -> str:
    d, s = report["decode"], report["settings"]
    ours, theirs = d["jaxtune"], d["torch_generate"]
    left = (
        ours.get("missing")
        or f"{ours['new_tokens_per_second']:,.0f} new tokens/s (first call {ours['first_call_seconds']:.1f} s)"
    )
    right = theirs.get("missing") or f"`generate`: {theirs['new_tokens_per_second']:,.0f}"
    if "jaxtune_vs_generate" in d:
        right += f" (jaxtune {d['jaxtune_vs_generate']:.2f}x)"
    if "tokens_identical" in d:
        right += "; tokens identical" if d["tokens_identical"] else f"; {d['tokens_agreeing']:.1%} of tokens agree"
    return f"| greedy decode, {s['prompts']} prompts x {s['new_tokens']} new tokens | {left} | {right} | | |"


def decode_batch_rows(report: dict) -> list[str]:
    """jaxtune's greedy decoding at each batch it ran, against the bound of reading every weight once per step."""
    batches = report["decode"].get("jaxtune_batches") or []
    if not batches:
        return []
    bandwidth = (report["machine"].get("jax_device") or {}).get("hbm_bandwidth")
    rows = [
        "",
        "| greedy decode (jaxtune) | new tokens/s | of the weight-read bound | first call |",
        "|---|---|---|---|",
    ]
    for b in batches:
        bound = b["prompts"] * bandwidth / b["weight_bytes"] if bandwidth and b.get("weight_bytes") else None
        share = (
            f"{b['new_tokens_per_second'] / bound:.1%} of {bound:,.0f}"
            if bound
            else "- (no bandwidth known for the device)"
        )
        rows.append(
            f"| {b['prompts']} prompts x {report['settings']['new_tokens']} new tokens | "
            f"{b['new_tokens_per_second']:,.0f} | {share} | {fmt_seconds(b['first_call_seconds'])} |"
        )
    rows += [
        "",
        "The weight-read bound: prompts x the device's memory bandwidth / the bytes of the model's weights, "
        "which each decoding step reads at least once (the KV cache's reads not counted).",
    ]
    return rows


def profile_sections(report: dict) -> list[str]:
    """Where a step's device time went, per jaxtune side and case the run profiled (--profile)."""
    profiled = [
        (case, side, fig)
        for case, result in report["train"].items()
        for side, fig in result["sides"].items()
        if fig.get("profile")
    ]
    if not profiled:
        return []
    rows = [
        "",
        "## Step breakdown: where a step's device time goes (jax.profiler, after the timed steps)",
        "",
        f"Each case's trace (jax.profiler's .xplane.pb, which XProf reads, and .trace.json.gz, the events read here) "
        f"and its program's optimized HLO are in SIDE-CASE/ under {report['settings'].get('profile')}; "
        "`python -m benchmarks.analysis.profile_breakdown FOLDER` breaks one down again.",
    ]
    for case, side, fig in profiled:
        found = fig["profile"]
        timed = f": the timed steps' median {fig['step_seconds'] * 1e3:,.3f} ms" if fig.get("step_seconds") else ""
        rows += ["", f"### {side} {case}{timed}", ""]
        if "error" in found:
            rows.append(f"Not profiled: {found['error']}")
            continue
        rows += [
            profile_breakdown.markdown(found).rstrip(),
            "",
            matmul_summary(found, fig, (report["measured_matmul"] or {}).get("flops_per_second")),
        ]
    return rows


def matmul_summary(found: dict, fig: dict, peak: float | None) -> str:
    """The matmuls' share of the profiled step, their FLOP/s against the run's measured matmul, and the
    MFU were they that fast, the other ops unchanged; XLA's count of the step's flops beside theirs."""
    row = profile_breakdown.row(found, profile_breakdown.MATMULS)
    text = f"Matmuls: {row['share']:.1%} of the step"
    if row["flops"] and row["seconds"]:
        rate = row["flops"] / row["seconds"]
        text += f" at {rate / 1e12:,.3g} TFLOP/s"
        if peak:
            at_peak = found["step_seconds"] - row["seconds"] + row["flops"] / peak
            text += f", {rate / peak:.0%} of the measured matmul's {peak / 1e12:,.3g}"
            if fig.get("mfu"):
                text += (
                    f"; at that rate the step would take {at_peak * 1e3:,.3f} ms, MFU "
                    f"{fig['mfu'] * found['step_seconds'] / at_peak:.1%} (now {fig['mfu']:.1%})"
                )
    if found.get("program_flops"):
        text += (
            f". XLA's cost analysis counts {found['program_flops'] / 1e12:,.4g} TFLOP in a step, the matmul ops "
            f"{row['flops'] / found['program_flops']:.0%} of it"
        )
    return text + "."


def grpo_rows(report: dict) -> list[str]:
    """The main table's rows of the GRPO cases: jaxtune's step; the other parts have none."""
    others = " | ".join(["no GRPO step"] * (len(COLUMNS) - 1))
    return [f"| GRPO {case}: a step | {grpo_step(fig)} | {others} |" for case, fig in report.get("grpo", {}).items()]


def grpo_step(fig: dict) -> str:
    if "missing" in fig:
        return (f"first step ran in {first_step(fig)}; then " if fig.get("first_step_seconds") else "") + fig["missing"]
    return (
        f"{fmt_seconds(fig['step_seconds'])}: sampling {fig['sampling_tokens_per_second']:,.0f} tokens/s "
        f"({percent(fig['sample_share'])}), update {fig['update_tokens_per_second']:,.0f} tokens/s "
        f"({percent(fig['update_share'])}), the rest {percent(fig['rest_share'])}"
    )


def grpo_section(report: dict) -> list[str]:
    """Each GRPO case's step split into sampling, the update and the rest, its first step and memory plan."""
    results, s = report.get("grpo") or {}, report["settings"]
    if not results:
        return []
    rows = [
        "",
        "## A GRPO step (jaxtune)",
        "",
        f"`rollouts.train_grpo` on the LoRA recipe. A case PxGxN samples G answers of N new tokens to each of P "
        f"prompts of {s['grpo_prompt_length']} random tokens (temperature 1, no KL term, one optimizer step per "
        "sampled batch), then takes one optimizer step on the P x G answers (train.remat auto). The end token is an "
        "id past the vocabulary: no answer ends early, every one runs all N tokens, the worst case for sampling. "
        f"Figures over the timed steps after the first (which compiles) and {s['warmups']} warm-up(s): sampling "
        "tokens/s = the answers' tokens / sampling's seconds (its prefill and the answers' fetch included); update "
        "tokens/s = the rows' real tokens (prompt and answer) / the update's seconds; the rest: the step's other "
        "seconds (scoring, building and placing the rows, reading the loss; no reference or old-policy pass here).",
        "",
        "| case | a step | sampling | update | the rest | first step | memory plan | "
        "sampling, of the weight-read bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, fig in results.items():
        if "missing" in fig:
            rows.append(f"| {case} | {grpo_step(fig)} | | | | {first_step(fig)} | {chosen(fig)} | |")
            continue
        cut = f" ({fig['timed_steps']} of {s['steps']} timed steps)" if fig["timed_steps"] < s["steps"] else ""
        bound = (
            f"{fig['sampling_of_bound']:.1%} of {fig['weight_read_bound']:,.0f}"
            if fig.get("weight_read_bound")
            else "- (no bandwidth known for the device)"
        )
        rows.append(
            f"| {case} | {fmt_seconds(fig['step_seconds'])}{cut} | {fig['sampled_tokens']:,.0f} tokens in "
            f"{fmt_seconds(fig['sample_seconds'])}: {fig['sampling_tokens_per_second']:,.0f} tokens/s "
            f"({percent(fig['sample_share'])}) | {fig['update_tokens']:,.0f} tokens in "
            f"{fmt_seconds(fig['update_seconds'])}: {fig['update_tokens_per_second']:,.0f} tokens/s "
            f"({percent(fig['update_share'])}) | {percent(fig['rest_share'])} | {first_step(fig)}; in the step, "
            f"sampling {fmt_seconds(fig['first_sample_seconds'])}, update {fmt_seconds(fig['first_update_seconds'])} | "
            f"{chosen(fig)}; {memory(fig)} | {bound} |"
        )
    rows += [
        "",
        "The weight-read bound: answers x the device's memory bandwidth / the bytes of the model's weights, "
        "which each decoding step reads at least once (the KV cache's reads not counted). The memory plans "
        "as the loop logged them:",
        "",
    ]
    rows += [f"- {case}: {fig['message']}" for case, fig in results.items() if fig.get("message")]
    return rows


def tunix_versions(machine: dict) -> str:
    """Tunix's packages, where its side ran (reports from before it had one have no such entry)."""
    found = machine.get("tunix_device") or {}
    names = ("google-tunix", "qwix", "flax", "jax", "safetensors")
    return (
        (
            " Tunix's side: "
            + ", ".join(f"{n} {found[n]}" for n in names if n in found)
            + f", from its own site folder; {TUNIX_DIFFERS}"
        )
        if found
        else ""
    )


def markdown(report: dict) -> str:
    s, m = report["settings"], report["machine"]
    device = m["jax_device"].get("device_kind") or m["torch_device"].get("device_kind") or "unknown device"
    peak, matmul = report["peak"] or {}, report["measured_matmul"] or {}
    versions = m["versions"]
    header = [
        f"# jaxtune on {device}: "
        f"{report['model']}{' (TINY: a toy model of its family)' if report['tiny'] else ''} ({report['date']})",
        "",
        f"{report['parameters']:,} parameters, {s['weights']}, the same on every side; random tokens, "
        f"{s['steps']} timed synchronised steps (median) after {s['warmups']} warm-ups. jax {versions.get('jax')}, "
        f"torch {versions.get('torch')}, transformers "
        f"{versions.get('transformers')}, torchax {versions.get('torchax')}; "
        f"torch.compile backend {s['compile_backend']}.{tunix_versions(m)}"
        + (f" jaxtune's recipes with {', '.join(s['overrides'])}." if s.get("overrides") else ""),
        "",
        f"MFU: {report['mfu_derivation']}; peak {peak.get('derivation', 'unknown')}. Measured matmul: "
        + (
            f"{matmul['n']}^3 {matmul['dtype']} at {matmul['flops_per_second'] / 1e12:,.3g} TFLOP/s."
            if matmul
            else "not measured."
        ),
        "",
    ]
    sources = {
        side: fig.get("memory_source") for result in report["train"].values() for side, fig in result["sides"].items()
    }
    measured = "; ".join(f"{side}: {source}" for side, source in sources.items() if source)
    notes = [
        "Peak memory: jaxtune's and Tunix's are XLA's memory plan of the step (arguments + outputs + temporaries - "
        "donated), then in parentheses the process's measured peak so far (its cases run one after another, its "
        "weights' loading included)" + (f"; {measured}." if measured else ".")
    ]
    parts = ["", *notes, "", TORCH_XLA, "", "| part | status | seconds | limit |", "|---|---|---|---|"]
    parts += [
        f"| {name} | {p['status']} | {p['seconds']:.0f} | {p['limit_seconds']:.0f} |"
        for name, p in report["parts"].items()
    ]
    rows = train_rows(report) + ([decode_row(report)] if "decode" in sections(report) else []) + grpo_rows(report)
    table = ["| case | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS), *rows] if rows else []
    batches = decode_batch_rows(report) if "decode" in sections(report) else []
    return (
        "\n".join(
            header
            + table
            + time_to_first_step_rows(report)
            + batches
            + grpo_section(report)
            + remat_rows(report)
            + profile_sections(report)
            + parts
        )
        + "\n"
    )
