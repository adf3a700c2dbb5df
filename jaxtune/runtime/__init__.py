"""The only package that imports torchax and JAX.

A Hugging Face PyTorch model is loaded on CPU with torchax disabled, its parameters move to
JAX arrays, and every forward runs as `torch.func.functional_call` inside a scoped
`with env:` block, compiled by `jax.jit`.
"""

from jaxtune.runtime.compat import torchax_env

# Every later `import torchax...` in the runtime finds the module already loaded under the shim.
torchax_env()
