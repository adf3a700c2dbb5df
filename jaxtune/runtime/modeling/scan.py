"""The decoder layers traced once: a `lax.scan` over groups of layers of the same structure.

A Hugging Face decoder runs its layers in a Python loop, so a traced step holds every layer's
program again and XLA compiles each copy. While a step is traced under `scanned_layers`, each
decoder layer's forward is replaced: the layers before the last record their call (its tensors
and settings) and hand their input through unchanged; the last runs the recorded calls as one
scan over groups. A group is one period of the layers' pattern: a layer alone where every layer
is alike (Llama, Qwen), five sliding-window layers and one global for Gemma 3. Each group
position's weights are stacked along a new first axis; the layers left over after the last whole
group run unrolled, as do models with fewer than two groups.

Two layers belong to the same group position when nothing traced differs between them: their
classes, the plain settings of every submodule but the layer's own index, and the very tensors
(by identity) and values they are called with. Layer-level remat and dropout keys apply inside
the scan as outside it; each group draws its own keys, so dropout masks differ from an unrolled
step's, and its loss and gradients are the unrolled step's up to the order of float32 sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import torch

POSITION_ATTRIBUTES = ("layer_idx", "layer_index", "layer_id")  # a layer's own index: changes nothing traced


def _settings(module: torch.nn.Module) -> tuple:
    return tuple(
        sorted(
            (k, v)
            for k, v in vars(module).items()
            if isinstance(v, (int, float, str, bool, type(None)))
            and not k.startswith("_")
            and k not in POSITION_ATTRIBUTES
        )
    )


def _flat(call) -> tuple[list, jax.tree_util.PyTreeDef]:
    """A call's (args, kwargs) as leaves (tensors, plain values, opaque objects) and their structure."""
    return jax.tree_util.tree_flatten(call, is_leaf=lambda value: isinstance(value, torch.Tensor))


def _inputs_key(call) -> tuple:
    leaves, tree = _flat(call)
    return str(tree), tuple(("tensor", id(v)) if isinstance(v, torch.Tensor) else ("value", repr(v)) for v in leaves)


def signature(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What must be equal for two layers to share one traced body."""
    modules = tuple(sorted((name, type(m).__name__, _settings(m)) for name, m in layer.named_modules()))
    return type(layer), modules, _inputs_key((args, kwargs))


def plain(call) -> bool:
    """Whether a call's inputs are tensors and plain values only: a cache object (decoding's KV cache,
    which each layer updates at its own index) or anything else opaque keeps the layers unrolled."""
    return all(isinstance(v, (torch.Tensor, int, float, str, bool)) for v in _flat(call)[0])


def period(signatures: list) -> int:
    """The shortest p with layer i like layer i + p for every i: the group's length."""
    n = len(signatures)
    return next(p for p in range(1, n + 1) if all(signatures[i] == signatures[i + p] for i in range(n - p)))


@contextlib.contextmanager
def scanned_layers(layers: list[torch.nn.Module]) -> Iterator[None]:
    """While active (while a step is traced inside `functional_call` of the whole model), the decoder
    `layers`, in the order the model calls them, run as a scan over groups."""
    from torchax import interop

    from jaxtune.runtime.compat import torchax_env
    from jaxtune.runtime.modeling.remat import next_key

    count = len(layers)
    calls: list = [None] * count
    inside = [False]
    own = ["forward" in vars(layer) for layer in layers]  # an instance forward already (remat's keyed one)
    originals = [layer.forward for layer in layers]

    def run_all(hidden: torch.Tensor) -> torch.Tensor:
        p = period([signature(layers[i], *calls[i]) for i in range(count)])
        groups = count // p if all(plain(call) for call in calls) else 1
        inside[0] = True
        try:
            if groups < 2:
                for i in range(count):
                    hidden = originals[i](hidden, *calls[i][0], **calls[i][1])
                return hidden
            tensors = [{**dict(layer.named_parameters()), **dict(layer.named_buffers())} for layer in layers]
            stacked = [
                {
                    name: jnp.stack([interop.jax_view(tensors[g * p + q][name]) for g in range(groups)])
                    for name in tensors[q]
                }
                for q in range(p)
            ]
            keys = jnp.stack([jnp.stack([next_key() for _ in range(p)]) for _ in range(groups)])
            # The calls' tensors (masks, rotary tables) enter the scan as loop-invariant carry, not as closed-over
            # values of the enclosing trace, which layer remat's closure conversion cannot take.
            flat = [_flat(calls[q]) for q in range(p)]
            invariant = [interop.jax_view(v) for leaves, _ in flat for v in leaves if isinstance(v, torch.Tensor)]

            def body(carry, xs):
                h, constants = carry
                group, group_keys = xs
                inputs = iter(interop.torch_view(list(constants)))
                h = interop.torch_view(h)
                for q in range(p):
                    leaves, tree = flat[q]
                    args, kwargs = jax.tree_util.tree_unflatten(
                        tree, [next(inputs) if isinstance(v, torch.Tensor) else v for v in leaves]
                    )
                    params = {name: interop.torch_view(v) for name, v in group[q].items()}
                    with torchax_env().override_property(prng=group_keys[q]):
                        h = torch.func.functional_call(layers[q], params, args=(h, *args), kwargs=kwargs, strict=False)
                return (interop.jax_view(h), constants), None

            (h, _), _ = jax.lax.scan(body, (interop.jax_view(hidden), invariant), (stacked, keys))
            hidden = interop.torch_view(h)
            for i in range(groups * p, count):
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
        yield
    finally:
        for layer, original, had in zip(layers, originals, own):
            if had:
                layer.forward = original
            else:
                del layer.forward
