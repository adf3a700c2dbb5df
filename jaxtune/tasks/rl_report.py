"""The report of a GRPO run: the eval prompts' reward before and after, per reward and per
category, the prompts whose greedy answers gained and lost most, and the reward curve.

Its inputs are the report stage's; the evals' answers.json hold each prompt's greedy answer and
scores, in eval.arrow's order."""

from __future__ import annotations

from jaxtune.artifacts import ArtifactRef
from jaxtune.records import EvalMetrics, GenerateMetrics, TrainSummary

MOVED = 5  # prompts listed among those that gained most, and among those that lost most


def is_rl(inputs: dict[str, ArtifactRef]) -> bool:
    return EvalMetrics.read(inputs["final_eval"].file("metrics.json")).rewarded


def summarize(inputs: dict[str, ArtifactRef], count: int = MOVED) -> dict:
    from jaxtune.data.token_table import TokenTable

    baseline = EvalMetrics.read(inputs["baseline_eval"].file("metrics.json"))
    final = EvalMetrics.read(inputs["final_eval"].file("metrics.json"))
    train = TrainSummary.read(inputs["train"].file("summary.json")).model_dump()
    export = inputs["export"].read_json("export.json")
    before, after = inputs["baseline_eval"].read_json("answers.json"), inputs["final_eval"].read_json("answers.json")
    table = TokenTable(inputs["tokenize"].file("eval.arrow"))
    prompts, answers = table.column("prompt_text"), table.column("response")
    moved = sorted(range(len(after)), key=lambda i: after[i]["reward"] - before[i]["reward"])
    rows = [
        {
            "prompt": prompts[i],
            "answer": answers[i],
            "before": before[i]["answer"],
            "after": after[i]["answer"],
            "reward_before": before[i]["reward"],
            "reward_after": after[i]["reward"],
        }
        for i in moved
    ]
    return {
        "objective": "grpo",
        "reward": {"before": baseline.reward, "after": final.reward},
        "rewards": {name: {"before": baseline.rewards[name], "after": value} for name, value in final.rewards.items()},
        "per_category": {
            c: {"prompts": m.prompts, "before": baseline.per_category[c].reward, "after": m.reward}
            for c, m in final.per_category.items()
        },
        "prompts": final.prompts,
        "exact_match": GenerateMetrics.read(inputs["generate"].file("metrics.json")).exact_match.model_dump(),
        "gained_most": rows[::-1][:count],
        "lost_most": rows[:count],
        "train": {
            k: train[k]
            for k in (
                "steps",
                "seconds",
                "sample_seconds",
                "update_seconds",
                "answers_per_step",
                "prompts_per_rollout",
                "row_length",
                "trainable_parameters",
                "resumed_from",
                "reward_first_quarter",
                "reward_last_quarter",
                "mesh",
            )
        },
        "export": {"kind": export["kind"], "path": str(inputs["export"].file(export["subfolder"]))},
        "data": inputs["tokenize"].read_json("stats.json"),
        "parity": final.parity.model_dump(),
    }


def render_markdown(summary: dict, image: str) -> str:
    r, t = summary["reward"], summary["train"]
    lines = [
        "# jaxtune report: GRPO",
        "",
        f"Greedy answers to {summary['prompts']:,} held-out prompts, scored by the run's rewards, before and after.",
        "",
        "| reward | before | after |",
        "|---|---|---|",
        f"| **total** | {r['before']:.3f} | {r['after']:.3f} |",
        *[f"| {name} | {v['before']:.3f} | {v['after']:.3f} |" for name, v in summary["rewards"].items()],
        f"| exact match of the whole answer (generate stage) | {summary['exact_match']['before']:.3f} "
        f"| {summary['exact_match']['after']:.3f} |",
        "",
        f"Training: {t['steps']} steps in {t['seconds']:.1f} s ({t['sample_seconds']:.1f} s sampling, "
        f"{t['update_seconds']:.1f} s updating), {t['answers_per_step']} answers a step to {t['prompts_per_rollout']} "
        f"prompts; the sampled answers' mean reward went from {t['reward_first_quarter']:.3f} in the first quarter of "
        f"the steps to {t['reward_last_quarter']:.3f} in the last. {t['trainable_parameters']:,} trainable parameters.",
        "",
        f"![reward curve]({image})",
        "",
    ]
    if len(summary["per_category"]) > 1:
        lines += [
            "| category | prompts | before | after |",
            "|---|---|---|---|",
            *[
                f"| {c} | {m['prompts']} | {m['before']:.3f} | {m['after']:.3f} |"
                for c, m in summary["per_category"].items()
            ],
            "",
        ]
    for title, key in (("Gained most", "gained_most"), ("Lost most", "lost_most")):
        lines += [
            f"## {title}",
            "",
            "| prompt | answer | before | after | reward |",
            "|---|---|---|---|---|",
            *[
                f"| {_cell(m['prompt'])} | {_cell(m['answer'])} | {_cell(m['before'])} | {_cell(m['after'])} "
                f"| {m['reward_before']:.2f} → {m['reward_after']:.2f} |"
                for m in summary[key]
            ],
            "",
        ]
    lines += [f"Exported {summary['export']['kind']}: `{summary['export']['path']}`", ""]
    return "\n".join(lines)


def metric_rows(summary: dict) -> list[dict]:
    """The Prefect UI's before-and-after table."""
    return [
        {"metric": "reward", **summary["reward"]},
        *[{"metric": f"reward {name}", **v} for name, v in summary["rewards"].items()],
    ]


def _cell(text: str) -> str:
    return text.replace("\n", " ").replace("|", "\\|")[:120]
