"""jaxtune: fine-tune Hugging Face causal LMs on JAX through torchax, as a cached Prefect pipeline.

At the root: the `jaxtune` command's package (`cli`), the config, the errors and the JSON records
one stage writes and another reads (`records`); every other module lives in a package named for
its concern, whose docstring says which packages it may import (tests/test_layering.py checks them).

May import: jaxtune.host
"""

from jaxtune.host.accelerators import cpu_without_accelerators

__version__ = "0.1.0"

# Before anything imports JAX: on a machine with no TPU or GPU, JAX's installed plugins stay quiet.
cpu_without_accelerators()
