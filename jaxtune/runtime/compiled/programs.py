"""Jitted programs shared by every model of one structure in a process.

Tracing a torch model through torchax costs seconds of Python, and more than running a small
model. Two models whose modules, configs, tensor names, shapes, dtypes and shardings agree trace
to the same program whatever their tensors hold, since the tensors are its arguments. So each
program is built once per (kind, structure, settings) and kept (`MAX_KEPT`, the least recently
used first out): a stage that opens the model again (the eval after training, the decoding after
the eval, a second run in the same process) finds its steps traced and compiled.

A kept program must not keep its model alive, since a model's tensors can fill a device. Its
builder gets a `ModelRef` in place of the model: a weak reference that each caller points at its
own model (`Program.__call__`, `Program.lower`) before JAX may trace.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jaxtune.runtime.devices import compile_cache, executables
from jaxtune.runtime.devices.mesh import lowering
from jaxtune.runtime.modeling import attention

MAX_KEPT = 32


class ModelRef(threading.local):
    """Stands in for a `JaxModel` inside a shared program: every attribute is read from the model
    this thread last pointed it at. Per thread, so two threads tracing one program each read their own."""

    _target: weakref.ref | None = None

    def point_at(self, model) -> None:
        self._target = weakref.ref(model)

    def __getattr__(self, name: str) -> Any:
        model = self._target() if self._target is not None else None
        if model is None:
            raise RuntimeError(f"a shared program read `{name}` with no live model to read it from")
        return getattr(model, name)


class Program:
    """A jitted function built from a `ModelRef`; call or lower it with the model it computes for.

    A call runs the executable compiled for its arguments' shapes and shardings (`compiled_for`):
    compiled once in the process, and, where the program is `keep`-able, kept on disk
    (`executables`) so that a later process loads it with no trace, lowering or compile."""

    def __init__(
        self, jitted: Callable, ref: ModelRef, kind: str = "program", structure: str = "", settings: str | None = None
    ):
        self.jitted, self.ref = jitted, ref
        self.kind, self.structure, self.settings = kind, structure, settings
        self.compiled: dict[str, Any] = {}  # by `executables.signature` of the arguments
        self.by_shapes: dict[tuple, Any] = {}  # the same, by the cheaper `shapes` where a call found it
        self.last = None  # the executable the last call ran

    def __call__(self, model, *args):
        """The executable for `args` run on them. The last call's executable is tried first: its own
        check of the arguments (in C++) costs nothing, where `executables.signature` costs about 10 us
        a leaf (16 ms for a 1B model's LoRA step, 12% of its step on a v5e chip). It refuses arguments
        it was not compiled for before running anything; those find theirs by shapes, then by signature."""
        key = None
        for tried in ("last", "shapes"):
            compiled = self.last if tried == "last" else self.by_shapes.get(key := shapes(args))
            if compiled is None:
                continue
            try:
                out = compiled(*args)
            except (TypeError, ValueError):  # not its arguments' tree, types or shardings, or an error of its own
                if self.compiled.get(executables.signature(args)) is compiled:
                    raise
                continue
            self.last = compiled
            return out
        compiled = self.last = self.by_shapes[key or shapes(args)] = self.compiled_for(model, *args)
        return compiled(*args)

    def lower(self, model, *args):
        self.ref.point_at(model)
        with lowering(model.placement.mesh):
            return self.jitted.lower(*args)

    def compiled_for(self, model, *args, planning: bool = False, plan_only: bool = False):
        """The executable for `args` (arrays or shapes): this process's, else the one kept on disk, else
        traced, lowered and compiled now (saying so while it runs) and kept. A compile the devices'
        compiler refuses for want of memory raises, and is remembered (`compile_cache`).

        `planning`: compiled to read its memory plan, one candidate of several (`fit`): held only
        until the next candidate's compile (a loaded executable's code lies in device memory), so
        that the chosen one, compiled last, is the one the first step finds, and kept on disk then.
        `plan_only`: only its memory analysis and costs will be read: for a target's compile-only devices,
        which never run it, a plan remembered for this very program stands in (`compile_cache.compile_for_plan`)."""
        global _planned
        signature = executables.signature(args)
        compiled = self.compiled.get(signature)
        if compiled is None and _planned is not None and _planned[:2] == (self, signature):
            compiled, keep = _planned[2:]  # the plan chosen: now this program's, and kept
            self.compiled[signature] = compiled
            _planned = None
            keep()
        if compiled is not None:
            return compiled
        if planning:
            _planned = None  # the candidate before is let go before this one compiles
        what = f"{self.kind} ({describe(self.settings, args)})"
        kept = (
            executables.key(self.kind, self.structure, self.settings, signature)
            if self.settings is not None and executables.folder() is not None
            else None
        )
        devices = list(model.placement.mesh.devices.flat)
        if plan_only and compile_cache.compile_only(devices):  # never run: its plan alone is read, and remembered
            with executables.watching(what):
                compiled = compile_cache.compile_for_plan(self.lower(model, *args), devices, what)
            keep = lambda: None  # noqa: E731
        elif (compiled := executables.load(kept, what) if kept else None) is None:
            with executables.watching(what) as compiling:
                compiled = compile_cache.compile_remembering_refusals(self.lower(model, *args), devices)
            from_jax_cache = compiling.from_jax_cache
            keep = lambda: executables.save(kept, what, compiled, from_jax_cache) if kept else None  # noqa: E731
            if not planning:
                keep()
        else:
            keep = lambda: None  # noqa: E731
        if planning:  # kept on disk only once a step runs it: a candidate not chosen is not worth the bytes
            _planned = (self, signature, compiled, keep)
        else:
            self.compiled[signature] = compiled
        return compiled


_planned: tuple | None = None  # the last candidate `fit` compiled: (program, signature, executable, keep it)


def shapes(args) -> tuple:
    """The arguments' tree and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((getattr(leaf, "shape", None), getattr(leaf, "dtype", type(leaf))) for leaf in leaves)


def describe(settings: str | None, args) -> str:
    """'int32[1,8,512]; remat none, ...': the shapes of the integer arrays of rank 2 or more among
    `args` (the batch or the prompts), then the settings, for a log line."""
    shapes = sorted(
        {
            f"{leaf.dtype}{list(leaf.shape)}"
            for leaf in jax.tree.leaves(args)
            if hasattr(leaf, "shape") and len(leaf.shape) >= 2 and np.issubdtype(leaf.dtype, np.integer)
        }
    )
    return "; ".join(filter(None, [" ".join(shapes), settings]))


_kept: OrderedDict[tuple, Program] = OrderedDict()
_lock = threading.Lock()


def shared(
    kind: str, model, settings: tuple[Hashable, ...], build: Callable[[ModelRef], Callable], keep: bool = True
) -> Program:
    """The program `build(ref)` makes for models of `model`'s structure and these `settings` (everything
    else the traced function depends on), built now only if no model of that structure built it before.
    `keep`: whether its executables may be kept on disk, keyed by `repr(settings)`: only where that
    repr says all the settings mean (no object identities)."""
    digest = structure(model)
    key = (kind, digest, settings)
    with _lock:
        program = _kept.get(key)
        if program is not None:
            _kept.move_to_end(key)
    if program is None:
        ref = ModelRef()
        ref.point_at(model)
        program = Program(build(ref), ref, kind, digest, _settings_text(settings) if keep else None)
        with _lock:
            _kept[key] = program
            while len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
    program.ref.point_at(model)
    return program


def _settings_text(settings: tuple) -> str:
    return (
        ", ".join(map(str, settings))
        if all(isinstance(s, (str, int, float, bool, type(None))) for s in settings)
        else repr(settings)
    )


def clear() -> None:
    """Forget every program of this process: the next step of each kind is loaded or compiled again."""
    global _planned
    with _lock:
        _kept.clear()
        _planned = None


# Where a model or adapter was read from: no part of what it computes (a run in another folder traces the same program).
WHERE_FROM = ("_name_or_path", "base_model_name_or_path")


def structure(model) -> str:
    """A digest of all a traced program reads from `model` besides its tensors' values: the module tree
    (`repr`), the model's and LoRA's configs, the attention implementation, each tensor's name, shape,
    dtype and sharding (weights and frozen tensors apart), the compute casts, the devices, the
    attention core a step traced now would run (`attention.kernel_for`) and whether the layers are scanned."""
    module = model.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    lora = {
        name: {k: v for k, v in config.to_dict().items() if k not in WHERE_FROM}
        for name, config in getattr(module, "peft_config", {}).items()
    }
    config = {k: v for k, v in base.config.to_dict().items() if k not in WHERE_FROM}
    parts = [
        repr(module),
        json.dumps(config, sort_keys=True, default=str),
        str(base.config._attn_implementation),
        json.dumps(lora, sort_keys=True, default=lambda value: sorted(value) if isinstance(value, set) else str(value)),
        *(f"weight {name} {a.shape} {a.dtype} {a.sharding}" for name, a in model.weights.items()),
        *(f"frozen {name} {a.shape} {a.dtype} {a.sharding}" for name, a in model.buffers.items()),
        str(sorted((name, str(dtype)) for name, dtype in model.casts.items())),
        str(model.dtype),
        str([(device.platform, device.device_kind, device.id) for device in model.placement.mesh.devices.flat]),
        repr(attention.kernel_for(model.placement.mesh)),
        f"scan_layers {model.scan_layers}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
