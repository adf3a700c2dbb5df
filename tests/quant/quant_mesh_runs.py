"""Run with 4 fake CPU devices: LoRA over an int4 base on one device and on a (data, fsdp,
tensor) = (1, 2, 2) mesh, the loss and LoRA gradients of one batch from each, and where a
quantized layer's codes and scales went; prints them as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.quant.quant_mesh_runs
"""

from __future__ import annotations

import json

CODES = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"


def run(sizes: tuple[int, int, int]) -> dict:
    import numpy as np

    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import parity
    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.modeling import quantize
    from tests.quant.test_quantized_base import batch, lora_model

    data, fsdp, tensor = sizes
    module = lora_model("llama")
    quantize.quantize_base(module, "int4")
    model = rt_model.to_jax(module, make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor)))
    ids, labels = batch()
    loss, grads = parity.jax_loss_and_grads(model, {"input_ids": ids, "attention_mask": np.ones_like(ids)}, labels)
    specs = {
        field: [list(a) if isinstance(a, tuple) else a for a in model.buffers[f"{CODES}.{field}"].sharding.spec]
        for field in ("codes", "scales")
    }
    return {"loss": loss, "grads": {name: g.tolist() for name, g in grads.items()}, "specs": specs}


if __name__ == "__main__":
    print(json.dumps({"one": run((1, 1, 1)), "mesh": run((1, 2, 2))}))
