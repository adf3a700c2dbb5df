"""The accelerator benchmark's random weights, built one layer at a time (benchmarks/accelerator/shared.py
`build_weights`): the folder holds what `from_config(...).save_pretrained` would write, initialised as
from_config initialises, the same bytes every time, without the whole model ever in host memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.accelerator import shared
from benchmarks.accelerator.shared import Settings, build_weights, model_config

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("gemma-3-1b", "llama-3.2-1b")


def untied(settings: Settings):
    """The tiny llama's config with a head of its own (the shipped configs all tie it to the embedding)."""
    config = model_config(settings)
    config.tie_word_embeddings = False
    return config


def read(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder, sharded or not."""
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    tensors = {}
    for shard in shards or ["model.safetensors"]:
        with safe_open(folder / shard, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("model,tie", [("gemma-3-1b", True), ("llama-3.2-1b", True), ("llama-3.2-1b", False)])
def test_folder_is_what_save_pretrained_writes(model, tie, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    if not tie:
        monkeypatch.setattr(shared, "model_config", untied)
    settings = Settings.make(model, tiny=True)
    built = build_weights(settings, tmp_path / "built")
    reference = AutoModelForCausalLM.from_config(shared.model_config(settings), dtype=torch.float32)
    reference.save_pretrained(tmp_path / "reference")

    ours, theirs = read(tmp_path / "built"), read(tmp_path / "reference")
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert ("lm_head.weight" in ours) is not tie
    index = json.loads((tmp_path / "built" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ours.values())
    for shard in set(index["weight_map"].values()):
        with safe_open(tmp_path / "built" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(index["weight_map"][name] == shard for name in f.keys())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "built" / name).read_text()) == json.loads(
            (tmp_path / "reference" / name).read_text()
        )
    assert built["parameters"] == sum(p.numel() for p in reference.parameters())
    assert built["vocab_size"] == reference.config.vocab_size

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "built", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie


@pytest.mark.parametrize("model", MODELS)
def test_values_are_from_configs_initialisation(model, tmp_path):
    settings = Settings.make(model, tiny=True)
    config = model_config(settings)
    build_weights(settings, tmp_path)
    tensors = read(tmp_path)
    std = config.initializer_range
    norm = 0.0 if model.startswith("gemma") else 1.0  # Gemma's RMSNorm scales by 1 + weight
    matrices = [name for name, t in tensors.items() if t.ndim == 2]
    assert len(matrices) == 1 + 7 * config.num_hidden_layers  # the embedding, each layer's 4 + 3 projections
    for name in matrices:
        values = tensors[name]
        if name == "model.embed_tokens.weight" and config.pad_token_id is not None:
            assert not values[config.pad_token_id].any()  # the padding row, as nn.Embedding's init leaves it
            values = torch.cat([values[: config.pad_token_id], values[config.pad_token_id + 1 :]])
        assert abs(values.std().item() - std) < 0.2 * std, name
        assert abs(values.mean().item()) < 0.2 * std, name
    norms = [name for name in tensors if "norm" in name]
    assert norms and all(torch.equal(tensors[n], torch.full_like(tensors[n], norm)) for n in norms)
    # every group draws from a seed of its own: no two layers alike
    q = [tensors[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(config.num_hidden_layers)]
    assert not torch.equal(q[0], q[1])


def test_same_bytes_every_time_and_whatever_else_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "model_config", untied)  # a head of its own: a group written after the layers
    settings = Settings.make("llama-3.2-1b", tiny=True)
    build_weights(settings, tmp_path / "one")
    build_weights(settings, tmp_path / "two")
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name

    # a third layer changes nothing else: not the layers before it, nor the groups after it (final norm, head)
    monkeypatch.setitem(shared.TINY_SIZES, "num_hidden_layers", 3)
    build_weights(settings, tmp_path / "three")
    two, three = read(tmp_path / "one"), read(tmp_path / "three")
    assert set(two) < set(three) and "lm_head.weight" in two
    assert all(torch.equal(two[name], three[name]) for name in two)


# A child process builds a Gemma of 8 layers of about 16 MB each (float32) and reports how far its resident memory
# rose above where it stood before: a layer or so (the layer's tensors while safetensors writes them), not the model.
# The peak is measured from a reset of the kernel's high-water mark (VmHWM), not from ru_maxrss: the imports can peak
# higher than the whole build (seen under this suite's environment), which would hide any growth.
MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys, tempfile
    from pathlib import Path
    from benchmarks.accelerator import shared

    def status(field):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    with tempfile.TemporaryDirectory() as folder:
        shared.build_weights(shared.Settings.make("gemma-3-1b", tiny=True), Path(folder) / "warm")  # the imports
        shared.TINY_SIZES.update(hidden_size=512, intermediate_size=2048, head_dim=128)
        config = shared.model_config(shared.Settings.make("gemma-3-1b", tiny=True))
        config.num_hidden_layers, config.layer_types = 8, ["sliding_attention", "full_attention"] * 4
        shared.model_config = lambda settings: config
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status("VmRSS")
        built = shared.build_weights(shared.Settings.make("gemma-3-1b", tiny=True), Path(folder) / "big")
        growth = status("VmHWM") - before
        total = sum(shard.stat().st_size for shard in (Path(folder) / "big").glob("*.safetensors"))
        print(json.dumps({"growth": growth, "total": total, "parameters": built["parameters"]}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures memory through Linux's /proc")
def test_host_memory_stays_near_one_layer():
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert 4 * figures["parameters"] > 120e6  # float32
    assert abs(figures["total"] / (4 * figures["parameters"]) - 1) < 0.01  # every tensor, and small headers
    assert figures["growth"] < 0.3 * figures["total"], figures  # 13.8 MB of 127 MB seen; the whole-model build 1.0
