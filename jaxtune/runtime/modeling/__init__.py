"""The model as pure JAX functions: a Hugging Face model loaded, given LoRA or kept whole and
moved to JAX (`model`), read from its checkpoint a decoder layer at a time (`streaming`), its
frozen base held quantized (`quantize`), quantized as it is read, its forward pass (`forward`)
with fused attention and the platform kernels behind it (`attention`, `splash`, `gpu_flash`),
what each layer keeps for the backward pass (`remat`), and the chunked loss (`loss`).

May import: jaxtune.config, jaxtune.errors, jaxtune.data, jaxtune.runtime.compat, jaxtune.runtime.devices
"""
