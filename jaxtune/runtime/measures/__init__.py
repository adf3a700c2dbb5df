"""What a run costs and whether it is right, measured before or while it trains: the memory plan
XLA compiles for the train step (`memory`), the batch split and remat policy chosen from those
plans (`fit`), FLOPs per token against the chip's peak (`flops`), and the JAX path against
PyTorch eager on the same tensors (`parity`).

May import: jaxtune.config, jaxtune.errors, jaxtune.data, jaxtune.runtime.compat, jaxtune.runtime.devices, \
jaxtune.runtime.modeling, jaxtune.runtime.compiled, jaxtune.runtime.decoding
"""
