"""The device mesh (data, fsdp, tensor) and where every array goes on it.

The batch is split over data × fsdp; each parameter as `jaxtune.runtime.devices.sharding` says.
Arrays are placed with `make_array_from_callback`, which asks each process only for the
slices its own devices hold: the same code places a batch or a weight on one device, on
eight, or on the devices of several hosts, where each process feeds its own slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxtune.config import MESH_AXES, MeshConfig
from jaxtune.runtime.devices.sharding import spec_for

BATCH_AXES = ("data", "fsdp")  # the axes a batch's rows are split over


@dataclass(frozen=True)
class Placement:
    mesh: Mesh
    overrides: Mapping[str, Sequence[str | None]] = field(default_factory=dict)  # mesh.shardings

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def batch_shards(self) -> int:
        """How many pieces a batch's rows are split into (data × fsdp): every batch size is a multiple of it."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def parameter_sharding(self, name: str, shape: Sequence[int], transposed: bool = False) -> NamedSharding:
        return self.sharding(spec_for(name, shape, self.sizes, self.overrides, transposed))

    def put(self, value, sharding: NamedSharding | None = None) -> jax.Array:
        """A host array (numpy or jax) on the mesh, replicated unless `sharding` is given."""
        sharding = sharding or self.replicated
        if isinstance(value, jax.Array) and value.is_fully_addressable:
            return jax.device_put(value, sharding)
        return place(np.asarray(value), sharding)

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.sharding(PartitionSpec(BATCH_AXES))

    @property
    def micro_batch_sharding(self) -> NamedSharding:
        return self.sharding(PartitionSpec(None, BATCH_AXES))

    def shard_batch(self, arrays):
        """Split the leading (batch) dimension of every array in `arrays` (any pytree) over data × fsdp."""
        return jax.tree.map(lambda a: self.put(a, self.batch_sharding), arrays)

    def shard_micro_batches(self, arrays):
        """Like `shard_batch` for (micro_batches, batch, ...) arrays: the second dimension is split."""
        return jax.tree.map(lambda a: self.put(a, self.micro_batch_sharding), arrays)

    def shard_prompts(self, arrays):
        """Split decode's prompt rows over the data axis alone. Split over data × fsdp with
        tensor > 1 too, XLA (jax 0.10.2, CPU) decoded wrong tokens for some rows (tests/mesh
        catches it); rows split over data alone decode exactly as on one device."""
        sharding = self.prompt_sharding(len(jax.tree.leaves(arrays)[0]))
        return jax.tree.map(lambda a: self.put(a, sharding), arrays)

    def prompt_sharding(self, rows: int) -> NamedSharding:
        """How `shard_prompts` places `rows` prompts: split over the data axis where it divides them, else replicated."""
        return self.sharding(PartitionSpec("data")) if rows % self.mesh.shape["data"] == 0 else self.replicated

    def describe(self) -> str:
        devices = self.mesh.devices.flat
        first = next(iter(devices))
        processes = jax.process_count()
        return (
            ", ".join(f"{axis}={size}" for axis, size in self.sizes.items())
            + f" on {self.mesh.size} {first.platform} device{'s' * (self.mesh.size != 1)}"
            + (f" ({first.device_kind})" if first.platform != "cpu" else "")
            + (f" across {processes} processes" if processes > 1 else "")
        )


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`host` (the whole array, on every process) on the devices of `sharding`, each process
    handing over only the slices its own devices hold."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def fetch(tree):
    """Every array of `tree` whole on this host, as numpy: gathered from the other processes'
    devices where this one does not hold all of it (every process must call this together)."""
    from jax.experimental import multihost_utils

    def one(value):
        if not isinstance(value, jax.Array):
            return value
        if value.is_fully_addressable or value.is_fully_replicated:
            return np.asarray(value)
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))

    return jax.tree.map(one, tree)


def make_placement(cfg: MeshConfig, devices: Sequence | None = None) -> Placement:
    """The mesh `cfg` asks for, on this job's devices (every host's, after jax.distributed starts),
    or on `devices` (a target's compile-only ones: `jaxtune.runtime.devices.targets`)."""
    if devices is None:
        from jaxtune.runtime.devices.distributed import initialize

        initialize(cfg)
        devices = jax.devices()
    sizes = cfg.sizes(len(devices))
    used = int(np.prod(list(sizes.values())))
    # Auto axes: sharded gathers (embedding lookups) raise under Explicit axes.
    mesh = jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices[:used]
    )
    return Placement(mesh=mesh, overrides=dict(cfg.shardings))


def lowering(mesh: Mesh | None):
    """The context a program for `mesh`'s devices is lowered in. From JAX 0.11, a Pallas kernel for
    Triton is compiled for the GPU that the context's abstract mesh names, else for the machine's
    default device: on a machine without that GPU (a deviceless plan for h100) the default is the
    CPU, and the kernel's lowering fails. Entering the mesh's abstract mesh names the GPU; its axes
    are Auto, so nothing else of the trace changes (JAX 0.10 reads the GPU from the lowering and
    ignores it)."""
    if mesh is None or mesh.devices.flat[0].platform != "gpu":
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def per_device(kernel, mesh, query, key, value, segment_ids):
    """`kernel(q, k, v, segment ids)` for attention, run on each device's shard of a mesh under
    `shard_map` (XLA cannot split a Pallas call itself): rows split over the batch axes, heads over
    the tensor axis where they divide. q (b, t, n, h), k/v (b, t, kv, h), segment ids (b, t)."""
    if mesh is None or mesh.size == 1:
        return kernel(query, key, value, segment_ids)
    rows = BATCH_AXES if query.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    tensor = mesh.shape["tensor"]
    heads = "tensor" if tensor > 1 and query.shape[2] % tensor == 0 and key.shape[2] % tensor == 0 else None
    spec = PartitionSpec(rows, None, heads, None)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(rows, None)), out_specs=spec, check_vma=False
    )(query, key, value, segment_ids)
