"""Loading a decoder layer at a time (`runtime.modeling.streaming`): the model is `from_pretrained`'s,
tensor for tensor, for single-file and sharded checkpoints, tied and untied embeddings and GPT-2's
unprefixed keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jaxtune.config import TinyModelConfig
from jaxtune.offline.architectures import tiny_config
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.modeling import streaming
from tests.conftest import BOS, EOS, PAD, VOCAB

pytestmark = pytest.mark.quant


def config_of(family: str, tied: bool, layers: int = 2, hidden: int = 64, intermediate: int = 128):
    if family == "qwen2":  # no offline family of its own: Qwen2's config, sized alike
        return AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=tied, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    shape = TinyModelConfig(architecture=family, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                            vocab_size=VOCAB, tie_word_embeddings=tied)
    return tiny_config(family, shape, VOCAB, PAD, BOS, EOS)


def saved(folder: Path, family: str, tied: bool = False, sharded: bool = False, shard: str = "40KB", **sizes) -> str:
    """A random model saved as save_pretrained saves it: one file, or shards of about one layer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(family, tied, **sizes), dtype=torch.float32)
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(folder, max_shard_size=shard if sharded else "50GB")  # 40KB: about a tensor a file
    assert (folder / "model.safetensors.index.json").exists() == sharded
    return str(folder)


@pytest.fixture
def streamed_only(monkeypatch):
    """Loading whole fails the test: what is compared is the streamed load, not the fallback."""
    def refuse(*args, **kwargs):
        raise AssertionError("loaded whole, not a layer at a time")

    monkeypatch.setattr(streaming, "load_whole", refuse)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same_model(ours: torch.nn.Module, theirs: torch.nn.Module, same_folder: bool = True) -> None:
    ours_t, theirs_t = tensors(ours), tensors(theirs)
    assert list(ours_t) == list(theirs_t)
    for name, expected in theirs_t.items():
        assert ours_t[name].dtype == expected.dtype and torch.equal(ours_t[name], expected), name
    ids = torch.arange(3, 27).reshape(2, 12)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
    if same_folder:  # else the folder each was read from differs
        assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert not ours.training


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2"])
def test_the_streamed_model_is_from_pretrained_s(tmp_path, streamed_only, family, tied, sharded):
    folder = saved(tmp_path, family, tied, sharded)
    for dtype in ("float32", "bfloat16"):
        theirs = rt_model.load_torch_model(folder, None, False, dtype)
        ours = streaming.load_model(folder, None, False, dtype)
        assert_same_model(ours, theirs)
        assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied
        assert all(t.device.type == "cpu" for t in tensors(ours).values())


def test_gpt2_s_original_keys_without_the_model_prefix_load(tmp_path, streamed_only):
    """openai-community/gpt2's own file names its tensors `h.0.attn.c_attn.weight`, `wte.weight`: the
    mapping transformers applies (its base model prefix) applies here too."""
    from safetensors.torch import save_file

    folder = Path(saved(tmp_path / "saved", "gpt2", tied=True))
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    original = tmp_path / "original"
    original.mkdir()
    save_file({key.removeprefix("transformer."): value for key, value in state.items()}, str(original / "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        (original / name).write_text((folder / name).read_text())
    assert not any(key.startswith("transformer.") for key in load_file(str(original / "model.safetensors")))
    theirs = rt_model.load_torch_model(str(original), None, False)
    assert_same_model(streaming.load_model(str(original), None), theirs)
    assert_same_model(theirs, rt_model.load_torch_model(str(folder), None, False), same_folder=False)


def test_what_cannot_be_mapped_is_loaded_by_from_pretrained(tmp_path, caplog):
    """A checkpoint whose keys name no layer of the model: the loader says why and leaves it to from_pretrained."""
    from safetensors.torch import load_file, save_file

    folder = Path(saved(tmp_path, "llama"))
    state = load_file(str(folder / "model.safetensors"))
    save_file({key.replace("mlp.up_proj", "mlp.w3"): value for key, value in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO", logger=streaming.__name__):
        ours = streaming.load_model(str(folder), None)
    assert "loading" in caplog.text and "whole with from_pretrained: checkpoint keys do not map" in caplog.text
    assert "up_proj" in caplog.text
    assert not ours.training
