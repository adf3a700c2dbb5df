"""Rematerialisation per decoder layer: what each layer keeps for the backward pass.

`layer`: only the layer's input; the backward pass recomputes the whole layer. `matmuls`: the
outputs of its weight matmuls; the elementwise ops between them (norms, activations, rotary
embeddings, dtype casts, residual adds), whose saved intermediates otherwise outweigh the
matmul outputs several times over, are recomputed, which costs memory bandwidth, not FLOPs.
`none`: everything autodiff saves.

`jax.checkpoint` alone does not lower memory on XLA's CPU backend: its scheduler runs the
recomputation early, as soon as the layer inputs exist, so all layers' activations are live
together again (measured: identical temp bytes with and without). `tied_checkpoint` makes the
recomputation depend on the incoming cotangent, so no scheduler can hoist it; accelerators'
memory-aware schedulers get the same program.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import torch

from jaxtune.config import REMAT_POLICIES


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, found by the class names transformers lists in `_no_split_modules`."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(base).__name__} names no decoder layer class "
            "(_no_split_modules); train.remat=layer cannot find its layers"
        )
    return layers


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recomputed(fn: Callable, consts: tuple, args: tuple):
    return fn(*args, *consts)


def _recomputed_fwd(fn, consts, args):
    return fn(*args, *consts), (consts, args)


def _recomputed_bwd(fn, saved, cotangent):
    consts, args = saved
    floats = [x for x in jax.tree.leaves(cotangent) if jnp.issubdtype(x.dtype, jnp.floating)]
    if floats:  # x + 0·ct[0]: the same values, available only once the cotangent is
        zero = floats[0].ravel()[0] * 0
        args = jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, args)
    _, vjp = jax.vjp(lambda c, a: fn(*a, *c), consts, args)
    return vjp(cotangent)


_recomputed.defvjp(_recomputed_fwd, _recomputed_bwd)


def _hoisted(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact) or dtype in (jnp.uint8, jnp.int8)


def tied_checkpoint(fn: Callable) -> Callable:
    """Like `jax.checkpoint(fn)` (only the inputs are saved for the backward pass), with the
    recomputation tied to the cotangent. Traced values `fn` closes over become explicit inputs
    (`_closure_converted`): the layer's weights, so their gradients flow, and a quantized base's codes,
    which inside a scan over layers are values of the scan's trace."""

    def run(*args):
        converted, consts = _closure_converted(fn, *args)
        return _recomputed(converted, tuple(consts), args)

    return run


def _closure_converted(fn: Callable, *args) -> tuple[Callable, list]:
    """(fn taking traced values it closes over after its arguments, those values): as `jax.closure_convert`,
    which hoists only floating-point ones, with a quantized base's 8-bit codes hoisted too. Inside a scan over
    layers the codes are values of the scan's trace, out of reach of a function that keeps them closed over.
    Other integer values (positions, masks made from them) stay as `jax.closure_convert` leaves them, so the
    programs of a float base are the ones it gives."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jax.tree.structure(shape)
    traced = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer) and _hoisted(c.dtype)]

    def converted(*args_then_hoisted):
        given, hoisted = args_then_hoisted[: len(args)], args_then_hoisted[len(args) :]
        consts = list(closed.consts)
        for i, value in zip(traced, hoisted):
            consts[i] = value
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(given)))

    return converted, [closed.consts[i] for i in traced]


def next_key() -> jax.Array:
    """The next key of the key torchax draws randomness from while a step is traced, as raw uint32 data."""
    from jaxtune.runtime.compat import torchax_env

    key = torchax_env().get_and_rotate_prng_key()
    return jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key


# Saved under `matmuls`: outputs of dots without batch dimensions, i.e. x @ W for the layer's weights
# (attention's own q·k and p·v are batched dots, recomputed inside the fused attention anyway).
SAVE_MATMULS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _keyed(forward: Callable, remat: str) -> Callable:
    """`forward` (a decoder layer's) drawing its dropout from a key of its own, recomputed in the
    backward pass as `remat` says (none, matmuls or layer).

    Remat needs that key: the recomputation must draw the forward's dropout masks again. The
    layer takes the same key without remat, so that remat changes memory alone, never the masks.
    """
    from torchax import interop

    from jaxtune.runtime.compat import torchax_env

    if remat not in REMAT_POLICIES:
        raise ValueError(
            f"remat {remat!r} is not a policy ({', '.join(REMAT_POLICIES)}): resolve train.remat=auto with fit.choose"
        )
    env = torchax_env()

    def plain(*args, **kwargs):
        with env.override_property(prng=next_key()):
            return forward(*args, **kwargs)

    def recomputed(*args, **kwargs):
        # Every tensor the layer is called with (positionally, by keyword, inside a tuple such as the
        # rotary tables) crosses into the checkpoint as an argument; everything else (flags, caches,
        # the layer's own weights) is closed over. An integer tensor closed over (positions, segment
        # ids) would stay a value of the trace that made it, which the backward pass of a scan over
        # layers does not see. The key goes in as an argument too: rotating the outer key in there
        # would leak a tracer.
        flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda a: isinstance(a, torch.Tensor))
        where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

        def layer(key, *tensors):
            full = list(flat)
            for i, t in zip(where, tensors):
                full[i] = t
            args, kwargs = jax.tree_util.tree_unflatten(tree, full)
            with env.override_property(prng=interop.jax_view(key)):
                return forward(*args, **kwargs)

        wrap = tied_checkpoint if remat == "layer" else functools.partial(jax.checkpoint, policy=SAVE_MATMULS)
        checkpointed = interop.torch_view(wrap(interop.jax_view(layer)))
        return checkpointed(interop.torch_view(next_key()), *(flat[i] for i in where))

    return plain if remat == "none" else recomputed


@contextlib.contextmanager
def keyed_layers(module: torch.nn.Module, remat: str) -> Iterator[None]:
    """While active (that is, while a step is traced), every decoder layer draws its dropout from
    its own key and keeps for the backward pass what `remat` says."""
    layers = decoder_layers(module)
    for layer in layers:
        layer.forward = _keyed(type(layer).forward.__get__(layer), remat)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward
