"""What `jaxtune chat` and `jaxtune generate` open: an artifact of the store (report, export or
train) or a base model (hub id, local HF folder, .gguf file), as a JAX model and its tokenizer.

A report names its export; an export is a PEFT adapter over its base or a whole HF model; a
train artifact is its base model with the trained weights (LoRA from method.json) applied.
The base model of an export or train artifact is found through its manifest (the `model`
input's key and the `model` config), in the same store, so a moved store still opens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jaxtune.artifacts import ArtifactRef
from jaxtune.artifacts.store import MANIFEST
from jaxtune.config import OFFLINE, MeshConfig, ModelConfig
from jaxtune.errors import SourceError


@dataclass
class Opened:
    model: Any  # runtime.modeling.model.JaxModel
    tokenizer: Any
    description: str  # what was opened, for the user


def open_source(source: str, store_root: str | Path) -> Opened:
    """`source` as a JAX model and its tokenizer; a .gguf file is imported into `store_root` once."""
    path = Path(source).expanduser()
    if (path / MANIFEST).is_file():
        return _open_artifact(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: neither an artifact folder ({MANIFEST}) nor an HF model folder (config.json)")
        return _open_base(str(path.resolve()), None, str(path))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise SourceError(f"{path}: no such .gguf file")
        from jaxtune.tasks.import_gguf import imported
        from jaxtune.tasks.sources import model_ref

        ref = imported(store_root, model_ref(ModelConfig(name=str(path))))
        return _open_base(ref.path, None, f"{path} (imported as {ref.path})")
    if path.exists():
        raise SourceError(f"{path}: not a folder or a .gguf file")
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise SourceError(f"{source}: no such file or folder, and not a hub id like 'google/gemma-3-1b-it'")
    return _open_base(source, "main", source)


def _manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SourceError(f"{folder / MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("inputs"), dict):
        raise SourceError(f"{folder / MANIFEST}: not an artifact manifest")
    return manifest


def _open_artifact(folder: Path) -> Opened:
    manifest = _manifest(folder)
    stage = manifest.get("stage")
    if stage == "report":
        key = manifest["inputs"].get("export")
        export = _store_root(folder) / "export" / str(key)
        if not key or not (export / MANIFEST).is_file():
            raise SourceError(f"{folder}: the export artifact this report names is missing ({export})")
        return _open_export(export, _manifest(export))
    if stage == "export":
        return _open_export(folder, manifest)
    if stage == "train":
        return _open_train(folder, manifest)
    if stage in ("build_model", "import_gguf"):  # these artifacts are HF model folders themselves
        return _open_base(str(folder), None, str(folder))
    raise SourceError(
        f"{folder}: a {stage!r} artifact; chat and generate open report, export or train artifacts or a model"
    )


def _store_root(folder: Path) -> Path:
    return folder.resolve().parent.parent  # artifacts live at STORE/<stage>/<key>/


def _model_config(folder: Path, manifest: dict) -> ModelConfig:
    try:
        return ModelConfig.model_validate(manifest["config"]["model"])
    except (KeyError, TypeError, ValidationError) as e:
        raise SourceError(f"{folder / MANIFEST}: no usable model config ({str(e).splitlines()[0]})") from None


def _base_ref(folder: Path, manifest: dict, cfg: ModelConfig) -> ArtifactRef:
    """The base model an export or train artifact was made from, as the pipeline referred to it.

    A model the store built (the offline model, an imported .gguf file) is found by its key in
    the same store, so a moved store still opens; a hub id or local folder, which stage sections
    do not name, by what the artifact records: export.json's or method.json's `base_model`.
    """
    key = manifest["inputs"].get("model")
    if not key:
        raise SourceError(f"{folder / MANIFEST}: names no base model input")
    root = _store_root(folder)
    for stage in ("build_model", "import_gguf"):
        if (root / stage / key).is_dir():
            return ArtifactRef(stage=stage, key=key, path=str(root / stage / key))
    if cfg.name == OFFLINE:
        raise SourceError(f"{folder}: its base model {root / 'build_model' / key} is missing from the store")
    record = next((folder / name for name in ("export.json", "method.json") if (folder / name).is_file()), None)
    base = json.loads(record.read_text(encoding="utf-8")).get("base_model") if record is not None else None
    if not base:
        raise SourceError(f"{folder}: records no base_model and its base {key} is not in the store")
    if Path(base).is_dir():
        return ArtifactRef(stage="source", key=key, path=base)
    return ArtifactRef(stage="hub", key=key, path=f"{base}@{cfg.revision}")


def _open_export(folder: Path, manifest: dict) -> Opened:
    from transformers import AutoTokenizer

    from jaxtune.runtime.modeling.model import load_torch_model
    from jaxtune.tasks.sources import pretrained_location

    try:
        info = json.loads((folder / "export.json").read_text(encoding="utf-8"))
        sub = folder / info["subfolder"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{folder / 'export.json'}: missing or malformed ({e})") from None
    cfg = _model_config(folder, manifest)
    if info.get("kind") == "peft_adapter":
        from peft import PeftModel

        name, revision = pretrained_location(_base_ref(folder, manifest, cfg))
        module = PeftModel.from_pretrained(
            load_torch_model(name, revision, cfg.trust_remote_code, "float32"), str(sub)
        ).eval()
        description = f"{folder} (LoRA adapter on {name})"
    else:
        module = load_torch_model(str(sub), None, cfg.trust_remote_code, "float32")
        description = f"{folder} (full model)"
    # The export's tokenizer carries the chat template the run trained with.
    tokenizer = AutoTokenizer.from_pretrained(str(sub), trust_remote_code=cfg.trust_remote_code)
    return Opened(_to_jax(module), tokenizer, description)


def _open_train(folder: Path, manifest: dict) -> Opened:
    from jaxtune.tasks.sources import open_tokenizer
    from jaxtune.tasks.trained import method_of, open_trained_model

    cfg = _model_config(folder, manifest)
    base = _base_ref(folder, manifest, cfg)
    train = ArtifactRef(stage="train", key=str(manifest.get("key", folder.name)), path=str(folder))
    for name in ("method.json", "params.safetensors"):
        if not train.file(name).is_file():
            raise SourceError(f"{train.file(name)}: missing")
    model = open_trained_model({"model": base, "train": train}, cfg, MeshConfig())
    method, _ = method_of(train)
    return Opened(
        model, open_tokenizer(base, cfg), f"{folder} ({method} fine-tune of {base.path}, {cfg.compute_dtype})"
    )


def _open_base(name: str, revision: str | None, description: str) -> Opened:
    from transformers import AutoTokenizer

    from jaxtune.runtime.modeling.model import load_torch_model

    module = load_torch_model(name, revision, False, "float32")
    return Opened(_to_jax(module), AutoTokenizer.from_pretrained(name, revision=revision), description)


def _to_jax(module) -> Any:
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import to_jax

    return to_jax(module, make_placement(MeshConfig()))
