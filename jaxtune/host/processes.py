"""This process's place in a multi-host job, for code that must not import JAX at import time
(the flow, the store, the stages' shared code).

A one-process run is process 0 of 1 and never waits. `join` makes the process part of the job
its settings describe, through `jax.distributed` (JAX is imported then, not before), and fills
this in. Nothing here imports `jaxtune.runtime`: every stage's key hashes this module and what
it imports, and a stage that does not use the runtime (tokenize) must not be keyed by it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from jaxtune.config import MeshConfig

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}
# Process 0 may work alone for hours while the others wait (a download, tokenizing, a checkpoint):
# waits are long. A process that dies does not leave the others waiting that long: JAX's
# coordination service ends every process once one stops sending heartbeats.
WAIT_MS = 7 * 24 * 3600 * 1000

index, count = 0, 1
_barrier: Callable[[str], None] = lambda name: None  # noqa: E731
_agree: Callable[[bool], bool] = lambda value: value  # noqa: E731
_any_of: Callable[[tuple[bool, ...]], tuple[bool, ...]] = lambda values: values  # noqa: E731
_calls = 0  # barriers and agreements so far: every process makes the same ones, in the same order


def settings(cfg: MeshConfig) -> dict | None:
    """jax.distributed.initialize's arguments from `cfg`, else the environment; None for a one-process job."""
    found = {}
    for key, variable in ENV.items():
        value = getattr(cfg, key)
        if value is None and os.environ.get(variable):
            value = os.environ[variable] if key == "coordinator" else int(os.environ[variable])
        found[key] = value
    if found["num_processes"] == 1:
        return None
    if not cfg.distributed and all(value is None for value in found.values()):
        return None
    return found


def join(cfg: MeshConfig) -> bool:
    """Join the job `cfg` (or the environment) describes, once per process; returns whether this is a
    multi-process job (False, and JAX not imported, for one process).

    Must come before anything starts JAX's backend, which fixes its device list: a JAX
    computation, `jax.devices()`, and importing `jaxtune.runtime` (its torchax set-up makes a JAX
    array). `jaxtune run` joins before its preflight counts the devices; the finetune flow joins
    before its first stage, for callers that run it in Python."""
    arguments = settings(cfg)
    if arguments is None:
        return False
    import jax

    if not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=arguments["coordinator"],
            num_processes=arguments["num_processes"],
            process_id=arguments["process_id"],
        )
    joined(jax.process_index(), jax.process_count(), _service_barrier, _service_agree, _service_any_of)
    return True


def joined(
    process_index: int,
    process_count: int,
    barrier: Callable[[str], None],
    agree: Callable[[bool], bool],
    any_of: Callable[[tuple[bool, ...]], tuple[bool, ...]] = lambda values: values,
) -> None:
    global index, count, _barrier, _agree, _any_of
    index, count, _barrier, _agree, _any_of = process_index, process_count, barrier, agree, any_of


def writes() -> bool:
    """Whether this process writes the store and Prefect artifacts (process 0 of the job)."""
    return index == 0


def barrier(name: str) -> None:
    """Wait until every process of the job reaches `name`."""
    _barrier(name)


def agree(value: bool) -> bool:
    """Process 0's `value`, on every process (what it decided, e.g. that a stage is cached)."""
    return _agree(value)


def any_of(*values: bool) -> tuple[bool, ...]:
    """For each of `values`, whether it is true on any process (every process calls this together)."""
    return _any_of(tuple(values))


def _client():
    """JAX's client of the job's coordination service."""
    from jax._src import distributed

    return distributed.global_state.client


def _next_id(name: str) -> str:
    global _calls
    _calls += 1
    return f"jaxtune:{_calls}:{name}"


def _service_barrier(name: str) -> None:
    """A barrier of JAX's coordination service, not a collective on the devices: it ties up no
    device, and waits as long as process 0 works alone (a CPU collective's transport gives up sooner)."""
    _client().wait_at_barrier(_next_id(name), WAIT_MS)


def _service_agree(value: bool) -> bool:
    """Process 0's `value`, through the coordination service's key-value store."""
    key = _next_id("agree")
    if index == 0:
        _client().key_value_set(key, "1" if value else "0")
        return bool(value)
    return _client().blocking_key_value_get(key, WAIT_MS) == "1"


def _service_any_of(values: tuple[bool, ...]) -> tuple[bool, ...]:
    """Each process whose values are not all false writes them under this call's prefix before a
    barrier, and every process reads the prefix after it: all read the same writes, whichever
    process is slower, since none writes under a prefix once it has passed that prefix's barrier."""
    prefix = _next_id("any_of")
    if any(values):
        _client().key_value_set(f"{prefix}/{index}", "".join("1" if v else "0" for v in values))
    _client().wait_at_barrier(f"{prefix}/written", WAIT_MS)
    written = [found for _, found in _client().key_value_dir_get(f"{prefix}/")]
    return tuple(any(found[i] == "1" for found in written) for i in range(len(values)))
