"""What XLA compiles and runs: the jitted train and eval steps (`steps`), the programs every model
of one structure shares in a process (`programs`), the objectives the steps optimise
(`preference`, supervised included) and the padded batches they take (`batches`).

May import: jaxtune.config, jaxtune.errors, jaxtune.data, jaxtune.runtime.compat, jaxtune.runtime.devices, \
jaxtune.runtime.modeling
"""
