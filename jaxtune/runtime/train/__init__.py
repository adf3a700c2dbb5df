"""The training loop and what it needs on the host: the one loop around one compiled step (`loop`),
fed by a source of batches: the rows' micro-batches for SFT and preference training (`training`,
from `feed`, with rows packed into fixed-length sequences by `packing`) or GRPO's rollouts
(`rollouts`); checkpoints written atomically (`checkpoint`).

May import: jaxtune.config, jaxtune.errors, jaxtune.records, jaxtune.data, jaxtune.host, jaxtune.runtime.compat, jaxtune.runtime.devices, jaxtune.runtime.modeling, jaxtune.runtime.compiled, jaxtune.runtime.decoding, jaxtune.runtime.measures
"""
