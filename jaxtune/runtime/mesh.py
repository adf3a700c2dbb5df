"""Device mesh and shardings: batches split over the `data` axis, parameters replicated."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxtune.config import MeshConfig


@dataclass(frozen=True)
class Placement:
    mesh: Mesh

    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def replicate(self, array: jax.Array) -> jax.Array:
        return jax.device_put(array, self.replicated)

    def shard_batch(self, arrays):
        """Split the leading (batch) dimension of every array in `arrays` (any pytree) over the data axis."""
        return jax.device_put(arrays, NamedSharding(self.mesh, PartitionSpec("data")))

    def shard_micro_batches(self, arrays):
        """Like `shard_batch` for (micro_batches, batch, ...) arrays: the second dimension is split."""
        return jax.device_put(arrays, NamedSharding(self.mesh, PartitionSpec(None, "data")))


def make_placement(cfg: MeshConfig) -> Placement:
    devices = jax.devices()
    size = len(devices) if cfg.data == -1 else cfg.data
    if size > len(devices):
        raise ValueError(f"mesh.data={cfg.data} but only {len(devices)} devices are visible")
    # Auto axes: sharded gathers (embedding lookups) raise under Explicit axes.
    mesh = jax.make_mesh((size,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:size])
    return Placement(mesh=mesh)
