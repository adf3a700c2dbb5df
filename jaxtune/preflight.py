"""Checks `jaxtune run` makes before it starts a Prefect server or any stage: that the files the
config names exist, and that the mesh can split every batch. A mistake found here costs the
user a second, not a server start and the stages before the one that would have failed."""

from __future__ import annotations

from pathlib import Path

from jaxtune.config import OFFLINE, ConfigError, JaxtuneConfig


def check(config: JaxtuneConfig) -> None:
    """Raise ConfigError (a setting that cannot work), DataError or ModelError (a file that is not there or not usable)."""
    _check_store(config.store.root)
    sources = config.data.mixture()
    for i, src in enumerate(sources):
        _check_data_source(src.source, "data.source" if not config.data.sources else f"data.sources[{i}].source")
    if config.model.name != OFFLINE:
        from jaxtune.tasks.sources import check_model_name

        check_model_name(config.model)
    check_mesh(config, _device_count())


def check_mesh(config: JaxtuneConfig, devices: int) -> None:
    """Every batch must split evenly over the devices of the `data` axis."""
    size = devices if config.mesh.data == -1 else config.mesh.data
    if size > devices:
        raise ConfigError(f"mesh.data={config.mesh.data}, but only {devices} device{'s' * (devices != 1)} "
                          f"{'are' if devices != 1 else 'is'} visible; use mesh.data=-1 for all of them")
    for key, batch in (("train.batch_size", config.train.batch_size), ("eval.batch_size", config.eval.batch_size),
                       ("generate.batch_size", config.generate.batch_size)):
        if batch % size:
            fits = ((batch + size - 1) // size) * size
            raise ConfigError(f"{key}={batch} cannot split evenly over the {size} devices of the mesh's data axis; "
                              f"use a multiple of {size}, e.g. {key}={fits}")


def _device_count() -> int:
    import jax

    return jax.device_count()


def _check_store(root: str) -> None:
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"store.root {root!r} is a file, not a folder")


def _check_data_source(source: str, key: str = "data.source") -> None:
    from jaxtune.data.rows import DataError, source_problem

    problem = None if source == OFFLINE else source_problem(source)
    if problem is not None:
        raise DataError(f"{key} {source!r}{problem}")
