"""Attention on NVIDIA GPUs as a Pallas flash-attention kernel (Pallas's Triton lowering): the
counterpart of `splash` on TPU.

The forward pass walks one tile of queries at a time over the tiles of keys it can see, keeping
a running maximum and sum per query (the online softmax of FlashAttention), and writes the
output and each query's log-sum-exp; the backward pass recomputes each tile's probabilities from
q, k and the log-sum-exp, one kernel for dk and dv (a key tile against the query tiles that see
it) and one for dq (a query tile against its key tiles). Neither ever holds a (t, t) score
matrix, and tiles that the causal mask or the sliding window leave empty are skipped, not
masked: for Gemma 3's 512-token windows at 2048 tokens a query tile reads a quarter of the keys.

It computes what `attention._core` computes: segment ids (packed rows and padding, a token sees
its own segment alone), the causal mask, transformers' sliding window (query i sees keys
i - window < j <= i), Gemma 2's soft-capped logits, and grouped key/value heads (query head n
reads key/value head n // groups; the dk/dv kernel loops over a key head's group of query
heads, so their sums are never stored per query head).
Attention dropout it does not express, nor head sizes that are not a power of two from 16 to
256 (Triton's tiles are powers of two), nor sequences that are not a multiple of 16 tokens (its
smallest tile): `refusal` names the reason, and the caller keeps XLA's kernel for those.

The tile sizes are chosen so that Hopper's shared memory (227 KiB a block) holds a tile's
operands at the pipeline depth given; a deviceless compile for `h100`/`h200` checks that
(`tests/targets`). On the CPU the kernel runs in Pallas's interpreter, the same tiled arithmetic
(`tests/runtime/test_gpu_flash.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

MASKED = -1e30  # a score no query may take: exp(MASKED - anything real) is 0 in float32
HEAD_SIZES = (16, 32, 64, 128, 256)


SMALLEST_TILE = 16  # Triton's dot takes tiles of at least 16 rows


@dataclass(frozen=True)
class Tiles:
    """Tile lengths (queries, keys) of the three kernels, and Triton's warps and pipeline depth."""

    forward: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    warps: int
    stages: int = 2


def tiles_for(head: int, length: int, itemsize: int = 2) -> Tiles:
    """Wider rows take smaller tiles (a (64, 256) bf16 tile is 32 KiB of shared memory; a float32
    one twice that), and a tile is halved until it divides the sequence."""
    row = head * itemsize  # bytes of one token's head
    if row <= 128:
        tiles = Tiles(forward=(128, 64), dkdv=(64, 64), dq=(64, 64), warps=4)
    elif row <= 256:
        tiles = Tiles(forward=(128, 64), dkdv=(64, 64), dq=(64, 64), warps=8)
    elif row <= 512:
        tiles = Tiles(forward=(64, 64), dkdv=(32, 64), dq=(64, 32), warps=8)
    else:
        tiles = Tiles(forward=(64, 32), dkdv=(32, 32), dq=(32, 32), warps=8)
    fit = lambda pair: tuple(_dividing(tile, length) for tile in pair)  # noqa: E731
    return Tiles(fit(tiles.forward), fit(tiles.dkdv), fit(tiles.dq), tiles.warps, tiles.stages)


def _dividing(tile: int, length: int) -> int:
    while length % tile and tile > SMALLEST_TILE:
        tile //= 2
    return tile


def refusal(length: int, head: int, dropout: float) -> str | None:
    """Why the kernel does not apply to these shapes (None when it does)."""
    if dropout:
        return "attention dropout"
    if head not in HEAD_SIZES:
        return f"head size {head} (the kernel takes {', '.join(map(str, HEAD_SIZES))})"
    if length % SMALLEST_TILE:
        return f"sequence length {length}, not a multiple of the kernel's smallest tile, {SMALLEST_TILE} tokens"
    return None


def attention(
    query,
    key,
    value,
    segment_ids,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    mesh=None,
    interpret: bool = False,
):
    """q (b, t, n, h), k/v (b, t, kv, h), segment ids (b, t) -> (b, t, n, h), as `attention._core` computes it."""
    from jaxtune.runtime.devices.mesh import per_device

    settings = _Settings(float(scale), window, None if softcap is None else float(softcap), interpret)
    return per_device(lambda q, k, v, s: _flash(q, k, v, s, settings), mesh, query, key, value, segment_ids)


@dataclass(frozen=True)
class _Settings:
    scale: float
    window: int | None
    softcap: float | None
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(query, key, value, segment_ids, settings: _Settings):
    return _forward(query, key, value, segment_ids, settings)[0]


def _flash_forward(query, key, value, segment_ids, settings):
    out, lse = _forward(query, key, value, segment_ids, settings)
    return out, (query, key, value, segment_ids, out, lse)


def _flash_backward(settings, residuals, d_out):
    query, key, value, segment_ids, out, lse = residuals
    # delta_i = sum_h o_ih * do_ih: what every probability's gradient is offset by (FlashAttention-2).
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    d_query = _dq(query, key, value, segment_ids, d_out, lse, delta, settings)
    d_key, d_value = _dkdv(query, key, value, segment_ids, d_out, lse, delta, settings)
    return d_query, d_key, d_value, None


_flash.defvjp(_flash_forward, _flash_backward)


# --- what the three kernels share --------------------------------------------------------------


def _scores(q, k, q_first, k_first, q_segments, k_segments, settings: _Settings):
    """A tile's logits, soft-capped and masked: (scores, tanh of the capped logits or None)."""
    from jax.experimental.pallas import triton as plgpu

    scores = plgpu.dot(q, k.T) * settings.scale  # float32 accumulation
    capped = None
    if settings.softcap is not None:
        capped = jnp.tanh(scores / settings.softcap)
        scores = settings.softcap * capped
    q_pos = q_first + jnp.arange(q.shape[0])[:, None]
    k_pos = k_first + jnp.arange(k.shape[0])[None, :]
    visible = (q_pos >= k_pos) & (q_segments[:, None] == k_segments[None, :])
    if settings.window is not None:
        visible &= q_pos - k_pos < settings.window
    return jnp.where(visible, scores, MASKED), capped


def _score_gradient(probs, d_probs, delta, capped, settings: _Settings):
    """d loss / d (q·k) of a tile, from the probabilities and their gradient."""
    d_scores = probs * (d_probs - delta[:, None])
    if capped is not None:
        d_scores = d_scores * (1.0 - capped * capped)  # d/dx cap·tanh(x/cap)
    return d_scores * settings.scale


def _key_tiles(q_tile: int, q_len: int, k_len: int, window: int | None):
    """The key tiles [first, end) that queries [q_tile·q_len, +q_len) can see."""
    end = lax.div((q_tile + 1) * q_len + k_len - 1, k_len)  # causal: keys up to the last query
    if window is None:
        return 0, end
    lowest = jnp.maximum(q_tile * q_len - window + 1, 0)  # the first query's oldest visible key
    return lax.div(lowest, k_len), end


def _query_tiles(k_tile: int, q_len: int, k_len: int, t: int, window: int | None):
    """The query tiles [first, end) that see keys [k_tile·k_len, +k_len)."""
    first = lax.div(k_tile * k_len, q_len)
    if window is None:
        return first, t // q_len
    newest = (k_tile + 1) * k_len - 1 + window  # one past the last query that sees the last key
    return first, jnp.minimum(lax.div(newest + q_len - 1, q_len), t // q_len)


def _call(kernel, grid, in_specs, out_specs, out_shape, tiles: Tiles, settings: _Settings, name: str):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=settings.interpret,
        name=name,
    )


def _whole(t, h):
    """A BlockSpec of one row's whole sequence of one head, (t, h); grid (tile, row, head)."""
    from jax.experimental import pallas as pl

    return pl.BlockSpec((None, t, None, h), lambda i, b, n: (b, 0, n, 0))


# --- forward -----------------------------------------------------------------------------------


def _forward(query, key, value, segment_ids, settings: _Settings):
    from jax.experimental import pallas as pl

    b, t, n, h = query.shape
    groups = n // key.shape[2]
    tiles = tiles_for(h, t, query.dtype.itemsize)
    q_len, k_len = tiles.forward
    kv_spec = pl.BlockSpec((None, t, None, h), lambda i, r, m: (r, 0, m // groups, 0))
    in_specs = [
        pl.BlockSpec((None, q_len, None, h), lambda i, r, m: (r, i, m, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, t), lambda i, r, m: (r, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, q_len, None, h), lambda i, r, m: (r, i, m, 0)),
        pl.BlockSpec((None, None, q_len), lambda i, r, m: (r, m, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct(query.shape, query.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)]
    kernel = functools.partial(_forward_kernel, q_len=q_len, k_len=k_len, settings=settings)
    return _call(kernel, (t // q_len, b, n), in_specs, out_specs, out_shape, tiles, settings, "jaxtune_flash_forward")(
        query, key, value, segment_ids
    )


def _forward_kernel(q_ref, k_ref, v_ref, segments_ref, out_ref, lse_ref, *, q_len, k_len, settings: _Settings):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    tile = pl.program_id(0)
    t, h = k_ref.shape
    q = q_ref[...]
    q_segments = segments_ref[pl.ds(tile * q_len, q_len)]

    def step(k_tile, carry):
        out, top, total = carry
        keys = pl.ds(k_tile * k_len, k_len)
        scores, _ = _scores(q, k_ref[keys, :], tile * q_len, k_tile * k_len, q_segments, segments_ref[keys], settings)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        shrink = jnp.exp(top - new_top)  # what the sums so far were taken against, rescaled
        probs = jnp.exp(scores - new_top[:, None])
        out = out * shrink[:, None] + plgpu.dot(probs.astype(v_ref.dtype), v_ref[keys, :])
        return out, new_top, total * shrink + probs.sum(axis=-1)

    first, end = _key_tiles(tile, q_len, k_len, settings.window)
    start = (
        jnp.zeros((q_len, h), jnp.float32),
        jnp.full((q_len,), -jnp.inf, jnp.float32),
        jnp.zeros((q_len,), jnp.float32),
    )
    out, top, total = lax.fori_loop(first, end, step, start)
    out_ref[...] = (out / total[:, None]).astype(out_ref.dtype)
    lse_ref[...] = top + jnp.log(total)


# --- backward ----------------------------------------------------------------------------------


def _dq(query, key, value, segment_ids, d_out, lse, delta, settings: _Settings):
    from jax.experimental import pallas as pl

    b, t, n, h = query.shape
    groups = n // key.shape[2]
    tiles = tiles_for(h, t, query.dtype.itemsize)
    q_len, k_len = tiles.dq
    q_spec = pl.BlockSpec((None, q_len, None, h), lambda i, r, m: (r, i, m, 0))
    kv_spec = pl.BlockSpec((None, t, None, h), lambda i, r, m: (r, 0, m // groups, 0))
    row_spec = pl.BlockSpec((None, None, q_len), lambda i, r, m: (r, m, i))
    in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, t), lambda i, r, m: (r, 0)), q_spec, row_spec, row_spec]
    kernel = functools.partial(_dq_kernel, q_len=q_len, k_len=k_len, settings=settings)
    return _call(
        kernel,
        (t // q_len, b, n),
        in_specs,
        q_spec,
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        tiles,
        settings,
        "jaxtune_flash_dq",
    )(query, key, value, segment_ids, d_out, lse, delta)


def _dq_kernel(
    q_ref, k_ref, v_ref, segments_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *, q_len, k_len, settings: _Settings
):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    tile = pl.program_id(0)
    t, h = k_ref.shape
    q, d_out, lse, delta = q_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]
    q_segments = segments_ref[pl.ds(tile * q_len, q_len)]

    def step(k_tile, dq):
        keys = pl.ds(k_tile * k_len, k_len)
        k = k_ref[keys, :]
        scores, capped = _scores(q, k, tile * q_len, k_tile * k_len, q_segments, segments_ref[keys], settings)
        probs = jnp.exp(scores - lse[:, None])
        d_scores = _score_gradient(probs, plgpu.dot(d_out, v_ref[keys, :].T), delta, capped, settings)
        return dq + plgpu.dot(d_scores.astype(k.dtype), k)

    first, end = _key_tiles(tile, q_len, k_len, settings.window)
    dq = lax.fori_loop(first, end, step, jnp.zeros((q_len, h), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv(query, key, value, segment_ids, d_out, lse, delta, settings: _Settings):
    """dk and dv of each key/value head: a program per key tile and head, looping over the query
    heads of its group (float32 sums, rounded once), so no per-query-head copy is ever stored."""
    from jax.experimental import pallas as pl

    b, t, n, h = query.shape
    kv = key.shape[2]
    groups = n // kv
    tiles = tiles_for(h, t, query.dtype.itemsize)
    q_len, k_len = tiles.dkdv
    kv_spec = pl.BlockSpec((None, k_len, None, h), lambda j, r, m: (r, j, m, 0))
    group = pl.BlockSpec((None, t, groups, h), lambda j, r, m: (r, 0, m, 0))  # the query heads of key head m
    rows = pl.BlockSpec((None, groups, t), lambda j, r, m: (r, m, 0))
    in_specs = [group, kv_spec, kv_spec, pl.BlockSpec((None, t), lambda j, r, m: (r, 0)), group, rows, rows]
    out_shape = jax.ShapeDtypeStruct(key.shape, key.dtype)
    kernel = functools.partial(_dkdv_kernel, q_len=q_len, k_len=k_len, groups=groups, settings=settings)
    return tuple(
        _call(
            kernel,
            (t // k_len, b, kv),
            in_specs,
            [kv_spec, kv_spec],
            [out_shape, out_shape],
            tiles,
            settings,
            "jaxtune_flash_dkdv",
        )(query, key, value, segment_ids, d_out, lse, delta)
    )


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    segments_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    q_len,
    k_len,
    groups,
    settings: _Settings,
):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    tile = pl.program_id(0)
    t, h = q_ref.shape[0], q_ref.shape[2]
    k, v = k_ref[...], v_ref[...]
    k_segments = segments_ref[pl.ds(tile * k_len, k_len)]

    def step(head, q_tile, carry):
        dk, dv = carry
        queries = pl.ds(q_tile * q_len, q_len)
        q, d_out = q_ref[queries, head, :], d_out_ref[queries, head, :]
        scores, capped = _scores(q, k, q_tile * q_len, tile * k_len, segments_ref[queries], k_segments, settings)
        probs = jnp.exp(scores - lse_ref[head, queries][:, None])
        dv = dv + plgpu.dot(probs.astype(d_out.dtype).T, d_out)
        d_scores = _score_gradient(probs, plgpu.dot(d_out, v.T), delta_ref[head, queries], capped, settings)
        return dk + plgpu.dot(d_scores.astype(q.dtype).T, q), dv

    first, end = _query_tiles(tile, q_len, k_len, t, settings.window)
    zeros = jnp.zeros((k_len, h), jnp.float32)
    carry = (zeros, zeros)
    for head in range(groups):  # unrolled: each query head of the group adds to the same sums
        carry = lax.fori_loop(first, end, functools.partial(step, head), carry)
    dk_ref[...], dv_ref[...] = (x.astype(dk_ref.dtype) for x in carry)
