"""Refs for what enters the pipeline from outside the store: models and datasets.

A hub id is keyed by id and revision, a local file or folder by its content, never by
its path, so moving a checkout keeps the cache and editing a file invalidates it.
"""

from __future__ import annotations

from pathlib import Path

from jaxtune.artifacts import ArtifactRef, artifact_key, file_digest, tree_digest
from jaxtune.config import OFFLINE, DataConfig, ModelConfig
from jaxtune.data.rows import OFFLINE_DATA


def dataset_ref(cfg: DataConfig) -> ArtifactRef:
    if cfg.source == OFFLINE:
        return ArtifactRef(stage="source", key=file_digest(OFFLINE_DATA)[:20], path=str(OFFLINE_DATA))
    path = Path(cfg.source).expanduser()
    if path.is_file():
        return ArtifactRef(stage="source", key=file_digest(path)[:20], path=str(path.resolve()))
    hub = {"dataset": cfg.source, "revision": cfg.revision, "split": cfg.hub_split}
    return ArtifactRef(stage="hub", key=artifact_key("hub-dataset", "1", hub, {}), path=cfg.source)


GGUF = "gguf"  # stage name of a ref to a local GGUF file, which the import_gguf stage turns into a folder


def model_ref(cfg: ModelConfig) -> ArtifactRef:
    """For a hub id, a local model folder or a local .gguf file; the offline model comes from the build_model stage."""
    path = Path(cfg.name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.name {cfg.name!r}: no such GGUF file")
        return ArtifactRef(stage=GGUF, key=file_digest(path)[:20], path=str(path.resolve()))
    if path.is_dir():
        digest = tree_digest(path, exclude={".git", ".cache"})
        return ArtifactRef(stage="source", key=digest[:20], path=str(path.resolve()))
    if cfg.name.count("/") != 1:
        raise FileNotFoundError(
            f"model.name {cfg.name!r} is neither a local folder, a .gguf file nor a hub id like 'google/gemma-3-1b-it'"
        )
    hub = {"model": cfg.name, "revision": cfg.revision}
    return ArtifactRef(stage="hub", key=artifact_key("hub-model", "1", hub, {}), path=f"{cfg.name}@{cfg.revision}")


MODEL_INPUT = "(the model input)"


def keyed_model(cfg: ModelConfig) -> ModelConfig:
    """`cfg` as stage sections hash it: a real model is known to each stage by its `model` input,
    whose key hashes the weights (or hub id and revision), so its name, a path that may move or a
    hub id already keyed, is left out. Stages find the model through that input, never the name."""
    return cfg if cfg.name == OFFLINE else cfg.model_copy(update={"name": MODEL_INPUT})


def pretrained_location(ref: ArtifactRef) -> tuple[str, str | None]:
    """(name or folder, revision) to hand to `from_pretrained`."""
    if ref.stage == "hub":
        name, _, revision = ref.path.rpartition("@")
        return name, revision
    return ref.path, None


def open_tokenizer(ref: ArtifactRef, cfg: ModelConfig):
    """The model's tokenizer, with `model.chat_template` applied when the config sets one."""
    from transformers import AutoTokenizer

    from jaxtune.data.templates import apply_chat_template_setting

    name, revision = pretrained_location(ref)
    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=cfg.trust_remote_code)
    return apply_chat_template_setting(tokenizer, cfg.chat_template)
