"""Sequence packing: every row once per epoch, exact segment/position/label layout, one fixed shape,
and far less padding than bucketed batches on instruction-like lengths."""

from itertools import islice

import numpy as np
import pytest

from jaxtune.data.tokenize import IGNORE_INDEX as X
from jaxtune.runtime.compiled.batches import bucket_length, epoch_order, pad_batch, train_batches
from jaxtune.runtime.train.packing import (
    PackedShape,
    micro_batches_per_epoch,
    nonpad_fraction,
    pack,
    packed_micro_batches,
    packed_shape,
    unpacked_segments,
)

pytestmark = pytest.mark.training


def instruction_lengths(n=2000, max_length=512, seed=0):
    """Log-normal lengths like instruction data: median ~120 tokens, a long tail cut at max_length."""
    raw = np.random.default_rng(seed).lognormal(mean=np.log(120), sigma=0.8, size=n)
    return np.clip(np.round(raw), 8, max_length).astype(int).tolist()


def epochs(lengths, shape, seed, count):
    """The first `count` epochs of packed micro-batches, split at epoch boundaries."""
    stream = packed_micro_batches(lengths, shape, seed)
    return [list(islice(stream, micro_batches_per_epoch(lengths, shape, seed, epoch=e))) for e in range(count)]


def flat(batches):
    return [r for bins in batches for b in bins for r in b]


def flat_batches(epoch_list):
    return [bins for e in epoch_list for bins in e]


def test_every_row_exactly_once_per_epoch_in_a_new_order_each_epoch():
    lengths = instruction_lengths(n=300)
    shape = packed_shape(lengths, batch_size=8, max_length=512)
    rows = [flat(e) for e in epochs(lengths, shape, seed=3, count=3)]
    for epoch_rows in rows:
        assert sorted(epoch_rows) == list(range(300))
    assert rows[0] != rows[1] != rows[2] != rows[0]


def test_the_plan_is_deterministic_in_the_seed():
    lengths = instruction_lengths(n=300)
    shape = packed_shape(lengths, batch_size=8, max_length=512)
    first = list(islice(packed_micro_batches(lengths, shape, seed=1), 60))
    assert first == list(islice(packed_micro_batches(lengths, shape, seed=1), 60))
    assert first != list(islice(packed_micro_batches(lengths, shape, seed=2), 60))


def test_rows_keep_close_to_their_shuffled_turn():
    # Lookahead bends the epoch order only locally: a row is never placed far before its turn.
    lengths = instruction_lengths(n=500)
    shape = packed_shape(lengths, batch_size=8, max_length=512)
    turn = {int(r): i for i, r in enumerate(epoch_order(500, 0, 0))}
    placed = 0
    for bins in epochs(lengths, shape, seed=0, count=1)[0]:
        rows = [r for b in bins for r in b]
        placed += len(rows)
        # each placement picks from the first 64 + 1 unplaced rows of the epoch order
        assert max(turn[r] for r in rows) < placed + 64


def test_layout_of_a_hand_made_micro_batch():
    ids = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    labels = [[20, 21, 22], [23, 24], [25, 26, 27, 28]]
    batch = pack(ids, labels, [[0, 1], [2], []], pad_id=0, shape=PackedShape(sequences=3, length=6))
    expected = {
        "input_ids": [[10, 11, 12, 13, 14, 0], [15, 16, 17, 18, 0, 0], [0] * 6],
        # first token of every row and all padding unscored, even though their labels were real
        "labels": [[X, 21, 22, X, 24, X], [X, 26, 27, 28, X, X], [X] * 6],
        "segment_ids": [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0], [0] * 6],
        "position_ids": [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]],
        "attention_mask": [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0] * 6],
    }
    assert set(batch) == set(expected)
    for key, want in expected.items():
        assert batch[key].dtype == np.int32, key
        np.testing.assert_array_equal(batch[key], np.array(want), err_msg=key)
    assert nonpad_fraction(batch) == 9 / 18


def test_pack_rejects_overfull_bins_and_mismatched_labels():
    shape = PackedShape(sequences=1, length=4)
    with pytest.raises(ValueError, match="more than 4 tokens"):
        pack([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], [[0, 1]], 0, shape)
    with pytest.raises(ValueError, match="labels"):
        pack([[1, 2]], [[1]], [[0]], 0, shape)
    with pytest.raises(ValueError, match="bins"):
        pack([[1]], [[1]], [[0], [0]], 0, shape)


def test_packed_shape_holds_a_batch_of_rows_with_the_fewest_sequences():
    lengths = instruction_lengths(n=500)
    shape = packed_shape(lengths, 8, 512)
    assert shape.length == bucket_length(max(lengths), 512)

    def rows_per_micro_batch(sequences):
        return len(lengths) / micro_batches_per_epoch(lengths, PackedShape(sequences, shape.length), seed=0)

    assert rows_per_micro_batch(shape.sequences) >= 8 > rows_per_micro_batch(shape.sequences - 1)
    lengths = [100] * 10 + [300]  # longest 300 -> bucket 384
    assert packed_shape(lengths, 8, 320).length == 320  # the cap trims the bucket
    assert packed_shape([10], 1, 512) == PackedShape(sequences=1, length=16)
    assert packed_shape([600, 10], 2, 512).length == 600  # never shorter than the longest row


def test_a_row_longer_than_a_sequence_is_refused():
    with pytest.raises(AssertionError, match="17 tokens cannot fit a packed sequence of 16"):
        next(packed_micro_batches([5, 17], PackedShape(sequences=2, length=16), seed=0))


def test_no_bin_exceeds_the_length_and_every_batch_has_the_fixed_shape():
    lengths = instruction_lengths(n=500)
    shape = packed_shape(lengths, batch_size=8, max_length=512)
    for bins in flat_batches(epochs(lengths, shape, seed=0, count=2)):
        assert len(bins) == shape.sequences
        assert all(sum(lengths[r] for r in b) <= shape.length for b in bins)


def test_packing_fills_97_8_percent_of_slots_on_instruction_lengths(capsys):
    lengths = instruction_lengths()
    shape = packed_shape(lengths, batch_size=8, max_length=512)
    ids = [list(range(1, n + 1)) for n in lengths]
    batches = [pack(ids, ids, bins, 0, shape) for bins in epochs(lengths, shape, seed=0, count=1)[0]]
    packed = float(np.mean([nonpad_fraction(b) for b in batches]))
    assert sum(int(b["attention_mask"].sum()) for b in batches) == sum(lengths)  # nothing dropped
    # No scored target crosses a row boundary: position i and its target i+1 share a segment.
    for b in batches:
        scored = b["labels"][:, 1:] != X
        assert np.all(b["segment_ids"][:, :-1][scored] == b["segment_ids"][:, 1:][scored])
    plain_tokens = plain_slots = 0
    for rows in islice(train_batches(len(lengths), 8, seed=0), len(lengths) // 8):
        longest = max(lengths[r] for r in rows)
        plain_tokens += sum(lengths[r] for r in rows)
        plain_slots += 8 * bucket_length(longest, 512)
    plain = plain_tokens / plain_slots
    with capsys.disabled():
        print(
            f"\nnonpad fraction: packed {packed:.3f} ({shape.sequences}x{shape.length}, {len(batches)} micro-batches, "
            f"{len(lengths) / len(batches):.1f} rows each) vs padded {plain:.3f}"
        )
    # The plan is deterministic (seeded lengths, seeded shuffle), so its figure is asserted as it is:
    # 309,361 tokens in 206 micro-batches of 3 x 512 slots, 0.9777 (docs/performance.md's 0.978). The fewest
    # that could hold them is 202 (0.997); a plan looking 16 rows ahead instead of 64 takes 208
    # (0.968), none ahead 232 (0.868), and both passed the bound of 0.9 this replaces.
    assert (shape, len(batches)) == (PackedShape(sequences=3, length=512), 206)
    assert round(packed, 4) == 0.9777
    assert packed > plain


def test_unpacked_segments_of_a_right_padded_batch():
    batch = pad_batch([[5, 6, 7], [8]], [[5, 6, 7], [8]], pad_id=0, length=4, rows=3)
    out = unpacked_segments(batch["attention_mask"])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 3]] * 3)
    assert out["segment_ids"].dtype == out["position_ids"].dtype == np.int32


def test_a_mesh_pads_packed_micro_batches_with_empty_sequences_but_never_changes_their_rows():
    """Every mesh trains on the same rows in the same bins: the plan is made as for one device,
    and the batch gets empty sequences (no label scored) until it splits over data x fsdp."""
    from jaxtune.config import TrainConfig
    from jaxtune.runtime.train.feed import make_feed

    lengths = instruction_lengths(n=300)
    ids = [list(range(3, n + 3)) for n in lengths]
    cfg = TrainConfig(batch_size=8)
    one, eight = make_feed(lengths, cfg, 512, 1, packed=True), make_feed(lengths, cfg, 512, 8, packed=True)
    assert eight.rows % 8 == 0 and eight.rows - one.rows in range(8) and one.rows % 8 != 0
    assert eight.micro_batches_per_epoch == one.micro_batches_per_epoch
    a, b = one.micro_batches(ids, ids, 0), eight.micro_batches(ids, ids, 0)
    for _ in range(5):
        small, big = next(a), next(b)
        for name in small:
            np.testing.assert_array_equal(big[name][: one.rows], small[name])
        assert not big["attention_mask"][one.rows :].any() and (big["labels"][one.rows :] == X).all()


def test_on_a_tpu_every_micro_batch_is_a_multiple_of_splash_tiles_and_holds_the_same_rows():
    """Splash attention takes lengths in 128-token tiles; a feed for it packs into such lengths
    (more rows per sequence, fewer sequences) and pads its padded batches to them."""
    from jaxtune.config import TrainConfig
    from jaxtune.runtime.modeling import attention
    from jaxtune.runtime.train.feed import make_feed
    from tests.conftest import tiny_model

    module = tiny_model("llama")
    with attention.choose("splash"):
        assert attention.length_multiple(module, None) == 128
    assert attention.length_multiple(module, None) == 1  # XLA's attention on the CPU takes any length
    lengths = [int(n) for n in np.random.default_rng(0).integers(8, 54, 200)]  # the demo's rows: at most 53 tokens
    ids = [list(range(3, n + 3)) for n in lengths]
    cfg = TrainConfig(batch_size=16)
    plain, tiled = (
        make_feed(lengths, cfg, 64, 1, packed=True),
        make_feed(lengths, cfg, 64, 1, packed=True, multiple=128),
    )
    assert (plain.length, tiled.length) == (64, 128) and tiled.rows < plain.rows
    batch = next(tiled.micro_batches(ids, ids, 0))
    assert batch["input_ids"].shape == (tiled.rows, 128)
    segments = sum(len(set(row[row > 0].tolist())) for row in batch["segment_ids"])
    assert (
        segments >= 12 and batch["attention_mask"].sum() == (batch["segment_ids"] > 0).sum()
    )  # ~16 rows, packed whole
    padded = make_feed(lengths, cfg, 64, 1, packed=False, multiple=128)
    for _, batch in zip(range(3), padded.micro_batches(ids, ids, 0)):
        assert batch["input_ids"].shape == (16, 128)
        assert all(int(m.sum()) in lengths for m in batch["attention_mask"])  # each row whole, the rest padding
