"""Stage `report`: one Markdown report, report.json and a loss curve; published as Prefect artifacts."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from jaxtune.artifacts import MANIFEST, ArtifactRef
from jaxtune.records import EvalMetrics, GenerateMetrics, TrainSummary
from jaxtune.tasks import rl_report
from jaxtune.tasks.hardest import HARDEST, hardest_examples, hardest_lines
from jaxtune.tasks.stage import build_artifact
from jaxtune.tracking import ui
from jaxtune.tracking.curves import plot_loss, plot_rewards

STAGE = "report"
EXAMPLES = 6


def summarize(inputs: dict[str, ArtifactRef], count: int = HARDEST) -> dict:
    """The numbers a reader checks first, gathered from every upstream artifact (`count`: hardest examples)."""
    baseline = EvalMetrics.read(inputs["baseline_eval"].file("metrics.json"))
    final = EvalMetrics.read(inputs["final_eval"].file("metrics.json"))
    train = TrainSummary.read(inputs["train"].file("summary.json")).model_dump()
    export = inputs["export"].read_json("export.json")
    return {
        "baseline": {"loss": baseline.loss, "perplexity": baseline.perplexity},
        "final": {"loss": final.loss, "perplexity": final.perplexity},
        "per_category": {
            c: {"baseline": baseline.per_category[c].loss, "final": m.loss} for c, m in final.per_category.items()
        },
        "exact_match": GenerateMetrics.read(inputs["generate"].file("metrics.json")).exact_match.model_dump(),
        "train": {
            k: train[k]
            for k in (
                "steps",
                "seconds",
                "compile_seconds",
                "tokens_per_second",
                "mfu",
                "mfu_derivation",
                "nonpad_fraction",
                "packed",
                "batch_shape",
                "trainable_parameters",
                "rows_per_step",
                "resumed_from",
                "interruptions",
                "mesh",
            )
        },
        "eval_during_training": [r for r in _log(inputs["train"]) if "eval_loss" in r],
        "export": {
            "kind": export["kind"],
            "path": str(inputs["export"].file(export["subfolder"])),
            "gguf": [{**f, "path": str(inputs["export"].file(f"gguf/{f['file']}"))} for f in export.get("gguf", [])],
        },
        "data": inputs["tokenize"].read_json("stats.json"),
        "parity": final.parity.model_dump(),
        "trust_remote_code": ran_remote_code(inputs["train"]),
        **_preference(baseline, final, train),
        **({"quantized_base": _quantized_base(inputs["base"])} if inputs.get("base") is not None else {}),
        **({"hardest": hardest} if (hardest := hardest_examples(inputs, count)) else {}),
    }


def _quantized_base(ref: ArtifactRef) -> dict:
    info = ref.read_json("quantize.json")
    return {key: info[key] for key in ("scheme", "kinds", "held_bytes", "unquantized_bytes", "compute_dtype")} | {
        "layers": len(info["layers"]),
        "left_unquantized": len(info["left_unquantized"]),
    }


def _quantized_base_lines(base: dict | None) -> list[str]:
    """What the adapter was trained against, when the base was held quantized."""
    if not base:
        return []
    kinds = ", ".join(f"{n} {kind}" for kind, n in base["kinds"].items())
    left = f"; {base['left_unquantized']} left as float weights" if base["left_unquantized"] else ""
    return [
        f"**Trained against a quantized base** (`model.base_quantization: {base['scheme']}`): {base['layers']} "
        f"frozen linear layers held as {kinds}{left}, {base['held_bytes'] / 2**20:,.1f} MiB "
        f"({base['held_bytes'] / max(base['unquantized_bytes'], 1):.2f}x of {base['unquantized_bytes'] / 2**20:,.1f} "
        f"MiB in {base['compute_dtype']}). The evals, generations and merged export use that base dequantized; "
        "the adapter alone also loads on the original base, which it was not trained against.",
        "",
    ]


PAIR_METRICS = (
    "loss",
    "preference_loss",
    "chosen_nll",
    "accuracy",
    "margin",
    "chosen_logp",
    "rejected_logp",
    "chosen_reward",
    "rejected_reward",
)


def _preference(baseline: EvalMetrics, final: EvalMetrics, train: dict) -> dict:
    """A preference run's pair metrics before and after, overall and per category (none for SFT)."""
    if final.preference is None:
        return {}
    before, after = baseline.preference, final.preference
    return {
        "preference": {
            "objective": train["objective"],
            "pairs": after.pairs,
            **{name: {"before": getattr(before, name), "after": getattr(after, name)} for name in PAIR_METRICS},
            "per_category": {
                c: {
                    "pairs": m.pairs,
                    "accuracy": {"before": before.per_category[c].accuracy, "after": m.accuracy},
                    "margin": {"before": before.per_category[c].margin, "after": m.margin},
                }
                for c, m in after.per_category.items()
            },
        }
    }


def curve_levels(summary: dict) -> tuple[float, float]:
    """The eval loss before and after that the train loss is drawn against: the objective's."""
    if "preference" in summary:
        return summary["preference"]["loss"]["before"], summary["preference"]["loss"]["after"]
    return summary["baseline"]["loss"], summary["final"]["loss"]


def _loss_parts(p: dict) -> list[tuple[str, str, str]]:
    """The loss's two terms, where the SFT term made it more than the preference term."""
    if p["loss"] == p["preference_loss"]:
        return []
    return [
        (f"  of which {p['objective']}", "preference_loss", ".4f"),
        ("  chosen answers' mean token NLL", "chosen_nll", ".4f"),
    ]


def _preference_lines(p: dict | None) -> list[str]:
    if not p:
        return []
    rows = [
        ("preference accuracy", "accuracy", ".3f"),
        ("reward margin", "margin", ".4f"),
        (f"{p['objective']} loss", "loss", ".4f"),
        *_loss_parts(p),
        ("log-probability, chosen", "chosen_logp", ".3f"),
        ("log-probability, rejected", "rejected_logp", ".3f"),
    ]
    lines = [
        f"Preference tuning ({p['objective']}) on {p['pairs']:,} held-out pairs; a pair counts as right when its "
        "chosen answer's implicit reward is the higher (a tie counts half).",
        "",
        "| metric | before | after |",
        "|---|---|---|",
        *[f"| {label} | {p[key]['before']:{fmt}} | {p[key]['after']:{fmt}} |" for label, key, fmt in rows],
        "",
    ]
    if len(p["per_category"]) > 1:
        lines += [
            "| category | pairs | accuracy before | accuracy after | margin after |",
            "|---|---|---|---|---|",
            *[
                f"| {c} | {m['pairs']} | {m['accuracy']['before']:.3f} | {m['accuracy']['after']:.3f} "
                f"| {m['margin']['after']:.4f} |"
                for c, m in p["per_category"].items()
            ],
            "",
        ]
    return lines


def ran_remote_code(train_ref: ArtifactRef) -> bool:
    """Whether model.trust_remote_code was on: the train stage's manifest keeps its model config."""
    return bool(train_ref.read_json(MANIFEST).get("config", {}).get("model", {}).get("trust_remote_code"))


def _log(train_ref: ArtifactRef) -> list[dict]:
    return [json.loads(line) for line in train_ref.file("log.jsonl").read_text().splitlines()]


def _speed_lines(t: dict) -> list[str]:
    """Batch shape, the share of it that was real tokens, and model-FLOPs utilisation with its derivation."""
    if t.get("batch_shape") is None:
        return []
    k, rows, length = t["batch_shape"]
    kind = "packed sequences" if t["packed"] else "padded rows"
    mfu = (
        f"MFU {100 * t['mfu']:.1f}% ({t['mfu_derivation']})"
        if t.get("mfu") is not None
        else "MFU not known for this device"
    )
    return [
        f"Batches: {k} x {rows} {kind} of {length} tokens, "
        f"{100 * t['nonpad_fraction']:.1f}% of them real tokens; {mfu}.",
        "",
    ]


def _interruption_lines(interruptions: list[dict]) -> list[str]:
    if not interruptions:
        return []
    each = "; ".join(
        f"at step {i['reached']} ({i['stopped_by']}), resumed from {i['resumed_from']}"
        f"{' by an automatic restart' * bool(i.get('restart'))}, "
        f"{i['lost_steps']} step{'s' * (i['lost_steps'] != 1)} trained again"
        for i in interruptions
    )
    lost = sum(i["lost_steps"] for i in interruptions)
    return [
        f"Interrupted {len(interruptions)} time{'s' * (len(interruptions) != 1)}, "
        f"{lost} steps trained again in all: {each}.",
        "",
    ]


def render_markdown(summary: dict, examples: list[dict], image: str) -> str:
    b, f, em, t = summary["baseline"], summary["final"], summary["exact_match"], summary["train"]
    lines = [
        "# jaxtune report",
        "",
        # Code from the checkpoint ran with this user's rights: a reader of the results should know.
        *(
            ["**trust_remote_code was on**: model code shipped with the checkpoint ran.", ""]
            if summary.get("trust_remote_code")
            else []
        ),
        *_preference_lines(summary.get("preference")),
        *_quantized_base_lines(summary.get("quantized_base")),
        "| metric | before | after |",
        "|---|---|---|",
        f"| eval loss{' (chosen answers)' * ('preference' in summary)} | {b['loss']:.4f} | {f['loss']:.4f} |",
        f"| perplexity | {b['perplexity']:.2f} | {f['perplexity']:.2f} |",
        f"| exact match | {em['before']:.3f} | {em['after']:.3f} |",
        "",
        f"Training: {t['steps']} steps in {t['seconds']:.1f} s ({t['compile_seconds']:.1f} s compiling), "
        f"{t['tokens_per_second']:.0f} tokens/s, {t['trainable_parameters']:,} trainable parameters.",
        "",
        f"Mesh: {t.get('mesh') or 'not recorded'}.",
        "",
        *_interruption_lines(t.get("interruptions") or []),
        *_speed_lines(t),
        f"![loss curve]({image})",
        "",
        *(_data_section(summary["data"]) if "data" in summary else []),
        "## Loss by category",
        "",
        "| category | before | after |",
        "|---|---|---|",
        *[f"| {c} | {v['baseline']:.4f} | {v['final']:.4f} |" for c, v in summary["per_category"].items()],
        "",
        f"Exported {summary['export']['kind']}: `{summary['export']['path']}`",
        "",
        *_gguf_lines(summary["export"].get("gguf") or []),
        *_parity_section(summary["parity"]),
        *hardest_lines(summary.get("hardest")),
        "## Generations",
        "",
    ]
    for ex in examples:
        lines += [
            f"**{ex['category']}**: {_quote(ex['prompt'])}",
            "",
            f"- reference: `{ex['reference']}`",
            f"- before: `{ex['before']}`",
            f"- after: `{ex['after']}`",
            "",
        ]
    return "\n".join(lines)


def _gguf_lines(files: list[dict]) -> list[str]:
    """The exported GGUF files, each with its type and size, and how to run one."""
    if not files:
        return []
    return [
        "| GGUF file | type | size |",
        "|---|---|---|",
        *[f"| `{f['path']}` | {f['type']} | {f['bytes'] / 2**20:,.1f} MiB |" for f in files],
        "",
        f"Run one with `llama-cli -m {files[0]['path']}`, or in Ollama with "
        f"`ollama create NAME -f {files[0]['path'].removesuffix('.gguf')}.Modelfile`.",
        "",
    ]


def _data_section(stats: dict) -> list[str]:
    """Rows in and kept, and per source of a mixture its rows, weight and share of the train rows."""
    dropped = ", ".join(f"{reason.replace('_', ' ')} {n:,}" for reason, n in stats["dropped"].items() if n) or "none"
    unit = "pairs" if stats.get("preference") else "rows"
    lines = [
        "## Data",
        "",
        f"{stats['rows_in']:,} {unit} in: {stats['train_rows']:,} train, {stats['eval_rows']:,} eval; "
        f"dropped: {dropped}; truncated: {stats['truncated']:,}.",
        "",
    ]
    sources = stats.get("sources", [])
    if len(sources) > 1:
        lines += [
            "| source | rows in | weight | train rows | share of train | eval rows |",
            "|---|---|---|---|---|---|",
            *[
                f"| {s['name']} | {s['rows_in']:,} | {s['weight']:g} | {s['train_rows']:,} "
                f"| {100 * s['train_rows'] / max(stats['train_rows'], 1):.1f}% | {s['eval_rows']:,} |"
                for s in sources
            ],
            "",
        ]
    return lines


def _parity_section(parity: dict) -> list[str]:
    return [
        "## Parity",
        "",
        f"The trained model's logits on {parity['rows']} eval rows ({parity['tokens']} tokens), "
        f"computed by JAX and by PyTorch eager from the same {parity['dtype']} weights:",
        "",
        "| max abs logit diff | max abs logit | top-1 agreement |",
        "|---|---|---|",
        f"| {parity['max_abs_diff']:.2e} | {parity['max_abs_logit']:.2f} | {100 * parity['top1_agreement']:.1f}% |",
        "",
    ]


def _quote(text: str) -> str:
    return text.replace("\n", " ")[:300]


@task(name=STAGE, result_serializer="json")
def report(section: dict, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `tokenize`, `baseline_eval`, `train`, `final_eval`,
    `export`, `generate`; `base` over a quantized base."""

    def build(folder: Path) -> None:
        if rl_report.is_rl(inputs):  # GRPO: rewards, not losses
            summary = rl_report.summarize(inputs)
            plot_rewards(
                _log(inputs["train"]), summary["reward"]["before"], summary["reward"]["after"], folder / "loss.png"
            )
            (folder / "report.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
            (folder / "report.md").write_text(rl_report.render_markdown(summary, "loss.png"))
            (folder / "examples.json").write_text("[]")
            return
        summary = summarize(inputs, section.get("hardest", HARDEST))
        log = _log(inputs["train"])
        plot_loss(log, *curve_levels(summary), folder / "loss.png")
        generations = inputs["generate"].file("generations.jsonl").read_text().splitlines()
        examples = [json.loads(line) for line in generations[: section.get("examples", EXAMPLES)]]
        (folder / "report.json").write_text(json.dumps(summary, indent=2))
        (folder / "report.md").write_text(render_markdown(summary, examples, "loss.png"))
        (folder / "examples.json").write_text(json.dumps(examples, indent=2, ensure_ascii=False))

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)


@task(name="publish_report", task_run_name="publish report", persist_result=False)  # it returns nothing
def publish_report(report_ref: ArtifactRef) -> None:
    """Show the report in the Prefect UI: Markdown with the loss curve inlined as a PNG, and a metrics table."""
    summary = report_ref.read_json("report.json")
    png = base64.b64encode(report_ref.file("loss.png").read_bytes()).decode()
    examples = report_ref.read_json("examples.json")
    if summary.get("objective") == "grpo":
        create_markdown_artifact(
            key=ui.artifact_key("report"),
            description=f"report {report_ref.key}",
            markdown=rl_report.render_markdown(summary, f"data:image/png;base64,{png}"),
        )
        create_table_artifact(
            key=ui.artifact_key("metrics"),
            table=rl_report.metric_rows(summary),
            description="before vs after fine-tuning",
        )
        return
    create_markdown_artifact(
        key=ui.artifact_key("report"),
        markdown=render_markdown(summary, examples, f"data:image/png;base64,{png}"),
        description=f"report {report_ref.key}",
    )
    rows = [
        {"metric": "eval loss", "before": summary["baseline"]["loss"], "after": summary["final"]["loss"]},
        {"metric": "perplexity", "before": summary["baseline"]["perplexity"], "after": summary["final"]["perplexity"]},
        {"metric": "exact match", "before": summary["exact_match"]["before"], "after": summary["exact_match"]["after"]},
    ]
    if "preference" in summary:
        p = summary["preference"]
        rows = [
            {"metric": f"preference accuracy ({p['objective']})", **p["accuracy"]},
            {"metric": "reward margin", **p["margin"]},
            {"metric": f"{p['objective']} loss", **p["loss"]},
            *rows,
        ]
    create_table_artifact(key=ui.artifact_key("metrics"), table=rows, description="before vs after fine-tuning")
