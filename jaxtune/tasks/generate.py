"""Stage `generate`: greedy answers to held-out prompts before and after training, scored by exact match."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import GenerateConfig, MeshConfig, ModelConfig, Section
from jaxtune.data.templates import stop_ids
from jaxtune.data.tokenize import pad_id_of
from jaxtune.records import ExactMatch, GenerateMetrics
from jaxtune.tasks.sources import open_tokenizer
from jaxtune.tasks.stage import build_artifact
from jaxtune.tasks.trained import open_trained_model

STAGE = "generate"


class GenerateSection(Section):
    model: ModelConfig
    generate: GenerateConfig


def exact_match(output: str, reference: str) -> bool:
    """Equal after trimming surrounding whitespace; anything else counts as wrong."""
    return output.strip() == reference.strip()


def _answers(model, tokenizer, prompts: list[list[int]], cfg: GenerateConfig) -> list[str]:
    from jaxtune.runtime.decoding.inference import greedy_generate

    eos = stop_ids(tokenizer, getattr(model.module, "generation_config", None))
    tokens = greedy_generate(model, prompts, cfg.batch_size, cfg.max_new_tokens, eos, pad_id_of(tokenizer))
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


@task(name=STAGE, result_serializer="json")
def generate(
    section: GenerateSection, inputs: dict[str, ArtifactRef], store_root: str, mesh: MeshConfig
) -> ArtifactRef:
    """inputs: `model`, `data`, `train`."""

    def build(folder: Path) -> None:
        from jaxtune.data.token_table import TokenTable

        tokenizer = open_tokenizer(inputs["model"], section.model)
        table = TokenTable(inputs["data"].file("eval.arrow"))  # memory-mapped: only the prompts decoded are read
        # Preference pairs: each prompt once, from its chosen row, which is then the reference answer.
        step = 2 if inputs["data"].read_json("stats.json").get("preference") else 1
        rows = range(0, min(section.generate.num_prompts * step, len(table)), step)
        lengths = table.column("prompt_length", rows.stop)
        prompts = [table.input_ids[r][: lengths[r]].tolist() for r in rows]
        table = {name: table.column(name, rows.stop)[::step] for name in ("category", "prompt_text", "response")}
        before = _answers(
            open_trained_model({**inputs, "train": None}, section.model, mesh), tokenizer, prompts, section.generate
        )
        after = _answers(open_trained_model(inputs, section.model, mesh), tokenizer, prompts, section.generate)
        rows = [
            {
                "category": c,
                "prompt": p,
                "reference": r,
                "before": b,
                "after": a,
                "before_exact": exact_match(b, r),
                "after_exact": exact_match(a, r),
            }
            for c, p, r, b, a in zip(table["category"], table["prompt_text"], table["response"], before, after)
        ]
        with (folder / "generations.jsonl").open("w") as out:
            out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        exact = ExactMatch(
            before=sum(r["before_exact"] for r in rows) / len(rows),
            after=sum(r["after_exact"] for r in rows) / len(rows),
        )
        GenerateMetrics(prompts=len(rows), exact_match=exact).write(folder / "metrics.json")
        get_run_logger().info("exact match before %.3f after %.3f", exact.before, exact.after)

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
