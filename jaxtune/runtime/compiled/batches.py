"""Token rows -> padded numpy batches. Lengths round up to a few bucket sizes so few shapes compile."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from jaxtune.data.tokenize import IGNORE_INDEX

BUCKET = 16  # the length unit: every padded length is a multiple of it


def _bucket_units():
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ...: each at most 1.5x the one before."""
    yield from (1, 2, 3)
    power = 4
    while True:
        yield power
        yield power + power // 2
        power *= 2


def bucket_length(longest: int, cap: int | None = None, multiple: int = 1) -> int:
    """`longest` padded up to the next of 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, ... but never
    past `cap` (when one is given). Every distinct length compiles its own program, so lengths
    grow geometrically: 512 tokens need 10 programs rather than 32, for at most 1.5x padding.
    `multiple`: then rounded up to a multiple of it, past `cap` if need be (an attention kernel's
    tile: `attention.length_multiple`)."""
    units = -(-longest // BUCKET)
    rounded = BUCKET * next(u for u in _bucket_units() if u >= units)
    length = rounded if cap is None else min(rounded, max(cap, longest))
    return -(-length // multiple) * multiple


def row_lengths(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """The length of every row: a lazy table's `lengths` as they are, without reading the rows."""
    lengths = getattr(rows, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths)
    return np.fromiter((len(row) for row in rows), np.int64, len(rows))


def pad_batch(
    input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int, length: int, rows: int
) -> dict[str, np.ndarray]:
    """Right-pad to (rows, length); padding rows beyond the data have no scored tokens."""
    ids = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    lab = np.full((rows, length), IGNORE_INDEX, np.int32)
    for r, (seq, seq_labels) in enumerate(zip(input_ids, labels)):
        n = len(seq)
        ids[r, :n], mask[r, :n], lab[r, :n] = seq, 1, seq_labels
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


# What a right-padded column holds, per batch key (position ids continue their row's count).
PADDING = {"attention_mask": 0, "segment_ids": 0, "labels": IGNORE_INDEX}


def stack_micro_batches(parts: Sequence[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """A step's micro-batches as (k, rows, t) arrays, each right-padded to the longest one's t: padded
    micro-batches of one step may fall in different length buckets (the extra columns score nothing)."""
    t = max(part["input_ids"].shape[-1] for part in parts)

    def padded(name: str, a: np.ndarray) -> np.ndarray:
        if name == "reference" or a.shape[-1] == t:
            return a
        if name == "position_ids":
            return np.concatenate(
                [a, np.broadcast_to(np.arange(a.shape[-1], t, dtype=a.dtype), (*a.shape[:-1], t - a.shape[-1]))], -1
            )
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, t - a.shape[-1])], constant_values=PADDING.get(name, pad_id))

    return {name: np.stack([padded(name, part[name]) for part in parts]) for name in parts[0]}


def epoch_order(n_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def train_batches(n_rows: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless row indices, reshuffled each epoch; the last partial batch of an epoch is dropped."""
    if n_rows < batch_size:
        raise ValueError(f"{n_rows} training rows is fewer than one batch of {batch_size}")
    epoch = 0
    while True:
        order = epoch_order(n_rows, seed, epoch)
        for start in range(0, n_rows - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        epoch += 1
