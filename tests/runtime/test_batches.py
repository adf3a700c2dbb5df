"""Padded lengths: few distinct shapes (each one compiles), little padding."""

from jaxtune.runtime.compiled.batches import bucket_length


def test_lengths_grow_geometrically_from_16():
    assert [bucket_length(n) for n in (1, 16, 17, 33, 49, 65, 97, 129, 200, 257, 385)] == [
        16,
        16,
        32,
        48,
        64,
        96,
        128,
        192,
        256,
        384,
        512,
    ]


def test_at_most_ten_shapes_up_to_512_and_at_most_half_again_of_padding():
    shapes = {bucket_length(n) for n in range(1, 513)}
    assert len(shapes) == 10
    assert all(bucket_length(n) <= max(1.5 * n, 16 * -(-n // 16)) for n in range(1, 513))


def test_cap_limits_the_padding_but_never_cuts_a_row():
    assert bucket_length(100, cap=110) == 110
    assert bucket_length(120, cap=100) == 120


def test_a_kernels_tile_rounds_the_bucket_up_past_the_cap():
    assert [bucket_length(n, multiple=128) for n in (9, 53, 130, 200)] == [128, 128, 256, 256]
    assert bucket_length(53, 64) == 64 and bucket_length(53, 64, 128) == 128  # a tile the kernel takes, past the cap
    assert bucket_length(40, multiple=16) == bucket_length(40) == 48  # a multiple of 16 already
