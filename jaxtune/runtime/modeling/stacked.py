"""Decoder layers held stacked: one array per weight and per position in the layers' repeating group.

A decoder is a short repeating group of layers: one layer for Llama or Qwen, five sliding-window
layers and one global for Gemma 3. `Layout` finds that group from the layers' structure when the
model is loaded, and holds each group position's tensors (weights, a quantized base's codes and
scales, LoRA's adapters; so their gradients and optimizer state too) as one array with a leading
axis over the groups: `model.layers.3.mlp.up_proj.weight` of a 1-layer group becomes row 3 of
`model.layers.stack0.mlp.up_proj.weight`. The layers after the last whole group keep their own
names and run unrolled.

While a step is traced (`layers_from`), the model's own Python loop over its layers only records
each layer's call; the last layer's call runs them all as one `lax.scan` of one group's forward,
traced once through torchax whatever the depth. Where the layers' calls do not repeat with the
group (decoding's KV cache, which each layer writes at its own index), each layer runs unrolled
on its row of the stack instead. Files a user sees keep per-layer names: `flat` and `stacked`
convert where weights leave and enter the runtime.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import jax
import numpy as np
import torch

POSITION_ATTRIBUTES = ("layer_idx", "layer_index", "layer_id")  # a layer's own index: changes nothing traced
STACK = "stack"  # a stacked tensor's name: the layers' container, then `stack<q>`, then the tensor in the layer


def _settings(module: torch.nn.Module) -> tuple:
    return tuple(
        sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if isinstance(v, (int, float, str, bool, type(None)))
            and not k.startswith("_")
            and k not in POSITION_ATTRIBUTES
        )
    )


def structure_of(layer: torch.nn.Module, kind: str | None = None) -> tuple:
    """What must be equal for two layers to share one traced body: classes, every submodule's plain
    settings but the layer's own index, each tensor's name, shape, dtype and trainability, and the
    layer's kind where the config names one (`layer_types`: sliding or full attention)."""
    modules = tuple((name, type(m).__name__, _settings(m)) for name, m in layer.named_modules())
    tensors = tuple(
        (name, tuple(t.shape), str(t.dtype), t.requires_grad)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]
    )
    return type(layer), modules, tensors, kind


def period(signatures: list) -> int:
    """The shortest p with layer i like layer i + p for every i: the group's length."""
    n = len(signatures)
    return next(p for p in range(1, n + 1) if all(signatures[i] == signatures[i + p] for i in range(n - p)))


@dataclass(frozen=True)
class Layout:
    """Where each decoder layer's tensors live: `prefixes[i]` is layer i's name prefix in the model's
    tensor names ('model.layers.3.'); layers `g * period + q` for g < `groups` are row g of group
    position q's stack."""

    prefixes: tuple[str, ...]
    period: int
    groups: int

    @property
    def stacked_layers(self) -> int:
        return self.period * self.groups

    def stack_prefix(self, q: int) -> str:
        container = self.prefixes[q].rstrip(".").rpartition(".")[0]
        return f"{container}.{STACK}{q}."

    def member(self, name: str) -> tuple[str, int, int] | None:
        """(stacked name, group, position) of a per-layer tensor name, None for one outside the stacked layers."""
        for i in range(self.stacked_layers):
            if name.startswith(self.prefixes[i]):
                g, q = divmod(i, self.period)
                return self.stack_prefix(q) + name[len(self.prefixes[i]) :], g, q
        return None

    def members(self, stacked: str) -> list[str] | None:
        """The per-layer names of a stacked tensor's rows, in order; None for a name that is not stacked."""
        for q in range(self.period):
            prefix = self.stack_prefix(q)
            if stacked.startswith(prefix):
                rest = stacked[len(prefix) :]
                return [self.prefixes[g * self.period + q] + rest for g in range(self.groups)]
        return None

    def stacked(self, flat: Mapping, stack: Callable = np.stack) -> dict:
        """Per-layer tensors -> the layout's: each group position's rows stacked by `stack` (numpy's, or
        any function of a list), the others as they are, in the order their first member came."""
        out: dict = {}
        rows: dict[str, list] = {}
        for name, value in flat.items():
            found = self.member(name)
            if found is None:
                out[name] = value
                continue
            stacked, g, _ = found
            if stacked not in rows:
                rows[stacked] = [None] * self.groups
                out[stacked] = None  # its place in the order
            rows[stacked][g] = value
        for stacked, values in rows.items():
            if any(v is None for v in values):
                raise ValueError(f"{stacked}: layers {[i for i, v in enumerate(values) if v is None]} are missing")
            out[stacked] = stack(values)
        return out

    def flat(self, tensors: Mapping) -> dict:
        """The layout's tensors -> per-layer names, each stacked one split into its rows."""
        out: dict = {}
        for name, value in tensors.items():
            members = self.members(name)
            if members is None:
                out[name] = value
            else:
                out.update({member: value[g] for g, member in enumerate(members)})
        return out

    def flat_paths(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`checkpoint.tree_to_arrays`' arrays (keyed by pytree path strings such as "...mu['model.layers.stack0.x']")
        with every stacked weight's leaf split into its layers' leaves: an optimizer state in per-layer names."""
        out = {}
        for path, value in arrays.items():
            name = _quoted_name(path)
            members = self.members(name) if name is not None else None
            if members is None or np.ndim(value) == 0 or np.shape(value)[0] != self.groups:
                out[path] = value
            else:
                out.update({path.replace(f"'{name}'", f"'{m}'"): value[g] for g, m in enumerate(members)})
        return out

    def stacked_paths(self, arrays: Mapping[str, np.ndarray], paths: list[str]) -> dict[str, np.ndarray]:
        """The inverse of `flat_paths` for the pytree `paths` a stacked state has."""
        out = {}
        for path in paths:
            name = _quoted_name(path)
            members = self.members(name) if name is not None else None
            if path in arrays or members is None:
                out[path] = arrays[path] if path in arrays else None
            else:
                parts = [arrays.get(path.replace(f"'{name}'", f"'{m}'")) for m in members]
                out[path] = None if any(p is None for p in parts) else np.stack(parts)
        return {path: value for path, value in out.items() if value is not None}


def _quoted_name(path: str) -> str | None:
    """The last dict key in a pytree path string, e.g. 'a.b' in ".mu['a.b']"."""
    found = re.findall(r"\['([^']+)'\]", path)
    return found[-1] if found else None


def layout_of(module: torch.nn.Module, layers: list[torch.nn.Module]) -> Layout | None:
    """The model's layout, or None where its layers make fewer than two whole groups (nothing to scan)."""
    names = {id(m): name for name, m in module.named_modules()}
    config = module.config if hasattr(module, "config") else module.base_model.config
    kinds = getattr(config.get_text_config(), "layer_types", None) or [None] * len(layers)
    signatures = [structure_of(layer, kind) for layer, kind in zip(layers, kinds)]
    p = period(signatures)
    groups = len(layers) // p
    if groups < 2:
        return None
    return Layout(tuple(names[id(layer)] + "." for layer in layers), p, groups)


# Elementwise, layout and reduction ops: what a scan's body recomputes in the backward pass rather than keep
# per group. Unrolled, XLA fuses them into their consumers and keeps their (often bfloat16) inputs; a scan
# keeps what autodiff chose to save, stacked over the groups: a norm's float32 upcast of the hidden states,
# the MLP's activations beside the matmul outputs they come from (measured: twice the unrolled step's temporaries),
# and over a quantized base each layer's unpacked codes (a byte a weight) and the optimization barrier that ties
# its dequantizing to the layer's input (`quantize._tied_to_input`): both are recomputed from the codes instead.
RECOMPUTED_IN_SCAN = frozenset(
    {
        "abs", "add", "broadcast_in_dim", "clamp", "concatenate", "convert_element_type", "copy", "cos", "div",
        "dynamic_slice", "erf", "exp", "exp2", "expand_dims", "gather", "integer_pow", "iota", "log", "log1p",
        "logistic", "max", "min", "mul", "neg", "pow", "reduce_max", "reduce_min", "reduce_sum", "reshape",
        "rsqrt", "select_n", "sign", "sin", "slice", "sqrt", "square", "squeeze", "sub", "tanh", "transpose",
        "and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical",
        "optimization_barrier", "stop_gradient", "stack", "split", "rem", "floor", "ceil", "round", "expm1",
    }
)  # fmt: skip


SMALL_CONTRACTION = 128  # a dot summing over this few values (LoRA's B over its rank) is cheaper to redo than to keep


def SAVED_IN_SCAN(prim, *avals, **params) -> bool:  # noqa: N802  (a jax.checkpoint policy)
    if prim.name in RECOMPUTED_IN_SCAN:
        return False
    if prim.name == "dot_general":
        (contracting, _), _ = params["dimension_numbers"]
        return math.prod(avals[0].shape[d] for d in contracting) > SMALL_CONTRACTION
    return True


def _flat_call(call) -> tuple[list, jax.tree_util.PyTreeDef]:
    """A call's (args, kwargs) as leaves (tensors, plain values, opaque objects) and their structure."""
    return jax.tree_util.tree_flatten(call, is_leaf=lambda value: isinstance(value, torch.Tensor))


def _call_key(call) -> tuple:
    leaves, tree = _flat_call(call)
    return str(tree), tuple(("tensor", id(v)) if isinstance(v, torch.Tensor) else ("value", repr(v)) for v in leaves)


def _plain(call) -> bool:
    """Whether a call's inputs are tensors and plain values only: a cache object (decoding's KV cache,
    which each layer updates at its own index) or anything else opaque keeps the layers unrolled."""
    return all(isinstance(v, (torch.Tensor, int, float, str, bool, type(None))) for v in _flat_call(call)[0])


def _scannable(layout: Layout, calls: list) -> bool:
    """Whether every group's layers are called as the first group's are (the same tensors, by identity, and values)."""
    if not all(_plain(call) for call in calls):
        return False
    keys = [_call_key(call) for call in calls[: layout.stacked_layers]]
    return all(keys[i] == keys[i % layout.period] for i in range(len(keys)))


def held(module: torch.nn.Module, layout: Layout | None, tensors: dict):
    """A context yielding the tensors to call `module` with: `tensors` as they are where the layers are not
    stacked, else those outside the stacks, the stacked layers reading theirs (`layers_from`)."""
    from jaxtune.runtime.modeling.remat import decoder_layers

    if layout is None:
        return contextlib.nullcontext(tensors)
    return layers_from(layout, decoder_layers(module), tensors)


@contextlib.contextmanager
def layers_from(layout: Layout, layers: list[torch.nn.Module], tensors: dict) -> Iterator[dict]:
    """While active (while the model is called with `functional_call` on what it yields: `tensors`
    without the stacked ones), the stacked decoder `layers` take their weights from `tensors`' stacks
    and run as one scan over groups, or each on its row where their calls do not repeat."""
    from torchax import interop

    from jaxtune.runtime.compat import torchax_env
    from jaxtune.runtime.modeling.remat import next_key

    count = len(layers)
    stacks = [
        {
            name[len(layout.stack_prefix(q)) :]: v
            for name, v in tensors.items()
            if name.startswith(layout.stack_prefix(q))
        }
        for q in range(layout.period)
    ]
    rest = {name: v for name, v in tensors.items() if layout.members(name) is None}
    calls: list = [None] * count
    inside = [False]
    own = ["forward" in vars(layer) for layer in layers]  # an instance forward already (remat's keyed one)
    originals = [layer.forward for layer in layers]

    def run_unrolled(hidden):
        for i in range(layout.stacked_layers):
            g, q = divmod(i, layout.period)
            row = {name: v[g] for name, v in stacks[q].items()}
            hidden = torch.func.functional_call(layers[i], row, args=(hidden, *calls[i][0]), kwargs=calls[i][1])
        return hidden

    def run_scanned(hidden):
        p = layout.period
        # Keyed layers (a train step's, or remat's: `remat.keyed_layers`) draw their dropout from a key of their
        # own, each group its own keys; the others draw none, so that an eval step holds no random numbers.
        keyed = any(own)
        draw = lambda: jax.numpy.stack([next_key() for _ in range(p)])  # noqa: E731  (a group's keys)
        keys = [jax.numpy.stack([draw() for _ in range(layout.groups)])] if keyed else []  # scanned with the weights
        flat = [_flat_call(calls[q]) for q in range(p)]
        invariant = [interop.jax_view(v) for leaves, _ in flat for v in leaves if isinstance(v, torch.Tensor)]
        weights = [interop.jax_view(stack) for stack in stacks]

        def group_forward(h, constants, group, group_keys=None):
            inputs = iter(interop.torch_view(list(constants)))
            h = interop.torch_view(h)
            for q in range(p):
                leaves, tree = flat[q]
                args, kwargs = jax.tree_util.tree_unflatten(
                    tree, [next(inputs) if isinstance(v, torch.Tensor) else v for v in leaves]
                )
                params = interop.torch_view(group[q])
                with torchax_env().override_property(prng=group_keys[q]) if keyed else contextlib.nullcontext():
                    h = torch.func.functional_call(layers[q], params, args=(h, *args), kwargs=kwargs, strict=False)
            return interop.jax_view(h)

        # The calls' tensors (masks, rotary tables) are arguments of the group's function, not values it closes
        # over (layer remat's closure conversion inside cannot take those), and loop invariants of the scan,
        # kept once rather than once a group.
        group_forward = jax.checkpoint(group_forward, policy=SAVED_IN_SCAN, prevent_cse=False)

        def body(h, xs):
            return group_forward(h, invariant, *xs), None

        h, _ = jax.lax.scan(body, interop.jax_view(hidden), (weights, *keys))
        return interop.torch_view(h)

    def run_all(hidden: torch.Tensor) -> torch.Tensor:
        inside[0] = True
        try:
            if _scannable(layout, calls):
                hidden = run_scanned(hidden)
            else:
                hidden = run_unrolled(hidden)
            for i in range(layout.stacked_layers, count):  # after the last whole group: their own weights
                hidden = originals[i](hidden, *calls[i][0], **calls[i][1])
            return hidden
        finally:
            inside[0] = False

    def replaced(i: int):
        def forward(hidden, *args, **kwargs):
            if inside[0]:
                return originals[i](hidden, *args, **kwargs)
            calls[i] = (args, kwargs)
            return hidden if i < count - 1 else run_all(hidden)

        return forward

    for i, layer in enumerate(layers):
        layer.forward = replaced(i)
    try:
        yield rest
    finally:
        for layer, original, had in zip(layers, originals, own):
            if had:
                layer.forward = original
            else:
                del layer.forward
