"""What every stage shares: its cache key, writing its artifact exactly once, and the runtime's
progress lines in the run's log."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jaxtune.artifacts import ArtifactRef, ArtifactStore, artifact_key
from jaxtune.artifacts.code import code_identity
from jaxtune.artifacts.locks import StoreLocks
from jaxtune.host import processes


def input_keys(inputs: Mapping[str, ArtifactRef | None]) -> dict[str, str]:
    """Absent optional inputs (e.g. no trained weights for a baseline) still change the key."""
    return {name: (ref.key if ref is not None else "none") for name, ref in inputs.items()}


def stage_key(stage: str, module: str, section: BaseModel | Mapping[str, Any], inputs: Mapping[str, str]) -> str:
    """The artifact key of `stage`, run by the task module `module`, given its inputs' keys."""
    return artifact_key(stage, code_identity(module)["digest"], section, inputs)


def build_artifact(
    store_root: str | Path,
    stage: str,
    module: str,
    section: BaseModel | Mapping[str, Any],
    inputs: Mapping[str, ArtifactRef | None],
    build: Callable[[Path], None],
) -> ArtifactRef:
    """Return the verified artifact for these arguments, calling `build(folder)` only if it is missing.

    `module` is the task module that defines the stage (its `__name__`): its code is in the key.
    `build` writes into a temporary folder that becomes the artifact only when it returns.

    In a multi-process job (see jaxtune.flows.finetune) the flow calls a stage only when process 0
    has decided it must be built, and every process builds it, as the mesh's collectives need
    them all: process 0 then builds even if the artifact appeared meanwhile, and the others build
    into a temporary folder outside the store that is deleted when `build` returns. They return
    a ref to where process 0 publishes the artifact, which the flow reads after a barrier.
    """
    build = _logging_progress(build)
    store = ArtifactStore(store_root)
    keys = input_keys(inputs)
    key = stage_key(stage, module, section, keys)
    if not processes.writes():
        with tempfile.TemporaryDirectory(prefix=f"jaxtune-{stage}-") as folder:
            build(Path(folder))
        return ArtifactRef(stage=stage, key=key, path=str(store.folder(stage, key)))
    if processes.count > 1 or not store.verify(stage, key):
        with store.writing(stage, key, inputs=keys, config=section, code=code_identity(module)) as folder:
            build(folder)
    return store.ref(stage, key)


RUNTIME_LOGGER = "jaxtune"  # the runtime's loggers: jaxtune.compile (what compiles, loads, is refused), ...


class _ToRunLog(logging.Handler):
    """The runtime's records, as the Prefect run's own: in its log in the UI, and on the console."""

    def __init__(self, run_logger: logging.LoggerAdapter):
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, "%s", record.getMessage())


@contextlib.contextmanager
def progress_in_run_log():
    """While a stage builds, the runtime's INFO lines and above (`compiling train_step (...)`, `still
    compiling ...: 40 s so far`, `loaded the kept ...`, a refused plan or executable and why) go to the
    Prefect run's log, which the console shows too; outside a run (doctor, chat) nothing changes."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        run_logger = get_run_logger()
    except MissingContextError:
        yield
        return
    source, handler = logging.getLogger(RUNTIME_LOGGER), _ToRunLog(run_logger)
    level, propagate = source.level, source.propagate
    source.addHandler(handler)
    source.setLevel(logging.INFO if level in (logging.NOTSET, 0) or level > logging.INFO else level)
    source.propagate = False  # the root's console handler would print a warning a second time
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(level)
        source.propagate = propagate


def _logging_progress(build: Callable[[Path], None]) -> Callable[[Path], None]:
    def logged(folder: Path) -> None:
        with progress_in_run_log():
            build(folder)

    return logged


def built_outside_flow(
    store_root: str | Path,
    stage: str,
    module: str,
    section: BaseModel | Mapping[str, Any],
    inputs: Mapping[str, ArtifactRef],
    run: Callable[[], ArtifactRef],
) -> ArtifactRef:
    """`run()` (a stage's function, which builds its artifact unless the store has it) called by
    a command outside any flow (doctor, chat), under the store lock a flow run takes for the same
    stage and key: processes sharing a store build it once and never read a half-renamed folder."""
    key = stage_key(stage, module, section, input_keys(inputs))
    locks, record = StoreLocks(store_root), f"{stage}/{key}/result.json"  # the record path a flow run locks
    holder = f"outside-flow-{os.getpid()}-{threading.get_ident()}"
    locks.acquire_lock(record, holder)
    try:
        return run()
    finally:
        locks.release_lock(record, holder)
