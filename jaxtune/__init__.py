"""jaxtune: fine-tune Hugging Face causal LMs on JAX through torchax, as a cached Prefect pipeline."""

__version__ = "0.1.0"
