"""Chunked cross-entropy (`jaxtune.runtime.modeling.loss`) against the full-logits path it replaces."""

import jax
import jax.numpy as jnp
import pytest

from jaxtune.data.tokenize import IGNORE_INDEX
from jaxtune.runtime.modeling.loss import chunk_tokens_for, chunk_tokens_on, head_token_nll, linear_token_nll

pytestmark = pytest.mark.training

B, T, D, V = 3, 11, 16, 50  # 30 scored positions: chunks of 8 and 7 leave a partial last chunk
CHUNK = 8


def reference_nll(hidden, weight, labels, bias=None, softcap=None):
    """The full-logits path: logits in the compute dtype -> float32 -> softcap -> log_softmax -> gather."""
    logits = jnp.einsum("btd,vd->btv", hidden, weight)
    if bias is not None:
        logits = logits + bias
    logits = logits[:, :-1].astype(jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    target = labels[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(target != IGNORE_INDEX, -picked, 0.0)


def make_inputs(dtype=jnp.float32, seed=0):
    kh, kw, kb, kl, km = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(kh, (B, T, D)).astype(dtype)
    weight = (jax.random.normal(kw, (V, D)) / D**0.5 * 3).astype(dtype)
    bias = jax.random.normal(kb, (V,)).astype(dtype)
    labels = jax.random.randint(kl, (B, T), 0, V)
    labels = jnp.where(jax.random.bernoulli(km, 0.3, (B, T)), IGNORE_INDEX, labels).at[0, :4].set(IGNORE_INDEX)
    return hidden, weight, bias, labels


# Ways callers reduce the per-token NLL: all summed (constant cotangent), per row, per token weighted.
REDUCTIONS = {
    "sum": lambda nll: nll.sum(),
    "per_row": lambda nll: (nll.sum(-1) * jnp.arange(1.0, B + 1)).sum(),
    "per_token": lambda nll: (nll * jax.random.uniform(jax.random.key(7), nll.shape)).sum(),
}


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def grads(nll_fn, reduce, hidden, weight, bias):
    return jax.grad(lambda h, w, b: reduce(nll_fn(h, w, b)), argnums=(0, 1, 2))(hidden, weight, bias)


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("chunk", [CHUNK, 7])
def test_linear_values_match_full_logits(softcap, use_bias, chunk):
    hidden, weight, bias, labels = make_inputs()
    bias = bias if use_bias else None
    got = linear_token_nll(hidden, weight, labels, bias, softcap, chunk_tokens=chunk)
    want = reference_nll(hidden, weight, labels, bias, softcap)
    assert got.shape == (B, T - 1) and got.dtype == jnp.float32
    assert jnp.all(jnp.where(labels[:, 1:] == IGNORE_INDEX, got == 0, True))
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
def test_frozen_head_gradient_of_hidden_matches_full_logits(softcap, reduction):
    """Only the hidden states differentiated (LoRA's frozen head): their gradient is taken in the forward pass."""
    hidden, weight, bias, labels = make_inputs()
    reduce = REDUCTIONS[reduction]
    got = jax.grad(lambda h: reduce(linear_token_nll(h, weight, labels, bias, softcap, CHUNK)))(hidden)
    want = jax.grad(lambda h: reduce(reference_nll(h, weight, labels, bias, softcap)))(hidden)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
def test_linear_gradients_match_full_logits(softcap, use_bias, reduction):
    hidden, weight, bias, labels = make_inputs()
    bias = bias if use_bias else jnp.zeros_like(bias)  # a zero bias still gets its gradient checked
    got = grads(
        lambda h, w, b: linear_token_nll(h, w, labels, b, softcap, CHUNK), REDUCTIONS[reduction], hidden, weight, bias
    )
    want = grads(lambda h, w, b: reference_nll(h, w, labels, b, softcap), REDUCTIONS[reduction], hidden, weight, bias)
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-5


def test_linear_gradients_without_bias():
    hidden, weight, _, labels = make_inputs()
    got = jax.grad(lambda h, w: linear_token_nll(h, w, labels, None, None, CHUNK).sum(), argnums=(0, 1))(hidden, weight)
    want = jax.grad(lambda h, w: reference_nll(h, w, labels).sum(), argnums=(0, 1))(hidden, weight)
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-5


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_bfloat16_matches_full_logits_loosely(softcap):
    # Both paths round the logits to bfloat16 before float32, but the chunked matmuls (and the
    # float32 accumulation of the weight gradient across chunks) round differently: ~1e-3 apart.
    hidden, weight, bias, labels = make_inputs(jnp.bfloat16)
    got = linear_token_nll(hidden, weight, labels, bias, softcap, CHUNK)
    want = reference_nll(hidden, weight, labels, bias, softcap)
    assert got.dtype == jnp.float32 and rel(got, want) < 1e-2
    reduce = REDUCTIONS["per_token"]
    g_got = grads(lambda h, w, b: linear_token_nll(h, w, labels, b, softcap, CHUNK), reduce, hidden, weight, bias)
    g_want = grads(lambda h, w, b: reference_nll(h, w, labels, b, softcap), reduce, hidden, weight, bias)
    for g, w in zip(g_got, g_want):
        assert g.dtype == jnp.bfloat16 and rel(g, w) < 1e-2


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("reduction", ["sum", "per_token"])
def test_head_with_closed_over_weights_matches(softcap, reduction):
    hidden, weight, bias, labels = make_inputs()

    def head_nll(h, w, b):
        return head_token_nll(h, lambda x: x @ w.T + b, labels, 7, softcap=softcap)  # w, b closed over

    assert rel(head_nll(hidden, weight, bias), reference_nll(hidden, weight, labels, bias, softcap)) < 1e-5
    got = grads(head_nll, REDUCTIONS[reduction], hidden, weight, bias)
    want = grads(lambda h, w, b: reference_nll(h, w, labels, b, softcap), REDUCTIONS[reduction], hidden, weight, bias)
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-5


def test_jit_and_chunk_larger_than_batch():
    hidden, weight, bias, labels = make_inputs()
    got = jax.jit(lambda h, w: linear_token_nll(h, w, labels, chunk_tokens=4096))(hidden, weight)
    assert rel(got, reference_nll(hidden, weight, labels)) < 1e-5


def test_chunk_tokens_for():
    assert chunk_tokens_for(262_144) == 64  # Gemma 3: 64 tokens x 262k x 4 bytes = 64 MiB
    assert chunk_tokens_for(32_000) == 520
    assert chunk_tokens_for(10**9) == 8
    assert all(chunk_tokens_for(v) % 8 == 0 for v in (1000, 49_152, 151_936))


def test_accelerators_take_chunks_of_at_least_512_tokens():
    assert [chunk_tokens_on(platform, 262_144) for platform in ("cpu", None, "tpu", "gpu")] == [64, 64, 512, 512]
    assert chunk_tokens_on("gpu", 32_000) == 520 and chunk_tokens_on("gpu", 1000) == chunk_tokens_for(1000) == 16776


def count_dots(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_frozen_head_skips_weight_gradient_matmul():
    hidden, weight, _, labels = make_inputs()

    def loss(h, w):
        return linear_token_nll(h, w, labels, chunk_tokens=CHUNK).sum()

    hidden_only = count_dots(jax.grad(loss, argnums=0), hidden, weight)
    both = count_dots(jax.grad(loss, argnums=(0, 1)), hidden, weight)
    # A frozen head: logits and d_hidden, both in the forward scan (as many matmuls as an unchunked loss).
    # A trained one: forward logits; backward recomputed logits, d_hidden and d_weight.
    assert (hidden_only, both) == (2, 4)


def test_chunked_backward_keeps_no_full_logits():
    # Full float32 logits here would be 4 x 512 x 32000 x 4 bytes = 250 MiB; one 128-token chunk is 15.6 MiB.
    b, t, d, v = 4, 513, 64, 32_000
    shapes = (
        jax.ShapeDtypeStruct((b, t, d), jnp.float32),
        jax.ShapeDtypeStruct((v, d), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
    )

    def temp_bytes(nll_fn):
        step = jax.jit(jax.grad(lambda h, w, l: nll_fn(h, w, l).sum(), argnums=(0, 1)))
        return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    full = temp_bytes(reference_nll)
    linear = temp_bytes(lambda h, w, l: linear_token_nll(h, w, l, chunk_tokens=128))
    head = temp_bytes(lambda h, w, l: head_token_nll(h, lambda x: x @ w.T, l, 128))
    print(f"temp bytes: full {full}, linear {linear}, head {head}")
    assert full >= b * (t - 1) * v * 4
    assert linear < full / 4 and head < full / 4
