"""Flash attention for NVIDIA GPUs (`gpu_flash`) compiled by XLA:GPU for compile-only H100s and
H200s: Triton assembles each kernel for Hopper then, so a tile too big for its shared memory
would fail here (`RESOURCE_EXHAUSTED: Shared memory size limit exceeded`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtune.runtime.devices import targets
from jaxtune.runtime.devices.mesh import lowering
from jaxtune.runtime.modeling import attention, gpu_flash
from jaxtune.runtime.modeling.remat import tied_checkpoint

pytestmark = pytest.mark.target

ROWS, LENGTH = 8, 2048


def _compiled(target: str, core: str, heads: int, kv_heads: int, head: int, window: int | None, dtype=jnp.bfloat16):
    """Attention's forward and backward pass, ROWS x LENGTH tokens, on one compile-only GPU."""
    device = targets.devices(targets.resolve(target))[0]
    mesh = Mesh([device], ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shape = lambda *dims, dtype=dtype: jax.ShapeDtypeStruct(dims, dtype, sharding=replicated)  # noqa: E731
    settings = dict(scale=head**-0.5, window=window, softcap=None)

    def gradients(q, k, v, segments):
        if core == "flash":
            run = lambda q, k, v: gpu_flash.attention(q, k, v, segments, **settings)  # noqa: E731
        else:  # as attention.fused_attention runs XLA's core
            run = tied_checkpoint(
                lambda q, k, v: attention._core(q, k, v, segments, dropout=0.0, dropout_key=None, **settings)
            )
        return jax.grad(lambda q, k, v: run(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    kv = shape(ROWS, LENGTH, kv_heads, head)
    with lowering(mesh):
        return (
            jax.jit(gradients)
            .lower(shape(ROWS, LENGTH, heads, head), kv, kv, shape(ROWS, LENGTH, dtype=jnp.int32))
            .compile()
        )


# Gemma 3 1B's layers (4 query heads on one key/value head of 256; sliding and global) and
# Llama 3.2 1B's (32 on 8 of 64). Measured on h200: 32.5 MiB of temporaries against XLA's
# 1,280.0 MiB for Gemma, 68.0 against 10,274.0 MiB for Llama: little more than one bf16 array of
# the queries' shape (32.0 and 64.0 MiB). The dk/dv kernel sums each group's query heads itself;
# when it wrote dk and dv per query head in float32 and summed them after, Gemma's were 160.5 MiB
# and Llama's 324.0.
@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize(
    "heads, kv_heads, head, window",
    [(4, 1, 256, 512), (4, 1, 256, None), (32, 8, 64, None)],
    ids=["gemma3-sliding", "gemma3-global", "llama3"],
)
def test_flash_attention_compiles_for_hopper_and_never_holds_the_scores(target, heads, kv_heads, head, window):
    flash = _compiled(target, "flash", heads, kv_heads, head, window)
    text = flash.as_text()
    kernels = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "(jaxtune_flash_\w+)"', text)
    assert sorted(set(kernels)) == ["jaxtune_flash_dkdv", "jaxtune_flash_dq", "jaxtune_flash_forward"], kernels
    assert f"{LENGTH},{LENGTH}]" not in text  # no (…, t, t) array anywhere in the program
    xla = _compiled(target, "xla", heads, kv_heads, head, window)
    assert f"{LENGTH},{LENGTH}]" in xla.as_text()
    flash_temporaries, xla_temporaries = (c.memory_analysis().temp_size_in_bytes for c in (flash, xla))
    queries = ROWS * LENGTH * heads * head * 2  # one bf16 array of the queries' shape
    assert flash_temporaries <= 1.1 * queries
    assert flash_temporaries < xla_temporaries / 7


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_float32_heads_of_256_take_tiles_that_fit_hoppers_shared_memory(target):
    """Gemma 3 270M's offline recipe computes in float32: its rows are twice as wide as bf16's, and
    the bf16 tiles would ask for 262,400 bytes of shared memory where a block has 232,448."""
    flash = _compiled(target, "flash", 4, 1, 256, None, dtype=jnp.float32)
    assert "jaxtune_flash_dkdv" in flash.as_text()
