"""bf16 weights for real models, fp32 for the offline one, and neither leaks into the process."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxtune.config import LoraConfig, MeshConfig, ModelConfig
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling import model as rt_model
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return str(path)


def test_auto_dtype_is_bf16_for_real_models_and_fp32_offline():
    assert ModelConfig().compute_dtype == "float32"  # the offline default
    assert ModelConfig(name="google/gemma-3-1b-it").compute_dtype == "bfloat16"
    assert ModelConfig(name="google/gemma-3-1b-it", dtype="float32").compute_dtype == "float32"


def test_bf16_load_is_scoped_to_its_model(model_dir):
    cfg = ModelConfig(name=model_dir)
    jm = rt_model.open_model(model_dir, None, cfg, make_placement(MeshConfig()), lora=LoraConfig(r=4))
    assert jm.dtype == jnp.bfloat16
    frozen = [v for k, v in jm.buffers.items() if k.endswith(".weight")]
    assert frozen and {v.dtype for v in frozen} == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for v in jm.weights.values()} == {jnp.dtype(jnp.float32)}  # LoRA adapters: fp32
    # Nothing process-wide changed: torch's and JAX's defaults, and the next model's dtype.
    assert torch.get_default_dtype() == torch.float32
    assert torch.zeros(1).dtype == torch.float32 and jnp.zeros(1).dtype == jnp.float32
    again = rt_model.load_torch_model(model_dir, None, False)
    assert {p.dtype for p in again.parameters()} == {torch.float32}


def test_bf16_model_evaluates_close_to_fp32(model_dir):
    """A bf16 forward stays within bf16 rounding of the fp32 one (logits ~0.7 here, rounding ~1e-2)."""
    from jaxtune.runtime.measures import parity

    placement = make_placement(MeshConfig())
    bf16 = rt_model.open_model(model_dir, None, ModelConfig(name=model_dir), placement)
    fp32 = rt_model.open_model(model_dir, None, ModelConfig(name=model_dir, dtype="float32"), placement)
    ids = np.random.default_rng(0).integers(3, 256, (2, 24)).astype(np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    diff = np.abs(parity.jax_logits(bf16, batch) - parity.jax_logits(fp32, batch)).max()
    assert 1e-5 < diff < 5e-2, diff
