"""The sharding rules as a table, without devices: names of several model families, LoRA and
PEFT wrappers, dimensions that do not divide, `mesh.shardings` overrides, and mesh sizes."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from jaxtune.config import MeshConfig, load_config
from jaxtune.errors import ConfigError
from jaxtune.runtime.devices.sharding import layer_of, spec_for

pytestmark = pytest.mark.mesh

MESH = {"data": 2, "fsdp": 4, "tensor": 2}


@pytest.mark.parametrize(
    ("name", "shape", "spec"),
    [
        ("model.layers.3.self_attn.q_proj.weight", (2048, 1024), P("tensor", "fsdp")),
        ("model.layers.3.self_attn.o_proj.weight", (1024, 2048), P("fsdp", "tensor")),
        ("model.layers.3.mlp.up_proj.weight", (4096, 1024), P("tensor", "fsdp")),
        ("model.layers.3.mlp.down_proj.weight", (1024, 4096), P("fsdp", "tensor")),
        ("model.layers.3.self_attn.q_proj.bias", (2048,), P("tensor")),  # Qwen's q/k/v biases follow their output
        ("model.layers.3.self_attn.o_proj.bias", (1024,), P()),
        ("model.embed_tokens.weight", (32000, 1024), P(None, ("fsdp", "tensor"))),
        ("lm_head.weight", (32000, 1024), P("tensor", "fsdp")),
        ("model.layers.3.input_layernorm.weight", (1024,), P()),
        ("model.norm.weight", (1024,), P()),
        ("model.rotary_emb.inv_freq", (32,), P()),
        (
            "model.vision_tower.patch_embedding.weight",
            (1152, 3, 14, 14),
            P("fsdp"),
        ),  # any other array: fsdp on its largest dim
        ("some.other.matrix", (12, 64), P(None, "fsdp")),
    ],
)
def test_built_in_rules_by_name(name, shape, spec):
    assert spec_for(name, shape, MESH) == spec


def test_gpt2_conv1d_weights_are_stored_in_out_and_split_accordingly():
    assert spec_for("transformer.h.0.attn.c_attn.weight", (768, 2304), MESH, transposed=True) == P("fsdp", "tensor")
    assert spec_for("transformer.h.0.mlp.c_proj.weight", (3072, 768), MESH, transposed=True) == P("tensor", "fsdp")
    assert spec_for("transformer.wte.weight", (50257, 768), MESH) == P(None, ("fsdp", "tensor"))


def test_lora_factors_follow_their_base_layer():
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert spec_for(f"{q}.base_layer.weight", (2048, 1024), MESH) == P("tensor", "fsdp")
    assert spec_for(f"{q}.lora_A.default.weight", (16, 1024), MESH) == P(None, "fsdp")  # (r, in): in like the base
    assert spec_for(f"{q}.lora_B.default.weight", (2048, 16), MESH) == P("tensor")  # (out, r): out like the base
    o = "base_model.model.model.layers.0.self_attn.o_proj"
    assert spec_for(f"{o}.lora_A.default.weight", (16, 2048), MESH) == P(None, "tensor")
    assert spec_for(f"{o}.lora_B.default.weight", (1024, 16), MESH) == P("fsdp")
    saved = "base_model.model.lm_head.modules_to_save.default.weight"
    assert layer_of(saved) == ("lm_head.weight", None)
    assert spec_for(saved, (32000, 1024), MESH) == P("tensor", "fsdp")


def test_a_dimension_that_does_not_divide_stays_whole():
    gemma_1b_k = "model.layers.0.self_attn.k_proj.weight"  # one KV head of 256
    assert spec_for(gemma_1b_k, (256, 1152), {"data": 1, "fsdp": 1, "tensor": 3}) == P()
    assert spec_for(gemma_1b_k, (256, 1152), {"data": 1, "fsdp": 3, "tensor": 2}) == P("tensor", "fsdp")
    # The embedding keeps as much of fsdp x tensor as divides its hidden size.
    assert spec_for("model.embed_tokens.weight", (262144, 96), {"data": 1, "fsdp": 4, "tensor": 16}) == P(None, "fsdp")
    assert spec_for("model.embed_tokens.weight", (262144, 96), {"data": 8, "fsdp": 1, "tensor": 1}) == P()


def test_an_override_wins_and_a_wrong_one_names_the_tensor_and_pattern():
    overrides = {r"lm_head\.weight$": ["fsdp", None], r"q_proj": [None, None]}
    assert spec_for("lm_head.weight", (32000, 1024), MESH, overrides) == P("fsdp")
    assert spec_for("model.layers.0.self_attn.q_proj.weight", (2048, 1024), MESH, overrides) == P()
    assert spec_for("model.layers.0.self_attn.k_proj.weight", (512, 1024), MESH, overrides) == P("tensor", "fsdp")
    with pytest.raises(ValueError, match=r"mesh.shardings\['q_proj'\] gives 2 axes but .*q_proj.bias has 1 dimensions"):
        spec_for("model.layers.0.self_attn.q_proj.bias", (2048,), MESH, overrides)
    with pytest.raises(
        ValueError, match=r"lm_head.weight dimension 32001 does not divide over the 4 devices of the fsdp axis"
    ):
        spec_for("lm_head.weight", (32001, 1024), MESH, overrides)


def test_overrides_and_axes_are_checked_when_the_config_loads():
    config = load_config(None, ['mesh.shardings={"lm_head\\\\.weight$": [tensor, null]}', "mesh.fsdp=2"])
    assert config.mesh.shardings == {r"lm_head\.weight$": ["tensor", None]}
    with pytest.raises(ConfigError, match="unknown axis 'model'"):
        load_config(None, ['mesh.shardings={"lm_head": [model, null]}'])
    assert load_config(None, ["mesh.fsdp=-1"]).mesh.sizes(8) == {"data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(ConfigError, match="at most one of mesh.data, mesh.fsdp, mesh.tensor can be -1"):
        load_config(None, ["mesh.data=-1", "mesh.fsdp=-1"])


def test_mesh_sizes_resolve_minus_one_and_refuse_what_does_not_fit():
    assert MeshConfig().sizes(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert MeshConfig(data=1, fsdp=-1, tensor=2).sizes(8) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert MeshConfig(data=2, fsdp=1, tensor=1).sizes(8) == {"data": 2, "fsdp": 1, "tensor": 1}  # uses 2 of 8
    with pytest.raises(ValueError, match="mesh data=-1, fsdp=3, tensor=1 does not fit 8 devices"):
        MeshConfig(fsdp=3).sizes(8)
    with pytest.raises(ValueError, match="mesh data=4, fsdp=4, tensor=1 does not fit 8 devices"):
        MeshConfig(data=4, fsdp=4).sizes(8)
