"""What the train step is fed: endless micro-batches of one run, packed or padded, and their largest shape.

Packed (the default where the model's attention isolates segments): every micro-batch is the
same (S, L), so the step compiles once and nearly every slot is a real token. Padded:
`batch_size` rows right-padded to a length bucket, one program per bucket. Both are
deterministic in (rows, settings, seed), so a resumed run regenerates them and skips ahead.

Preference pairs (rows 2p and 2p+1 of the table: a chosen and a rejected answer) travel
together: packed, a pair is one unit of the plan, its two rows adjacent segments of one
sequence; padded, a micro-batch is `batch_size` pairs as 2 * batch_size rows, chosen rows even.
Each micro-batch then also carries `reference`, the reference log-probability of each segment
(see `preference.summed_objective`). `batch_size` counts pairs, as TRL's does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from jaxtune.config import TrainConfig
from jaxtune.runtime.compiled.batches import bucket_length, pad_batch, train_batches
from jaxtune.runtime.train import packing


@dataclass(frozen=True)
class Feed:
    packed: bool
    rows: int  # sequences per micro-batch (packed) or rows per micro-batch (padded)
    length: int  # the longest sequence a micro-batch can have: what the memory plan is made for
    micro_batches_per_epoch: int
    seed: int
    lengths: tuple[int, ...]
    planned_rows: int = 0  # packed: the sequences rows are packed into, before padding to `rows` for the mesh
    segments: int = 0  # pairs: the columns of `reference`, the most segments a sequence can hold (1: padded)
    multiple: int = 1  # every length a multiple of it: the attention kernel's tile (splash: 128 tokens)

    def micro_batches(
        self,
        input_ids: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        pad_id: int,
        reference: np.ndarray | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Endless numpy micro-batches: input_ids, attention_mask, segment_ids, position_ids, labels
        (rows, t); for pairs also `reference` (rows, segments), from `reference` (a value per table row)."""
        pairs = self.segments > 0
        reference = np.zeros(len(input_ids), np.float32) if pairs and reference is None else reference
        if self.packed:
            planned = packing.PackedShape(self.planned_rows or self.rows, self.length)
            for bins in packing.packed_micro_batches(self.lengths, planned, self.seed):
                if pairs:  # a bin of pairs -> its rows, each pair's chosen row then its rejected row
                    bins = [[row for p in units for row in (2 * p, 2 * p + 1)] for units in bins]
                batch = packing.pack(input_ids, labels, bins, pad_id, packing.PackedShape(self.rows, self.length))
                if pairs:
                    batch["reference"] = _per_segment(reference, bins, self.rows, self.segments)
                yield batch
            return
        units = len(self.lengths)
        for chosen in train_batches(units, self.rows // 2 if pairs else self.rows, self.seed):
            rows = [row for p in chosen for row in (2 * p, 2 * p + 1)] if pairs else list(chosen)
            longest = max(len(input_ids[r]) for r in rows) if pairs else max(self.lengths[r] for r in rows)
            length = bucket_length(longest, self.length, self.multiple)
            batch = pad_batch([input_ids[r] for r in rows], [labels[r] for r in rows], pad_id, length, self.rows)
            batch = {**batch, **packing.unpacked_segments(batch["attention_mask"])}
            if pairs:
                batch["reference"] = np.asarray(reference, np.float32)[rows][:, None]
            yield batch


def _per_segment(reference: np.ndarray, bins: list[list[int]], rows: int, segments: int) -> np.ndarray:
    """(rows, segments) float32: entry [s, k] the value of the row in segment k+1 of sequence s, 0 where none."""
    out = np.zeros((rows, segments), np.float32)
    for s, members in enumerate(bins):
        out[s, : len(members)] = np.asarray(reference, np.float32)[members]
    return out


def make_feed(
    lengths: Sequence[int],
    cfg: TrainConfig,
    max_length: int,
    batch_shards: int,
    packed: bool,
    pairs: bool = False,
    multiple: int = 1,
) -> Feed:
    """The feed of `cfg`'s run over rows of `lengths`; `batch_shards` devices (data × fsdp) split each
    micro-batch. `pairs`: the rows are preference pairs (2p chosen, 2p+1 rejected). `multiple`: every
    sequence length a multiple of it (the attention kernel's tile, `attention.length_multiple`)."""
    if pairs:
        return _pair_feed(np.asarray(lengths), cfg, max_length, batch_shards, packed, multiple)
    lengths = tuple(int(n) for n in lengths)
    if packed:
        # Planned as on one device, then padded with empty sequences to split evenly: the mesh
        # never changes which rows a step trains on, so every mesh computes the same losses.
        shape = packing.packed_shape(lengths, cfg.batch_size, max_length, seed=cfg.seed, multiple=multiple)
        per_epoch = packing.micro_batches_per_epoch(lengths, shape, cfg.seed)
        rows = -(-shape.sequences // batch_shards) * batch_shards
        return Feed(
            True, rows, shape.length, per_epoch, cfg.seed, lengths, planned_rows=shape.sequences, multiple=multiple
        )
    if cfg.batch_size % batch_shards:
        raise ValueError(
            f"train.batch_size={cfg.batch_size} must divide over the {batch_shards} devices the batch is split over (mesh data × fsdp)"
        )
    if len(lengths) < cfg.batch_size:
        raise ValueError(f"{len(lengths)} training rows is fewer than one batch of {cfg.batch_size}")
    length = bucket_length(max(lengths), max_length, multiple)
    return Feed(False, cfg.batch_size, length, len(lengths) // cfg.batch_size, cfg.seed, lengths, multiple=multiple)


def _pair_feed(
    lengths: np.ndarray, cfg: TrainConfig, max_length: int, batch_shards: int, packed: bool, multiple: int = 1
) -> Feed:
    """`make_feed` of preference pairs: packed, each pair is one unit of the plan, as long as its two rows."""
    if len(lengths) % 2:
        raise ValueError(f"{len(lengths)} rows are not whole preference pairs (chosen row, then rejected row)")
    units = tuple(int(n) for n in lengths[0::2] + lengths[1::2])
    if packed:
        # A pair's two rows never split: the sequence must hold both, so it may need up to twice max_length.
        shape = packing.packed_shape(units, cfg.batch_size, 2 * max_length, seed=cfg.seed, multiple=multiple)
        per_epoch = packing.micro_batches_per_epoch(units, shape, cfg.seed)
        rows = -(-shape.sequences // batch_shards) * batch_shards
        segments = 2 * (shape.length // min(units))  # the most pairs a sequence can hold, two rows each
        return Feed(
            True,
            rows,
            shape.length,
            per_epoch,
            cfg.seed,
            units,
            planned_rows=shape.sequences,
            segments=segments,
            multiple=multiple,
        )
    if (2 * cfg.batch_size) % batch_shards:
        raise ValueError(
            f"train.batch_size={cfg.batch_size} pairs (twice as many rows) must divide over the "
            f"{batch_shards} devices the batch is split over (mesh data × fsdp)"
        )
    if len(units) < cfg.batch_size:
        raise ValueError(f"{len(units)} training pairs is fewer than one batch of {cfg.batch_size}")
    length = bucket_length(int(lengths.max()), max_length, multiple)
    return Feed(
        False, 2 * cfg.batch_size, length, len(units) // cfg.batch_size, cfg.seed, units, segments=1, multiple=multiple
    )
