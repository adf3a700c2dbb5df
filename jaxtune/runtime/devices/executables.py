"""Compiled programs kept on disk as executables: a program that did not change is loaded, never
traced, lowered or compiled again.

JAX's persistent cache (`devices.compile_cache`) is keyed by the lowered program, so asking it
costs a trace and a lowering first: tens of seconds for a billion-parameter model traced through
torchax. This store is asked before either. An entry's key is all that determines the program:

- the program's kind and the settings it closes over (remat policy, loss chunk, objective, the
  optimizer's rule), and the model's structure (`programs.structure`: module tree, configs, each
  tensor's name, shape, dtype and sharding, the devices, the attention core);
- its arguments' tree, shapes, dtypes and shardings;
- the runtime's own code (a digest of the jaxtune sources), the versions of every library that
  traces or compiles it, the backend's own version (libtpu's), XLA's flags and the process's place
  in a multi-process job.

Values a program takes as arguments (learning rate, step key, data, step count) are in none of
it, so a run changing only those loads the program. A changed input gives a new key; nothing is
ever looked up by a key it was not saved under.

An entry is a folder `<key>/` of `executable.bin` (JAX's serialisation of the compiled executable)
and `entry.json` (its key, what it is, its bytes' sha256, its argument and result trees).
It is written under a temporary name and renamed into place whole. An entry whose record names
another key, whose bytes do not match their digest, or that the backend will not load is refused
with a warning naming it, removed, and the program compiled again. JAX's serialisation wraps
XLA's bytes in a pickle; `executable_files` reads it building JAX's own classes and nothing else.
An executable is machine code all the same: like JAX's own cache, the folder is the user's own
files, and the digest guards against damage, not an attacker.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxtune.runtime.devices import executable_files

logger = logging.getLogger("jaxtune.compile")

FOLDER = "executables"  # below the compilation cache's folder
FORMAT = 2  # of an entry's files; a new format gives every program a new key
EXECUTABLE, ENTRY = "executable.bin", "entry.json"
# What traces and compiles a program besides jaxtune's own code.
LIBRARIES = (
    "jax",
    "jaxlib",
    "libtpu",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "torch",
    "torchax",
    "transformers",
    "peft",
    "optax",
)
# Settings outside the program that change what XLA makes of it.
ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
PROGRESS_SECONDS = 10.0  # a compile still running says so this often

_folder: Path | None = None
_lock = threading.Lock()


OFF_VARIABLE = "JAXTUNE_KEEP_EXECUTABLES"  # "0": keep none (JAX's cache alone, asked after a trace and lowering)


def enable(folder: str | Path) -> Path | None:
    """Keep executables under `folder`/executables from now on (the compilation cache's folder), unless
    $JAXTUNE_KEEP_EXECUTABLES is 0."""
    global _folder
    _folder = None if os.environ.get(OFF_VARIABLE) == "0" else Path(folder) / FOLDER
    return _folder


def disable() -> None:
    """Keep nothing on disk: every program not compiled in this process is traced and compiled."""
    global _folder
    _folder = None


def folder() -> Path | None:
    return _folder


def signature(args) -> str:
    """The arguments' tree, and each leaf's shape, dtype, weak type and sharding: all a program
    compiled for them assumes of them (a host array: no sharding)."""
    leaves, tree = jax.tree.flatten(args)
    return "\n".join([str(tree), *map(_leaf, leaves)])


def _leaf(value) -> str:
    if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        weak = value.aval.weak_type if isinstance(value, jax.Array) else value.weak_type
        return f"{value.dtype}{list(value.shape)}{'~' * weak} {value.sharding!r}"
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)} host"
    return f"{type(value).__name__} scalar"


def key(kind: str, structure: str, settings: str, args_signature: str) -> str:
    """The entry's name: a digest of everything that determines the compiled program (see the module)."""
    devices = jax.devices()
    client = getattr(devices[0], "client", None)
    parts = [
        f"format {FORMAT}",
        kind,
        structure,
        settings,
        args_signature,
        code_digest(),
        json.dumps(library_versions(), sort_keys=True),
        f"{devices[0].platform} {getattr(client, 'platform_version', '')}",
        json.dumps({name: os.environ.get(name, "") for name in ENVIRONMENT}, sort_keys=True),
        f"process {jax.process_index()} of {jax.process_count()}",
        f"x64 {jax.config.jax_enable_x64} precision {jax.config.jax_default_matmul_precision}",
    ]
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


@functools.cache
def code_digest() -> str:
    """A digest of every jaxtune source file: any edit may change a traced program, so any edit re-keys it."""
    package = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def load(entry_key: str, what: str):
    """The executable kept under `entry_key`, loaded onto the devices; None where there is none or it is refused."""
    if _folder is None:
        return None
    entry = _folder / entry_key
    record_path = entry / ENTRY
    if not record_path.is_file():
        return None
    started = time.perf_counter()
    try:
        record = json.loads(record_path.read_text())
        if record.get("key") != entry_key:
            return _refuse(entry, what, f"its record names another key ({str(record.get('key'))[:16]}...)")
        data = (entry / EXECUTABLE).read_bytes()
        if hashlib.sha256(data).hexdigest() != record.get("sha256"):
            return _refuse(entry, what, f"its {EXECUTABLE} does not match the sha256 its record gives (damaged)")
        compiled = executable_files.load(data, record["trees"])
    except Exception as error:  # noqa: BLE001 - a bad entry costs a compile, never the run
        return _refuse(entry, what, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    logger.info(
        "loaded the kept %s (%.0f MiB) in %.1f s, with no trace or compile",
        what,
        len(data) / 2**20,
        time.perf_counter() - started,
    )
    return compiled


def _refuse(entry: Path, what: str, why: str) -> None:
    logger.warning("refused the kept executable %s for %s: %s; compiling it again", entry, what, why)
    shutil.rmtree(entry, ignore_errors=True)
    return None


def save(entry_key: str, what: str, compiled, from_jax_cache: bool = False) -> Path | None:
    """Keep `compiled` under `entry_key`; None (with a debug line) where JAX cannot serialise it, or where
    XLA:CPU loaded it from JAX's persistent cache: serialised again, such an executable lacks its
    compiled functions ("Function ... not found" when run), so JAX's cache alone serves it there."""
    if _folder is None:
        return None
    if from_jax_cache and jax.devices()[0].platform == "cpu":
        logger.debug("%s is not kept: XLA:CPU loaded it from JAX's cache", what)
        return None
    try:
        data, trees = executable_files.dump(compiled)
    except Exception as error:  # noqa: BLE001 - e.g. a program with constants JAX cannot serialise yet
        logger.debug("%s is not kept: %s", what, error)
        return None
    entry = _folder / entry_key
    temporary = _folder / f".{entry_key}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        temporary.mkdir(parents=True, exist_ok=True)
        (temporary / EXECUTABLE).write_bytes(data)
        record = {
            "key": entry_key,
            "what": what,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "trees": trees,
            "libraries": library_versions(),
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (temporary / ENTRY).write_text(json.dumps(record, indent=1))
        with _lock:
            if entry.exists():  # another process kept the same program first: its copy is as good
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                temporary.rename(entry)
    except OSError as error:  # a full or read-only disk costs the next run a compile, never this one
        logger.warning("could not keep %s in %s: %s", what, _folder, error)
        shutil.rmtree(temporary, ignore_errors=True)
        return None
    return entry


_compiling = threading.local()  # per thread: whether its compile came from JAX's persistent cache


def _on_event(event: str, **kwargs) -> None:
    if event == JAX_CACHE_HIT:
        _compiling.from_jax_cache = True


JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
jax.monitoring.register_event_listener(_on_event)


class watching:
    """A compile that says what it compiles, every `PROGRESS_SECONDS` while it runs and once when done:
    `with watching("train step (remat none, 1 x 8 x 512)"): lowered.compile()`."""

    def __init__(self, what: str, every: float | None = None):
        self.what, self.every = what, PROGRESS_SECONDS if every is None else every
        self.done = threading.Event()
        self.seconds = 0.0

    def __enter__(self) -> watching:
        self.started = time.perf_counter()
        _compiling.from_jax_cache = False
        logger.info("compiling %s", self.what)
        self.thread = threading.Thread(target=self._report, daemon=True, name="jaxtune-compile-progress")
        self.thread.start()
        return self

    def _report(self) -> None:
        while not self.done.wait(self.every):
            logger.info("still compiling %s: %.0f s so far", self.what, time.perf_counter() - self.started)

    def __exit__(self, kind, error, trace) -> None:
        self.done.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.started
        self.from_jax_cache = getattr(_compiling, "from_jax_cache", False)
        if error is None:
            logger.info("compiled %s in %.1f s", self.what, self.seconds)


def recall(entry_key: str) -> dict | None:
    """The record kept under `entry_key` (`remember`), or None where there is none or it cannot be read."""
    if _folder is None:
        return None
    path = _folder / f"{entry_key}.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("refused the kept record %s: %s", path, error)
        path.unlink(missing_ok=True)
        return None
    if record.get("key") != entry_key:
        logger.warning("refused the kept record %s: it names another key", path)
        path.unlink(missing_ok=True)
        return None
    return record["value"]


def remember(entry_key: str, value: dict) -> None:
    """Keep a JSON `value` (a decision a program's compile led to) under `entry_key`, next to the executables."""
    if _folder is None:
        return
    path = _folder / f"{entry_key}.json"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _folder.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"key": entry_key, "value": value}, indent=1))
        temporary.replace(path)
    except (OSError, TypeError, ValueError) as error:
        logger.warning("could not keep a record in %s: %s", _folder, error)
        temporary.unlink(missing_ok=True)
