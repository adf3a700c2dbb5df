"""Loading a decoder layer at a time (`runtime.modeling.streaming`): the model is `from_pretrained`'s,
tensor for tensor, for single-file and sharded checkpoints, tied and untied embeddings and GPT-2's
unprefixed keys; a base quantized on the way holds the codes and scales `quantize_base` makes from
`from_pretrained`'s model, and `open_model` the same tensors as it did loading whole; and the
host memory it takes stays well under what loading whole takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from jaxtune.config import LoraConfig, MeshConfig, ModelConfig, TinyModelConfig
from jaxtune.offline.architectures import tiny_config
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures import parity
from jaxtune.runtime.modeling import model as rt_model
from jaxtune.runtime.modeling import quantize, streaming
from tests.conftest import BOS, EOS, PAD, VOCAB

pytestmark = pytest.mark.quant
SCHEMES = ("int8", "int4", "nf4")


def config_of(family: str, tied: bool, layers: int = 2, hidden: int = 64, intermediate: int = 128):
    if family == "qwen2":  # no offline family of its own: Qwen2's config, sized alike
        return AutoConfig.for_model(
            "qwen2",
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
        )
    shape = TinyModelConfig(
        architecture=family,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
    )
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
    save_file(
        {key.removeprefix("transformer."): value for key, value in state.items()},
        str(original / "model.safetensors"),
        metadata={"format": "pt"},
    )
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
    save_file(
        {key.replace("mlp.up_proj", "mlp.w3"): value for key, value in state.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with caplog.at_level("INFO", logger=streaming.__name__):
        ours = streaming.load_model(str(folder), None)
    assert "loading" in caplog.text and "whole with from_pretrained: checkpoint keys do not map" in caplog.text
    assert "up_proj" in caplog.text
    assert not ours.training


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_quantized_on_the_way_as_quantize_base_quantizes_the_loaded_model(tmp_path, streamed_only, family, scheme):
    folder = saved(tmp_path, family, sharded=True)
    whole = rt_model.load_torch_model(folder, None, False, "bfloat16").requires_grad_(False)
    names = quantize.quantize_base(whole, scheme)
    module, (stored, schemes) = rt_model.load_quantized(folder, None, False, "bfloat16", scheme)
    assert list(schemes) == names and set(schemes.values()) == {scheme}
    expected = {
        f"{layer}.{field}": tensor for layer in names for field, tensor in whole.get_submodule(layer).tensors().items()
    }
    assert list(stored) == list(expected)
    for key, tensor in expected.items():
        assert stored[key].dtype == tensor.dtype and torch.equal(stored[key], tensor), key
    for layer in names:  # the float weights are gone: one value each
        assert streaming.is_placeholder(module.get_submodule(layer).weight)
        assert module.get_submodule(layer).weight.untyped_storage().nbytes() == 2


def assert_same_jax_model(ours: rt_model.JaxModel, theirs: rt_model.JaxModel) -> None:
    for kind in ("weights", "buffers"):
        ours_t, theirs_t = getattr(ours, kind), getattr(theirs, kind)
        assert list(ours_t) == list(theirs_t), kind
        for name, expected in theirs_t.items():
            assert ours_t[name].dtype == expected.dtype and np.array_equal(
                np.asarray(ours_t[name]), np.asarray(expected)
            ), name
    assert ours.casts == theirs.casts and str(ours.module) == str(theirs.module)
    ids = np.arange(3, 27, dtype=np.int32).reshape(2, 12)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    np.testing.assert_array_equal(parity.jax_logits(ours, inputs), parity.jax_logits(theirs, inputs))


@pytest.mark.parametrize(
    "scheme, lora",
    [
        ("int4", LoraConfig(r=4, target_modules="all-linear")),
        ("nf4", LoraConfig(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=("up_proj",))),
        ("int8", None),
    ],
)
def test_open_model_holds_what_it_held_loading_whole(tmp_path, scheme, lora):
    """As open_model did before it streamed: load whole, attach LoRA, quantize the frozen base. q and
    v's LoRA wraps them (`base_layer`); up_proj, saved whole by LoRA, is held quantized as its frozen
    original and trained in full as its copy."""
    folder = saved(tmp_path, "llama", sharded=True)
    cfg = ModelConfig(name=folder, base_quantization=scheme, dtype="bfloat16")
    placement = make_placement(MeshConfig())
    module = rt_model.load_torch_model(folder, None, False, "bfloat16")
    module = rt_model.attach_lora(module, lora) if lora is not None else module.requires_grad_(False)
    quantize.quantize_base(module, scheme)
    theirs = rt_model.to_jax(module, placement, scan_layers=cfg.layers_stacked)  # auto: stacked over a quantized base
    ours = rt_model.open_model(folder, None, cfg, placement, lora=lora)
    assert_same_jax_model(ours, theirs)
    if lora is not None and lora.modules_to_save:
        assert any(name.endswith("up_proj.original_module.codes") for name in ours.buffers)
        assert any(name.endswith("up_proj.modules_to_save.default.weight") for name in ours.weights)


def test_open_model_reads_the_stored_base_instead_of_the_layers_it_replaces(tmp_path, streamed_only, monkeypatch):
    """With the quantize_base stage's tensors, the layers they replace keep no float weight while loading."""
    folder = saved(tmp_path, "gemma3")
    whole = rt_model.load_torch_model(folder, None, False, "bfloat16").requires_grad_(False)
    schemes = dict.fromkeys(quantize.quantize_base(whole, "int4"), "int4")
    stored = {f"{layer}.{field}": t for layer in schemes for field, t in whole.get_submodule(layer).tensors().items()}
    lora = LoraConfig(r=4, target_modules="all-linear")
    placement = make_placement(MeshConfig())
    module = rt_model.attach_lora(rt_model.load_torch_model(folder, None, False, "bfloat16"), lora)
    quantize.load_base(module, stored, schemes)
    cfg = ModelConfig(name=folder, base_quantization="int4", dtype="bfloat16")
    theirs = rt_model.to_jax(module, placement, scan_layers=cfg.layers_stacked)

    dropped = []
    drop = streaming._drop_weight
    monkeypatch.setattr(streaming, "_drop_weight", lambda linear: dropped.append(linear) or drop(linear))
    assert_same_jax_model(rt_model.open_model(folder, None, cfg, placement, lora=lora, base=(stored, schemes)), theirs)
    assert len(dropped) == len(schemes)


# The memory bound, measured in a child process: its peak resident memory (VmHWM, reset after a
# first load of a one-layer model has imported and set up what loading needs) while loading, less
# its resident memory before. The checkpoint is float32, the compute dtype bfloat16 (a TPU's), so
# loading whole copies every weight (float32 loaded as float32 would stay mapped from the file,
# not read, until used).
MEMORY_CHILD = r"""
import json, sys, torch
from jaxtune.runtime.modeling import model as rt_model, quantize

def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))

def load(folder, how):
    if how in ("int4", "nf4"):
        return rt_model.load_quantized(folder, None, False, "bfloat16", how)
    module = rt_model.load_torch_model(folder, None, False, "bfloat16").requires_grad_(False)
    if how == "whole_then_int4":  # what open_model and the quantize_base stage did before streaming
        quantize.quantize_base(module, "int4")
    return module

folder, warm_up, how = sys.argv[1:]
torch.set_num_threads(1)
load(warm_up, how)
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
before = rss("VmRSS")
loaded = load(folder, how)
print(json.dumps({"peak": rss("VmHWM") - before}))
"""


def load_peak(folder: str, warm_up: str, how: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, folder, warm_up, how],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak reset")
def test_a_4_bit_base_loads_in_a_fraction_of_the_memory_that_loading_whole_takes(tmp_path):
    """A Llama of 32 layers of width 256 and 1024 (attention: 4 heads of 16), in shards of 10 MB:
    26.8M parameters, 53.6 MB in bfloat16, 14 MB as int4. Loading whole holds every bfloat16 weight at
    once; streaming, the base as quantized so far, one layer's weights (1.7 MB in bfloat16, read as
    float32) and the temporaries of quantizing 1024 rows."""
    folder = saved(tmp_path / "model", "llama", sharded=True, shard="10MB", layers=32, hidden=256, intermediate=1024)
    # one layer of the same widths: the quantizer's programs for these weights' shapes are compiled before the
    # measured load, which then holds what streaming holds, not a one-time compile's temporaries
    warm_up = saved(tmp_path / "warm_up", "llama", layers=1, hidden=256, intermediate=1024)
    size = (
        2
        * AutoModelForCausalLM.from_config(
            config_of("llama", False, 32, 256, 1024), dtype=torch.float32
        ).num_parameters()
    )
    assert 53e6 < size < 55e6
    peaks = {how: load_peak(folder, warm_up, how) for how in ("int4", "nf4", "from_pretrained", "whole_then_int4")}
    print({how: f"{peak / 2**20:.1f} MiB" for how, peak in peaks.items()}, f"bfloat16 model {size / 2**20:.1f} MiB")
    assert peaks["from_pretrained"] > 0.9 * size
    for scheme in ("int4", "nf4"):
        assert peaks[scheme] < 0.7 * size and peaks[scheme] < 0.3 * peaks["from_pretrained"], scheme
    assert peaks["whole_then_int4"] > 0.9 * size  # what the bound tells apart
