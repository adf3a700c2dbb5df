"""JAX's persistent compilation cache: compiled XLA programs kept on disk between processes.

A rerun (or a later run with the same model and shapes) then loads the train, eval and decode
programs instead of compiling them again. The step's learning rate is an input, not a constant,
so a new rate or schedule hits the same entry.

JAX keeps only programs that compiled. A program the compiler refused for want of memory (XLA:TPU
refuses at compile time a step past the chip) is remembered here too, in `refused.json` beside
JAX's files, by the lowered program and the devices and versions that refused it, so that
`train.remat: auto`'s next run skips that candidate's minutes-long compile.

A program compiled for a target's compile-only devices (`jaxtune doctor --target`, planning for a
chip that is not here) is never run: only its memory plan and costs are read. Those figures are
remembered in `plans.json` (or the file `$JAXTUNE_PLANS_FILE` names) by the same key, so that planning
the same program again reads them instead of compiling it for minutes. The key holds all a
compile's outcome depends on: the lowered program, the devices (kind, count, place in the topology),
the compiler's version and its flags.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxtune.runtime.devices import executables

MIN_COMPILE_SECONDS = 0.5  # programs that compile faster than this are not worth a file
# JAX's own setting of that threshold, which wins when it is set.
MIN_COMPILE_SECONDS_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# A folder holding one cache for every store on this machine, in place of each store's own.
SHARED_FOLDER_VARIABLE = "JAXTUNE_COMPILE_CACHE"


def enable(folder: str | Path) -> Path:
    """Use `folder` (created if missing) as the process's compilation cache from now on, and keep
    whole executables below it (`executables`)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    executables.enable(folder)
    if jax.config.jax_compilation_cache_dir != str(folder):
        compilation_cache.set_cache_dir(str(folder))
        compilation_cache.reset_cache()  # a cache opened on another folder would otherwise stay in use
        if MIN_COMPILE_SECONDS_VARIABLE not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


def folder_of(store_root: str | Path) -> Path:
    """`$JAXTUNE_COMPILE_CACHE` when set (several stores, one cache), else `<store root>/xla-cache`."""
    shared = os.environ.get(SHARED_FOLDER_VARIABLE)
    return Path(shared) if shared else Path(store_root) / "xla-cache"


REFUSALS_FILE = "refused.json"
# libtpu's refusal of a step that does not fit: "... (55.40G) exceeds available HBM (15.75G) ..."
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED: ([^\n]*)")


def refusal(error: BaseException) -> str | None:
    """The compiler's one-line reason when `error` is its refusal of a program for want of memory, else None."""
    found = OUT_OF_MEMORY.search(str(error))
    return found[1].strip() if found else None


class RefusedBefore(RuntimeError):
    """The compiler refused this very program before; the message carries its words, as its own error did."""


def _refusals() -> Path | None:
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / REFUSALS_FILE if folder else None


# A Pallas kernel for the TPU travels in its custom call as Mosaic bytecode, base64 in the backend config,
# and that bytecode's locations name the Python file that traced it: a path under wherever jax is installed.
# jax 0.10 keeps them in the body; jax 0.12 moves them to a "debug_locations" field of their own.
_KERNEL_BODY = re.compile(r"(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)")
_KERNEL_LOCATIONS = re.compile(r", \\22debug_locations\\22: \\22[A-Za-z0-9+/=]*\\22")


def _without_locations(body: re.Match) -> str:
    """A kernel's bytecode as the digest of its text without locations (Mosaic's dialect read as JAX reads it
    to upgrade a kernel); the bytecode itself where it does not read (a jaxlib without Mosaic)."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir
        from jax._src.tpu_custom_call import tpu

        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        with context, ir.Location.unknown():
            context.allow_unregistered_dialects = True
            text = ir.Module.parse(base64.b64decode(body[2])).operation.get_asm(enable_debug_info=False)
    except Exception:
        return body[0]
    return body[1] + hashlib.sha256(text.encode("utf-8")).hexdigest() + body[3]


# A Triton kernel for the GPU travels in its custom call as MLIR bytecode (`ir = "..."` in its backend config),
# and that bytecode's locations name the files that traced it (the checkout's, the installed transformers') and
# the frames that called it, which differ with what the process traced before. Without Triton's dialect the
# bytecode does not read back reliably, so the key leaves it out: the call's name, grid, warps, operands and
# results stay in the key, and a GPU plan's memory figures and costs do not read the kernel's body (XLA:GPU
# counts no flops on compile-only devices, and the kernel's buffers are its operands and results).
_TRITON_IR = re.compile(r'(\bir = ")(?:[^"\\]|\\.)*(")')


def program_text(lowered) -> str:
    """The lowered program as the key hashes it: the same wherever the code is installed (a checkout's
    .venv, CI's, a TPU machine's) and whatever the process traced before, so that plans.json's records
    hold in a fresh clone too."""
    text = _KERNEL_BODY.sub(_without_locations, _KERNEL_LOCATIONS.sub("", lowered.as_text()))
    return _TRITON_IR.sub(r"\1\2", text)


def program_key(lowered, devices) -> str:
    """What identifies a compile's outcome: the lowered program (`program_text`), the devices it is for (kind
    and count), and the versions compiling it (jax, and the backend's own: libtpu's, the CUDA plugin's)."""
    devices = list(devices)
    client = getattr(devices[0], "client", None)
    parts = [
        program_text(lowered),
        jax.__version__,
        devices[0].platform,
        getattr(client, "platform_version", ""),
        *sorted({d.device_kind for d in devices}),
        str(len(devices)),
    ]
    if compile_only(devices):  # a target's devices: their places in its topology, and the flags libtpu reads
        parts += [str([getattr(d, "coords", None) for d in devices]), *map(os.environ.get, COMPILER_FLAGS)]
    return hashlib.sha256("\n".join(map(str, parts)).encode("utf-8")).hexdigest()


COMPILER_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")  # the environment's settings of the compilers


def compile_only(devices) -> bool:
    """Whether `devices` are a target's (`targets.devices`): compiled for, never run on."""
    client = getattr(list(devices)[0], "client", None)
    return "CompileOnly" in type(client).__name__


def known_refusal(lowered, devices, key: str | None = None) -> str | None:
    """The compiler's words when it refused `lowered` for `devices` before (with the cache enabled), else None.
    `key`: its `program_key`, where the caller has it."""
    path = _refusals()
    if path is None or not path.is_file():
        return None
    return _read(path).get(key or program_key(lowered, devices))


def remember_refusal(lowered, devices, words: str, key: str | None = None) -> None:
    """Record that the compiler refused `lowered` for `devices`, saying `words` (with the cache enabled)."""
    path = _refusals()
    if path is not None:
        _record(path, key or program_key(lowered, devices), words)


def compile_remembering_refusals(lowered, devices, key: str | None = None):
    """`lowered.compile()`, except where the compiler refused the same program before (for want of
    memory): then RefusedBefore at once, with the compiler's words. `key`: its `program_key`, where
    the caller has it (hashing a large program's text takes seconds)."""
    devices = list(devices)
    known = known_refusal(lowered, devices, key)
    if known is not None:
        raise RefusedBefore(
            f"RESOURCE_EXHAUSTED: {known} (refused before; remembered in the compilation cache's {REFUSALS_FILE})"
        )
    try:
        return lowered.compile()
    except Exception as error:
        words = refusal(error)
        if words is not None:
            remember_refusal(lowered, devices, words, key)
        raise


def _read(path: Path | None) -> dict:
    """A file of records by program key (`refused.json`, `plans.json`); empty where there is none."""
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}  # an unreadable record costs a compile, nothing more


def _record(path: Path, key: str, value) -> None:
    """`value` under `key` in the file at `path`, the records other processes wrote since kept: read and
    written again under an exclusive lock beside it, so that two processes recording at once both land."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _read(path)
        found[key] = value
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        temporary.replace(path)


PLANS_FILE = "plans.json"
PLANS_FILE_VARIABLE = "JAXTUNE_PLANS_FILE"  # a file of plans in place of the one beside the compilation cache
# What `steps.compiled_memory` reads of a compiled program's memory analysis.
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
)
COST_FIELDS = ("flops", "bytes accessed", "transcendentals", "optimal_seconds")  # the whole program's, not per operand


class KnownPlan:
    """A compile's memory analysis and costs as remembered (`plans.json`): what planning reads of an
    executable for devices that cannot run it, without the executable."""

    def __init__(self, record: dict):
        self.record = record

    def memory_analysis(self) -> SimpleNamespace:
        return SimpleNamespace(**self.record["memory"])

    def cost_analysis(self) -> dict:
        return dict(self.record["cost"])


def _plans() -> Path | None:
    named = os.environ.get(PLANS_FILE_VARIABLE)
    if named:
        return Path(named)
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / PLANS_FILE if folder else None


def compile_for_plan(lowered, devices, what: str = ""):
    """For a target's compile-only devices: the plan remembered for this very program (`KnownPlan`), else
    `compile_remembering_refusals`, its plan then remembered under `what` (a program's description,
    for a reader of the file). Refusals are remembered as they are for any compile."""
    devices = list(devices)
    path = _plans()
    key = program_key(lowered, devices) if path is not None else None
    known = _read(path).get(key) if key else None
    if known is not None:
        executables.logger.info("%s: its plan read from %s, where this very program's compile left it", what, path)
        return KnownPlan(known)
    compiled = compile_remembering_refusals(lowered, devices, key)
    if key:
        stats, cost = compiled.memory_analysis(), compiled.cost_analysis()
        if isinstance(cost, list):  # one dict per program in older JAX
            cost = cost[0] if cost else {}
        record = {
            "program": what,
            "memory": {field: int(getattr(stats, field)) for field in MEMORY_FIELDS},
            "cost": {k: float(v) for k, v in (cost or {}).items() if k in COST_FIELDS},
        }
        _record(path, key, record)
    return compiled
