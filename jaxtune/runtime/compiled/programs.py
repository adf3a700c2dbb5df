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

from jaxtune.runtime.modeling import attention
from jaxtune.runtime.devices.mesh import lowering

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
    """A jitted function built from a `ModelRef`; call or lower it with the model it computes for."""

    def __init__(self, jitted: Callable, ref: ModelRef):
        self.jitted, self.ref = jitted, ref

    def __call__(self, model, *args):
        self.ref.point_at(model)
        return self.jitted(*args)

    def lower(self, model, *args):
        self.ref.point_at(model)
        with lowering(model.placement.mesh):
            return self.jitted.lower(*args)


_kept: OrderedDict[tuple, Program] = OrderedDict()
_lock = threading.Lock()


def shared(kind: str, model, settings: tuple[Hashable, ...], build: Callable[[ModelRef], Callable]) -> Program:
    """The program `build(ref)` makes for models of `model`'s structure and these `settings` (everything
    else the traced function depends on), built now only if no model of that structure built it before."""
    key = (kind, structure(model), settings)
    with _lock:
        program = _kept.get(key)
        if program is not None:
            _kept.move_to_end(key)
    if program is None:
        ref = ModelRef()
        ref.point_at(model)
        program = Program(build(ref), ref)
        with _lock:
            _kept[key] = program
            while len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
    program.ref.point_at(model)
    return program


def clear() -> None:
    """Forget every kept program: the next step of each kind traces and compiles again."""
    with _lock:
        _kept.clear()


def structure(model) -> str:
    """A digest of all a traced program reads from `model` besides its tensors' values: the module tree
    (`repr`), the model's and LoRA's configs, the attention implementation, each tensor's name, shape,
    dtype and sharding (weights and frozen tensors apart), the compute casts, the devices, the
    attention core a step traced now would run (`attention.kernel_for`) and whether the layers are scanned."""
    module = model.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    lora = {name: config.to_dict() for name, config in getattr(module, "peft_config", {}).items()}
    parts = [
        repr(module),
        base.config.to_json_string(use_diff=False),
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
