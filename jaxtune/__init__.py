"""jaxtune: fine-tune Hugging Face causal LMs on JAX through torchax, as a cached Prefect pipeline."""

from jaxtune.host.accelerators import cpu_without_accelerators

__version__ = "0.1.0"

# Before anything imports JAX: on a machine with no TPU or GPU, JAX's installed plugins stay quiet.
cpu_without_accelerators()
