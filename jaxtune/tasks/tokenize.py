"""Stage `tokenize`: raw rows -> train.arrow, eval.arrow and stats.json."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from jaxtune.artifacts import ArtifactRef
from jaxtune.config import DataConfig, ModelConfig, Section
from jaxtune.data.tokenize import pad_id_of, write_token_tables
from jaxtune.tasks.sources import data_input, open_tokenizer
from jaxtune.tasks.stage import build_artifact

STAGE = "tokenize"
_NOT_KEYED = {
    "packing": DataConfig().packing,
    "num_proc": None,
}  # change how batches are made or how fast, not the tokens


class TokenizeSection(Section):
    data: DataConfig
    chat_template: str | None  # model.chat_template: it decides every token of every row
    trust_remote_code: bool = False  # model.trust_remote_code: a tokenizer may ship its own code

    @classmethod
    def of(cls, data: DataConfig, model: ModelConfig) -> TokenizeSection:
        """The key hashes each source's content through the stage's inputs; of its name it keeps only
        what lands in the tables (the `source` column): a file's name, not where it lies."""
        if data.sources:
            named = {
                "sources": tuple(src.model_copy(update={"source": src.label, "name": None}) for src in data.sources)
            }
        else:
            named = {"source": data.mixture()[0].label}
        return cls(
            data=data.model_copy(update={**_NOT_KEYED, **named}),
            chat_template=model.chat_template,
            trust_remote_code=model.trust_remote_code,
        )


@task(name=STAGE, result_serializer="json")
def tokenize(
    section: TokenizeSection, inputs: dict[str, ArtifactRef], store_root: str, num_proc: int | None = None
) -> ArtifactRef:
    """inputs: `data` (and `data_2`, ... for a mixture: the rows' sources) and `model` (whose
    tokenizer and chat template are used). `num_proc` processes normalize and tokenize."""

    def build(folder: Path) -> None:
        from jaxtune.data.templates import require_chat_template

        tokenizer = open_tokenizer(
            inputs["model"],
            ModelConfig(chat_template=section.chat_template, trust_remote_code=section.trust_remote_code),
        )
        require_chat_template(tokenizer, inputs["model"].path)
        sources = [(src, inputs[data_input(i)].path) for i, src in enumerate(section.data.mixture())]
        cfg = section.data.model_copy(update={"num_proc": num_proc})
        # The id later stages pad these rows with, kept here so that they need not load the
        # tokenizer for one number (Gemma 3's: 2.5 s, each time).
        stats = {**write_token_tables(sources, tokenizer, cfg, folder), "pad_id": pad_id_of(tokenizer)}
        (folder / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
        logger = get_run_logger()
        logger.info(
            "%d rows in: %d train, %d eval, dropped %s, truncated %d",
            stats["rows_in"],
            stats["train_rows"],
            stats["eval_rows"],
            {k: v for k, v in stats["dropped"].items() if v},
            stats["truncated"],
        )
        if len(stats["sources"]) > 1:
            for src in stats["sources"]:
                logger.info(
                    "source %(name)s: %(rows_in)d rows in, %(train_rows)d train (weight %(weight)g), %(eval_rows)d eval",
                    src,
                )

    return build_artifact(store_root, STAGE, __name__, section, inputs, build)
