"""What the train step is fed: endless micro-batches of one run, packed or padded, and their largest shape.

Packed (the default where the model's attention isolates segments): every micro-batch is the
same (S, L), so the step compiles once and nearly every slot is a real token. Padded:
`batch_size` rows right-padded to a length bucket, one program per bucket. Both are
deterministic in (rows, settings, seed), so a resumed run regenerates them and skips ahead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from jaxtune.config import TrainConfig
from jaxtune.runtime import packing
from jaxtune.runtime.batches import bucket_length, pad_batch, train_batches


@dataclass(frozen=True)
class Feed:
    packed: bool
    rows: int  # sequences per micro-batch (packed) or rows per micro-batch (padded)
    length: int  # the longest sequence a micro-batch can have: what the memory plan is made for
    micro_batches_per_epoch: int
    seed: int
    lengths: tuple[int, ...]
    planned_rows: int = 0  # packed: the sequences rows are packed into, before padding to `rows` for the mesh

    def micro_batches(self, input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]],
                      pad_id: int) -> Iterator[dict[str, np.ndarray]]:
        """Endless numpy micro-batches: input_ids, attention_mask, segment_ids, position_ids, labels (rows, t)."""
        if self.packed:
            planned = packing.PackedShape(self.planned_rows or self.rows, self.length)
            for bins in packing.packed_micro_batches(self.lengths, planned, self.seed):
                yield packing.pack(input_ids, labels, bins, pad_id, packing.PackedShape(self.rows, self.length))
            return
        for rows in train_batches(len(self.lengths), self.rows, self.seed):
            length = bucket_length(max(self.lengths[r] for r in rows), self.length)
            batch = pad_batch([input_ids[r] for r in rows], [labels[r] for r in rows], pad_id, length, self.rows)
            yield {**batch, **packing.unpacked_segments(batch["attention_mask"])}


def make_feed(lengths: Sequence[int], cfg: TrainConfig, max_length: int, batch_shards: int, packed: bool) -> Feed:
    """The feed of `cfg`'s run over rows of `lengths`; `batch_shards` devices (data × fsdp) split each micro-batch."""
    lengths = tuple(int(n) for n in lengths)
    if packed:
        # Planned as on one device, then padded with empty sequences to split evenly: the mesh
        # never changes which rows a step trains on, so every mesh computes the same losses.
        shape = packing.packed_shape(lengths, cfg.batch_size, max_length, seed=cfg.seed)
        per_epoch = packing.micro_batches_per_epoch(lengths, shape, cfg.seed)
        rows = -(-shape.sequences // batch_shards) * batch_shards
        return Feed(True, rows, shape.length, per_epoch, cfg.seed, lengths, planned_rows=shape.sequences)
    if cfg.batch_size % batch_shards:
        raise ValueError(f"train.batch_size={cfg.batch_size} must divide over the {batch_shards} devices the batch is split over (mesh data × fsdp)")
    if len(lengths) < cfg.batch_size:
        raise ValueError(f"{len(lengths)} training rows is fewer than one batch of {cfg.batch_size}")
    length = bucket_length(max(lengths), max_length)
    return Feed(False, cfg.batch_size, length, len(lengths) // cfg.batch_size, cfg.seed, lengths)
