"""The training loop and what it needs on the host: the loop itself around one compiled step
(`training`), the endless micro-batches it is fed (`feed`), rows packed into fixed-length
sequences (`packing`), and checkpoints written atomically (`checkpoint`).

May import: jaxtune.config, jaxtune.errors, jaxtune.records, jaxtune.data, jaxtune.host, jaxtune.runtime.compat, jaxtune.runtime.devices, jaxtune.runtime.modeling, jaxtune.runtime.compiled, jaxtune.runtime.decoding, jaxtune.runtime.measures
"""
