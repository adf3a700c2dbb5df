"""Multi-host jobs for runtime code: `jax.distributed` started from the config or the environment,
and the few ways processes agree. Every process runs the same flow; process 0 alone writes the
store and Prefect artifacts, and the others wait for it at a barrier, then read what it wrote.

The job itself is `jaxtune.host.processes`' (it must be joined before this package is imported, and
stages that never import the runtime use it too); these are its entry points for the runtime.
"""

from __future__ import annotations

import jax

from jaxtune.config import MeshConfig
from jaxtune.host import processes


def initialize(cfg: MeshConfig) -> None:
    """Join the job `cfg` (or the environment) describes, once per process; nothing for one process.

    Must come before anything touches a device: JAX fixes its device list on first use, and
    importing this package may already have (its torchax set-up makes a JAX array). So a process
    joins through `jaxtune.host.processes.join` before importing the runtime (`jaxtune run` and the
    finetune flow do), and this is a no-op for callers such as `make_placement`."""
    try:
        processes.join(cfg)
    except RuntimeError as error:
        if not jax.distributed.is_initialized():
            error.add_note(
                "join a multi-process job with jaxtune.host.processes.join(mesh config) before importing "
                "jaxtune.runtime, whose torchax set-up starts JAX's backend"
            )
        raise


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (at once for one process)."""
    processes.barrier(name)


def agree(value: bool) -> bool:
    """Process 0's `value`, on every process."""
    return processes.agree(value)
