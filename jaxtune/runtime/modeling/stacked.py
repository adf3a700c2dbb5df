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
import contextvars
import functools
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


def runs_of(signatures: list) -> tuple[int, ...]:
    """The lengths of the runs of alike neighbours in one group's signatures: (5, 1) for Gemma 3's five
    sliding-window layers and one global, (1,) for Llama's one layer."""
    runs = [1]
    for before, after in zip(signatures, signatures[1:]):
        if after == before:
            runs[-1] += 1
        else:
            runs.append(1)
    return tuple(runs)


def _stack(rows: list, lead: tuple[int, ...]) -> np.ndarray:
    return np.stack(rows).reshape(*lead, *np.shape(rows[0]))


@dataclass(frozen=True)
class Layout:
    """Where each decoder layer's tensors live: `prefixes[i]` is layer i's name prefix in the model's
    tensor names ('model.layers.3.'); layers `g * period + q` for g < `groups` are the stacked ones.
    A group's positions fall in `runs` of alike neighbours (lengths, in order; one position each where
    not given), and each run's tensors are held as one stack: rows `[g]` where the run is one layer
    (Llama's `stack0`, Gemma's global `stack1`), `[g, j]` where it is several (Gemma's five sliding
    layers, `stack0`), which the step scans over in turn."""

    prefixes: tuple[str, ...]
    period: int
    groups: int
    runs: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.runs:
            object.__setattr__(self, "runs", (1,) * self.period)
        if sum(self.runs) != self.period:
            raise ValueError(f"runs {self.runs} do not add up to the period {self.period}")

    @property
    def stacked_layers(self) -> int:
        return self.period * self.groups

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Each run's first position in the group."""
        return tuple(sum(self.runs[:r]) for r in range(len(self.runs)))

    @functools.cached_property
    def _positions(self) -> tuple[tuple[int, int], ...]:
        return tuple((r, j) for r, n in enumerate(self.runs) for j in range(n))

    def run_of(self, q: int) -> tuple[int, int]:
        """(run, index in the run) of group position q."""
        return self._positions[q]

    def lead(self, r: int) -> tuple[int, ...]:
        """The leading axes of run r's stacks: (groups,) or (groups, run length)."""
        return (self.groups,) if self.runs[r] == 1 else (self.groups, self.runs[r])

    def stack_prefix(self, r: int) -> str:
        container = self.prefixes[self.starts[r]].rstrip(".").rpartition(".")[0]
        return f"{container}.{STACK}{r}."

    def member(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(stacked name, row) of a per-layer tensor name, None for one outside the stacked layers."""
        for i in range(self.stacked_layers):
            if name.startswith(self.prefixes[i]):
                g, q = divmod(i, self.period)
                r, j = self.run_of(q)
                return self.stack_prefix(r) + name[len(self.prefixes[i]) :], (g,) if self.runs[r] == 1 else (g, j)
        return None

    def _run(self, stacked: str) -> tuple[int, str] | None:
        for r in range(len(self.runs)):
            if stacked.startswith(prefix := self.stack_prefix(r)):
                return r, stacked[len(prefix) :]
        return None

    def rows(self, stacked: str) -> tuple[tuple[int, ...], list[str]] | None:
        """A stacked tensor's leading axes and the per-layer names of its rows, in order; None for a name
        that is not stacked."""
        found = self._run(stacked)
        if found is None:
            return None
        r, rest = found
        start = self.starts[r]
        names = [
            self.prefixes[g * self.period + start + j] + rest for g in range(self.groups) for j in range(self.runs[r])
        ]
        return self.lead(r), names

    def members(self, stacked: str) -> list[str] | None:
        """The per-layer names of a stacked tensor's rows, in order; None for a name that is not stacked."""
        found = self.rows(stacked)
        return None if found is None else found[1]

    def stacked(self, flat: Mapping, stack: Callable = _stack) -> dict:
        """Per-layer tensors -> the layout's: each run's rows stacked by `stack(rows, leading axes)` (numpy's,
        or any function of the rows in order), the others as they are, in the order their first member came."""
        out: dict = {}
        rows: dict[str, dict] = {}
        for name, value in flat.items():
            found = self.member(name)
            if found is None:
                out[name] = value
                continue
            stacked, row = found
            if stacked not in rows:
                rows[stacked] = {}
                out[stacked] = None  # its place in the order
            rows[stacked][row] = value
        for stacked, values in rows.items():
            lead, names = self.rows(stacked)
            missing = [n for n, row in zip(names, np.ndindex(*lead)) if row not in values]
            if missing:
                raise ValueError(f"{stacked}: {', '.join(missing)} missing")
            out[stacked] = stack([values[row] for row in np.ndindex(*lead)], lead)
        return out

    def flat(self, tensors: Mapping) -> dict:
        """The layout's tensors -> per-layer names, each stacked one split into its rows."""
        out: dict = {}
        for name, value in tensors.items():
            found = self.rows(name)
            if found is None:
                out[name] = value
            else:
                lead, names = found
                out.update({member: value[row] for member, row in zip(names, np.ndindex(*lead))})
        return out

    def flat_paths(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`checkpoint.tree_to_arrays`' arrays (keyed by pytree path strings such as "...mu['model.layers.stack0.x']")
        with every stacked weight's leaf split into its layers' leaves: an optimizer state in per-layer names."""
        out = {}
        for path, value in arrays.items():
            name = _quoted_name(path)
            found = self.rows(name) if name is not None else None
            if found is None or tuple(np.shape(value)[: len(found[0])]) != found[0]:
                out[path] = value
            else:
                lead, names = found
                out.update(
                    {path.replace(f"'{name}'", f"'{m}'"): value[row] for m, row in zip(names, np.ndindex(*lead))}
                )
        return out

    def stacked_paths(self, arrays: Mapping[str, np.ndarray], paths: list[str]) -> dict[str, np.ndarray]:
        """The inverse of `flat_paths` for the pytree `paths` a stacked state has."""
        out = {}
        for path in paths:
            name = _quoted_name(path)
            found = self.rows(name) if name is not None else None
            if path in arrays or found is None:
                out[path] = arrays[path] if path in arrays else None
            else:
                lead, names = found
                parts = [arrays.get(path.replace(f"'{name}'", f"'{m}'")) for m in names]
                out[path] = None if any(p is None for p in parts) else _stack(parts, lead)
        return {path: value for path, value in out.items() if value is not None}


_TRACED: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("stacked_layout", default=None)


@contextlib.contextmanager
def layout_of_step(layout: Layout | None) -> Iterator[None]:
    """While a step of a model in `layout` is traced: what `leading_axes` reads."""
    token = _TRACED.set(layout)
    try:
        yield
    finally:
        _TRACED.reset(token)


def leading_axes(name: str | None) -> int:
    """How many leading axes of the tensor `name` run over layers in the step being traced (`layout_of_step`):
    1 or 2 for a stacked tensor, 0 for any other, or outside a step."""
    layout = _TRACED.get()
    found = layout.rows(name) if layout is not None and name is not None else None
    return len(found[0]) if found else 0


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
    return Layout(tuple(names[id(layer)] + "." for layer in layers), p, groups, runs_of(signatures[:p]))


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


def traced_once(fn: Callable) -> Callable:
    """`fn` jitted: called again with arguments of the same shapes, inside the one trace of a step, it adds
    its traced body again rather than tracing `fn` again."""
    return jax.jit(fn)


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


def _alike_runs(layout: Layout, calls: list) -> list[bool]:
    """For each run of the group, whether its layers are all called alike (so they share one traced function)."""
    keys = [_call_key(call) for call in calls[: layout.period]]
    return [len({keys[s + j] for j in range(n)}) == 1 for s, n in zip(layout.starts, layout.runs)]


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
            name[len(layout.stack_prefix(r)) :]: v
            for name, v in tensors.items()
            if name.startswith(layout.stack_prefix(r))
        }
        for r in range(len(layout.runs))
    ]
    rest = {name: v for name, v in tensors.items() if layout.members(name) is None}
    calls: list = [None] * count
    inside = [False]
    own = ["forward" in vars(layer) for layer in layers]  # an instance forward already (remat's keyed one)
    originals = [layer.forward for layer in layers]

    def run_unrolled(hidden):
        for i in range(layout.stacked_layers):
            g, q = divmod(i, layout.period)
            r, j = layout.run_of(q)
            row = (g,) if layout.runs[r] == 1 else (g, j)
            weights = {name: v[row] for name, v in stacks[r].items()}
            hidden = torch.func.functional_call(layers[i], weights, args=(hidden, *calls[i][0]), kwargs=calls[i][1])
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
        alike = _alike_runs(layout, calls)

        def layer_function(q):
            """Group position q's layer as a function of JAX values, (hidden states, its call's tensors, its
            weights, its key) -> hidden states, jitted so that the alike layers of a run trace it once. The
            call's tensors (masks, rotary tables) are arguments, not values it closes over: layer remat's
            closure conversion inside cannot take those."""
            leaves, tree = flat[q]

            def run(h, tensors, params, key):
                inputs = iter(interop.torch_view(list(tensors)))
                values = [next(inputs) if isinstance(v, torch.Tensor) else v for v in leaves]
                args, kwargs = jax.tree_util.tree_unflatten(tree, values)
                with torchax_env().override_property(prng=key) if keyed else contextlib.nullcontext():
                    out = torch.func.functional_call(
                        layers[q], interop.torch_view(params), args=(interop.torch_view(h), *args), kwargs=kwargs,
                        strict=False,
                    )  # fmt: skip
                return interop.jax_view(out)

            return traced_once(run)

        # A run's layers, alike and called alike, share their first one's function (one trace); the body still
        # holds each layer, so XLA compiles the group flat: a scan nested in the scan (measured on the v5e, Gemma
        # 3 1B LoRA 8 x 512) compiled in 27 s rather than 43 s but stepped in 156 ms rather than 129, its loop's
        # operands (each group's slice of the run's weights and saved activations) copied at every group.
        functions: dict[int, Callable] = {}
        for q in range(p):
            r, _ = layout.run_of(q)
            shared = layout.starts[r] if alike[r] else q
            functions[q] = functions[shared] if shared in functions else layer_function(shared)
        counts = [sum(isinstance(v, torch.Tensor) for v in leaves) for leaves, _ in flat]
        ends = np.cumsum(counts).tolist()

        def group_forward(h, constants, group, group_keys=None):
            for q in range(p):
                r, j = layout.run_of(q)
                params = group[r] if layout.runs[r] == 1 else jax.tree_util.tree_map(lambda v, j=j: v[j], group[r])
                tensors = constants[ends[q] - counts[q] : ends[q]]
                h = functions[q](h, tensors, params, group_keys[q] if keyed else None)
            return h

        # The calls' tensors (masks, rotary tables) are loop invariants of the scan, kept once rather than once a group.
        # One checkpoint around the group, keeping what `SAVED_IN_SCAN` says (a scan's linearizing would otherwise
        # keep all its body computes: float32 upcasts, activations). A checkpoint a layer also keeps each layer's
        # input: 620 MB more temporaries, deviceless v5e, Gemma 3 1B's shape, 12 layers, LoRA 8 x 512.
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
