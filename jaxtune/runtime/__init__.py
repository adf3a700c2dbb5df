"""The only package that imports torchax and JAX.

A Hugging Face PyTorch model is loaded on CPU with torchax disabled, its parameters move to
JAX arrays, and every forward runs as `torch.func.functional_call` inside a scoped
`with env:` block, compiled by `jax.jit`.

Its sub-packages, each importing only those listed before it: `devices` (mesh, sharding,
processes, targets), `modeling` (the model as pure JAX functions), `compiled` (the jitted steps
and programs), `decoding`, `measures` (memory plans, FLOPs, parity) and `train` (the loop).
`compat`, the torch 2.13 shim, is run here before any of them.

May import: nothing from jaxtune
"""

from jaxtune.runtime.compat import torchax_env

# Every later `import torchax...` in the runtime finds the module already loaded under the shim.
torchax_env()
