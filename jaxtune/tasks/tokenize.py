"""Stage `tokenize`: raw rows -> train.arrow, eval.arrow and stats.json."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import DataConfig, ModelConfig, Section
from jaxtune.data.rows import read_rows
from jaxtune.data.tokenize import tokenize_dataset, write_arrow
from jaxtune.tasks.sources import open_tokenizer
from jaxtune.tasks.stage import build_artifact

STAGE = "tokenize"


class TokenizeSection(Section):
    data: DataConfig
    chat_template: str | None  # model.chat_template: it decides every token of every row
    trust_remote_code: bool = False  # model.trust_remote_code: a tokenizer may ship its own code

    @classmethod
    def of(cls, data: DataConfig, model: ModelConfig) -> TokenizeSection:
        # Packing changes how the train stage batches the tokens, not the tokens: it is left out of this key.
        return cls(data=data.model_copy(update={"packing": DataConfig().packing}), chat_template=model.chat_template,
                   trust_remote_code=model.trust_remote_code)


@task(name=STAGE, result_serializer="json")
def tokenize(section: TokenizeSection, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `data` (the rows' source) and `model` (whose tokenizer and chat template are used)."""

    def build(folder: Path) -> None:
        from jaxtune.data.templates import require_chat_template

        tokenizer = open_tokenizer(inputs["model"], ModelConfig(chat_template=section.chat_template,
                                                                trust_remote_code=section.trust_remote_code))
        require_chat_template(tokenizer, inputs["model"].path)
        examples = read_rows(section.data, inputs["data"].path)
        train_rows, eval_rows, stats = tokenize_dataset(examples, tokenizer, section.data)
        write_arrow(train_rows, folder / "train.arrow")
        write_arrow(eval_rows, folder / "eval.arrow")
        (folder / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
        get_run_logger().info(
            "%d rows in: %d train, %d eval, dropped %s, truncated %d", stats["rows_in"], stats["train_rows"],
            stats["eval_rows"], {k: v for k, v in stats["dropped"].items() if v}, stats["truncated"],
        )

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)

