"""Checks `jaxtune run` makes before it starts a Prefect server or any stage: that the files the
config names exist, that GRPO's rewards load, and that the mesh can split every batch. A mistake found here costs the
user a second, not a server start and the stages before the one that would have failed."""

from __future__ import annotations

import math
from pathlib import Path

from jaxtune.config import MESH_AXES, OFFLINE, JaxtuneConfig
from jaxtune.errors import ConfigError


def check(config: JaxtuneConfig) -> None:
    """Raise ConfigError (a setting that cannot work), DataError or ModelError (a file that is not there or not usable)."""
    _check_store(config.store.root)
    sources = config.data.mixture()
    for i, src in enumerate(sources):
        _check_data_source(src.source, "data.source" if not config.data.sources else f"data.sources[{i}].source")
    if config.model.name != OFFLINE:
        from jaxtune.tasks.sources import check_model_name

        check_model_name(config.model)
    if config.train.objective == "grpo":
        from jaxtune.rewards import load_rewards

        load_rewards(config.rl.rewards, config.rl.reward_weights)  # one line naming a reward that cannot load
    check_mesh(config, _device_count())


def check_mesh(config: JaxtuneConfig, devices: int) -> None:
    """The mesh must fit the devices, and every batch must split evenly over data x fsdp (the batch axes)."""
    mesh = config.mesh
    try:
        sizes = mesh.sizes(devices)
    except ValueError:
        raise ConfigError(_misfit(mesh, devices)) from None
    shards = sizes["data"] * sizes["fsdp"]
    for key, batch in (
        ("train.batch_size", config.train.batch_size),
        ("eval.batch_size", config.eval.batch_size),
        ("generate.batch_size", config.generate.batch_size),
    ):
        if batch % shards:
            fits = ((batch + shards - 1) // shards) * shards
            raise ConfigError(
                f"{key}={batch} cannot split evenly over the mesh's batch axes, data={sizes['data']} x "
                f"fsdp={sizes['fsdp']} = {shards} devices; use a multiple of {shards}, e.g. {key}={fits}"
            )


def _misfit(mesh, devices: int) -> str:
    """Why the mesh's axes cannot fit `devices` devices, and what would."""
    named = ", ".join(f"mesh.{axis}={getattr(mesh, axis)}" for axis in MESH_AXES)
    fixed = math.prod(max(getattr(mesh, axis), 1) for axis in MESH_AXES)
    visible = f"{devices} device{'s' * (devices != 1)} {'are' if devices != 1 else 'is'} visible"
    if -1 in (mesh.data, mesh.fsdp, mesh.tensor):
        return (
            f"{named} needs a multiple of {fixed} devices but {visible}: the fixed axes' product, {fixed}, "
            f"must divide {devices}"
        )
    return (
        f"{named} needs {fixed} devices but only {visible}; make the axes' product at most {devices}, "
        f"or set one axis to -1 for the devices the others leave"
    )


def _device_count() -> int:
    import jax

    return jax.device_count()


def _check_store(root: str) -> None:
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"store.root {root!r} is a file, not a folder")


def _check_data_source(source: str, key: str = "data.source") -> None:
    from jaxtune.data.rows import source_problem
    from jaxtune.errors import DataError

    problem = None if source == OFFLINE else source_problem(source)
    if problem is not None:
        raise DataError(f"{key} {source!r}{problem}")
