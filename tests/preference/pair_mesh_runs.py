"""Run with 4 fake CPU devices: the DPO run of test_pair_training on one device and on a
(data, fsdp, tensor) = (2, 2, 1) mesh; prints each run's losses as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.preference.pair_mesh_runs
"""

from __future__ import annotations

import json


def losses(sizes: tuple[int, int, int]) -> list[float]:
    import numpy as np

    from jaxtune.config import LoraConfig, MeshConfig
    from jaxtune.runtime.decoding.inference import row_nll
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.train import training
    from tests.conftest import PAD, tiny_model
    from tests.preference.test_pair_step import pair_rows
    from tests.preference.test_pair_training import CFG, DPO

    data, fsdp, tensor = sizes
    module = rt_model.attach_lora(tiny_model("llama"), LoraConfig(r=4, target_modules="all-linear"))
    model = rt_model.to_jax(module, make_placement(MeshConfig(data=data, fsdp=fsdp, tensor=tensor)))
    ids, labels = pair_rows(24, seed=5)
    reference = -row_nll(model, ids, labels, batch_size=8, pad_id=PAD, progress=False)[0].astype(np.float32)
    result = training.train(
        model,
        ids,
        labels,
        CFG.model_copy(update={"checkpoint_every": 100}),
        PAD,
        64,
        check_memory=False,
        objective=DPO,
        reference=(reference, None),
    )
    return [r["loss"] for r in result.log if "loss" in r]


if __name__ == "__main__":
    print(json.dumps({"one": losses((1, 1, 1)), "mesh": losses((2, 2, 1))}))
