"""Sequence packing: several token rows share one fixed-length sequence, kept apart by segment ids.

Padded batching (batches.py) wastes the slots after each short row and compiles one program per
length bucket. Packing fills (S, L) sequences with whole rows, so nearly every slot holds a real
token and every micro-batch has the same shape (one compile). The model attends only within a
segment (causally) and restarts position ids at 0 for each row, so a packed row scores exactly as
it would alone. Pure numpy: the plan (which rows go where) is cheap and deterministic, so a
resumed run regenerates it and skips what it already trained on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from jaxtune.data.tokenize import IGNORE_INDEX
from jaxtune.runtime.compiled.batches import bucket_length, epoch_order


@dataclass(frozen=True)
class PackedShape:
    sequences: int  # S: sequences per micro-batch
    length: int  # L: tokens per sequence


def packed_shape(
    lengths: Sequence[int], batch_size: int, max_length: int, seed: int = 0, multiple: int = 1
) -> PackedShape:
    """One fixed shape for every micro-batch, so the train step compiles once.

    L is the bucket of the longest row, so every row fits a sequence whole (never split: a split
    row would lose the context its second half was written against). S is the fewest sequences
    whose packed micro-batches hold at least `batch_size` rows on average over the first epoch: sized from the
    mean length alone, gaps the first fit cannot fill would leave a micro-batch a quarter short.
    `multiple`: L rounded up to a multiple of it (an attention kernel's tile: splash takes 128s)."""
    if not lengths:
        raise ValueError("cannot size packed batches for zero rows")
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    length = bucket_length(max(lengths), max_length, multiple)
    wanted = math.ceil(batch_size * float(np.mean(lengths)) / length)
    sequences = max(wanted, 1)
    while sequences < batch_size:
        shape = PackedShape(sequences, length)
        if len(lengths) / micro_batches_per_epoch(lengths, shape, seed) >= batch_size:
            break
        sequences += 1
    return PackedShape(sequences=sequences, length=length)


def _first_fit(free: list[int], n: int) -> int | None:
    """Index of the first bin with room for `n` tokens, or None."""
    return next((b for b, room in enumerate(free) if room >= n), None)


def _pack_epoch(
    lengths: Sequence[int], shape: PackedShape, order: np.ndarray, lookahead: int
) -> Iterator[list[list[int]]]:
    """Greedy first-fit over one epoch's order, emitting S bins at a time.

    The head of the order is tried first; when it fits no bin, the next `lookahead` rows are
    searched for one that does (short rows fill the gaps long rows leave). A bounded window keeps
    the epoch order nearly intact (rows stay close to their shuffled turn) and the cost linear."""
    rows = iter(int(r) for r in order)
    window: list[int] = []  # the head and the rows looked ahead at, in epoch order
    bins: list[list[int]] = [[] for _ in range(shape.sequences)]
    free = [shape.length] * shape.sequences
    while True:
        window.extend(islice(rows, lookahead + 1 - len(window)))  # top up to head + lookahead
        if not window:
            break
        room = max(free)
        pick = next((i for i, r in enumerate(window) if lengths[r] <= room), None)
        if pick is None:  # nothing in reach fits: this micro-batch is as full as it gets
            yield bins
            bins, free = [[] for _ in range(shape.sequences)], [shape.length] * shape.sequences
            continue
        row = window.pop(pick)
        b = _first_fit(free, lengths[row])
        bins[b].append(row)
        free[b] -= lengths[row]
    if any(bins):  # the epoch's last, partly empty micro-batch: never drop rows
        yield bins


def _check_fits(lengths: Sequence[int], shape: PackedShape) -> None:
    longest = max(lengths, default=0)
    assert longest <= shape.length, (
        f"a row of {longest} tokens cannot fit a packed sequence of {shape.length}; "
        "size the shape with packed_shape() over these same lengths"
    )


def packed_micro_batches(
    lengths: Sequence[int], shape: PackedShape, seed: int, lookahead: int = 64
) -> Iterator[list[list[int]]]:
    """Endless micro-batches of S bins (row indices in placement order), reshuffled every epoch
    with batches.epoch_order. Every row appears exactly once per epoch; deterministic given
    (lengths, shape, seed, lookahead), so a resumed run regenerates and skips."""
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("cannot pack zero rows")
    _check_fits(lengths, shape)
    epoch = 0
    while True:
        yield from _pack_epoch(lengths, shape, epoch_order(len(lengths), seed, epoch), lookahead)
        epoch += 1


def micro_batches_per_epoch(
    lengths: Sequence[int], shape: PackedShape, seed: int, lookahead: int = 64, epoch: int = 0
) -> int:
    """How many micro-batches `epoch` (the first, by default) packs into. Later epochs shuffle
    differently and may pack into a batch or so more or fewer; use this to size schedules."""
    lengths = [int(n) for n in lengths]
    _check_fits(lengths, shape)
    return sum(1 for _ in _pack_epoch(lengths, shape, epoch_order(len(lengths), seed, epoch), lookahead))


def pack(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    bins: list[list[int]],
    pad_id: int,
    shape: PackedShape,
) -> dict[str, np.ndarray]:
    """The (S, L) arrays for one micro-batch: rows laid end to end in each bin's order.

    Each row's first label is IGNORE_INDEX: the loss scores label[i+1] from position i, and at a
    boundary position i is the previous row's last token, which must not predict this row's
    start. Padding gets segment 0, IGNORE_INDEX labels and positions counting from 0 again."""
    S, L = shape.sequences, shape.length
    if len(bins) > S:
        raise ValueError(f"{len(bins)} bins for a micro-batch of {S} sequences")
    ids = np.full((S, L), pad_id, np.int32)
    lab = np.full((S, L), IGNORE_INDEX, np.int32)
    seg = np.zeros((S, L), np.int32)
    pos = np.zeros((S, L), np.int32)
    for s, rows in enumerate(bins):
        start = 0
        for k, r in enumerate(rows, start=1):
            n = len(input_ids[r])
            if len(labels[r]) != n:
                raise ValueError(f"row {r}: {n} input ids but {len(labels[r])} labels")
            if start + n > L:
                raise ValueError(f"bin {s} holds more than {L} tokens")
            end = start + n
            ids[s, start:end], lab[s, start:end] = input_ids[r], labels[r]
            lab[s, start] = IGNORE_INDEX
            seg[s, start:end], pos[s, start:end] = k, np.arange(n)
            start = end
        pos[s, start:] = np.arange(L - start)
    return {
        "input_ids": ids,
        "labels": lab,
        "segment_ids": seg,
        "position_ids": pos,
        "attention_mask": (seg > 0).astype(np.int32),
    }


def nonpad_fraction(batch: dict[str, np.ndarray]) -> float:
    """Share of the S*L token slots that hold a real token: the compute not wasted on padding."""
    mask = batch["attention_mask"]
    return float(np.count_nonzero(mask)) / mask.size


def unpacked_segments(attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Segment and position ids for an ordinary right-padded batch (batches.pad_batch), so one
    model path serves packed and padded batches: each row is segment 1, padding segment 0."""
    mask = np.asarray(attention_mask)
    positions = np.broadcast_to(np.arange(mask.shape[-1], dtype=np.int32), mask.shape)
    return {"segment_ids": (mask > 0).astype(np.int32), "position_ids": positions.copy()}
