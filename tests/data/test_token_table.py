"""`TokenTable`: the rows a token table holds, read lazily by index across record batches, and
in bounded memory (measured with tracemalloc and Arrow's allocator, each with a positive control)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from jaxtune.data.token_table import ListColumn, TokenTable
from jaxtune.data.tokenize import ARROW_SCHEMA, read_arrow, write_arrow

pytestmark = pytest.mark.data


def token_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` token rows of varied lengths (one empty), prompt tokens labelled -100."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = 0 if i == 5 else int(rng.integers(1, 12))
        ids = rng.integers(0, 5000, length).tolist()
        prompt = min(length, int(rng.integers(0, 4)))
        rows.append(
            {
                "input_ids": ids,
                "labels": [-100] * prompt + ids[prompt:],
                "length": length,
                "prompt_length": prompt,
                "category": f"c{i % 3}",
                "prompt_text": f"prompt {i}",
                "response": f"response {i}",
                "source": "s",
            }
        )
    return rows


ROWS = 23


@pytest.fixture
def rows() -> list[dict]:
    return token_rows(ROWS)


@pytest.fixture
def chunked(rows, tmp_path) -> Path:
    """The rows written as tables of 4 rows each: several record batches in the file."""
    path = tmp_path / "train.arrow"
    write_arrow((pa.Table.from_pylist(rows[i : i + 4], schema=ARROW_SCHEMA) for i in range(0, len(rows), 4)), path)
    return path


def test_the_file_has_several_record_batches(chunked):
    assert read_arrow(chunked).column("input_ids").num_chunks == -(-ROWS // 4)


def test_every_row_reads_back_exactly(rows, chunked):
    table = TokenTable(chunked)
    assert len(table) == len(table.input_ids) == len(table.labels) == ROWS
    for i, row in enumerate(rows):
        assert table.input_ids[i].tolist() == row["input_ids"], i
        assert table.labels[i].tolist() == row["labels"], i
        assert table.input_ids[i].dtype == np.int32
    assert table.lengths.tolist() == [row["length"] for row in rows]
    assert table.longest == max(row["length"] for row in rows)
    assert table.input_ids[5].tolist() == [] and table.lengths[5] == 0  # an empty row


def test_slices_and_negative_indices(rows, chunked):
    table = TokenTable(chunked)
    ids = [row["input_ids"] for row in rows]
    for index in (slice(2, 11), slice(None, None, 3), slice(-6, None), slice(15, 3, -2), slice(30, 40), slice(None)):
        assert [r.tolist() for r in table.input_ids[index]] == ids[index], index
        assert [r.tolist() for r in table.labels[index]] == [row["labels"] for row in rows][index], index
    for i in range(1, ROWS + 1):
        assert table.input_ids[-i].tolist() == ids[-i]
    assert table.input_ids[np.int64(7)].tolist() == ids[7]  # numpy integers index too


@pytest.mark.parametrize("index", [ROWS, ROWS + 10, -ROWS - 1])
def test_an_index_past_the_end_raises_index_error(chunked, index):
    table = TokenTable(chunked)
    with pytest.raises(IndexError):
        table.input_ids[index]
    with pytest.raises(IndexError):
        table.labels[index]


def test_iteration_stops_at_the_end(rows, chunked):
    assert [r.tolist() for r in TokenTable(chunked).input_ids] == [row["input_ids"] for row in rows]


def test_other_columns_on_request(rows, chunked):
    table = TokenTable(chunked)
    assert table.column("category") == [row["category"] for row in rows]
    assert table.column("response", rows=6) == [row["response"] for row in rows[:6]]


def test_a_list_column_over_sliced_chunks(rows):
    column = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA).column("input_ids").slice(3, 12)  # chunks with an offset
    lazy = ListColumn(column)
    assert [r.tolist() for r in lazy] == [row["input_ids"] for row in rows[3:15]]
    assert lazy.lengths.tolist() == [row["length"] for row in rows[3:15]]


def test_an_empty_table(tmp_path):
    path = tmp_path / "eval.arrow"
    write_arrow([], path)
    table = TokenTable(path)
    assert len(table) == 0 and table.longest == 0 and table.lengths.tolist() == []
    with pytest.raises(IndexError):
        table.input_ids[0]


# --- bounded memory -------------------------------------------------------------------------

BIG_ROWS = 100_000


@pytest.fixture(scope="module")
def big_table(tmp_path_factory) -> Path:
    """A token table of 100k rows (4 to 27 tokens each), built column by column with pyarrow."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 28, BIG_ROWS).astype(np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = rng.integers(300, 30_000, int(lengths.sum())).astype(np.int32)  # above CPython's small-int cache
    labels = ids.copy()
    labels[::3] = -100
    empty = pa.array(np.full(BIG_ROWS, "", dtype=object), pa.string())
    table = pa.Table.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, pa.array(ids)),
            pa.ListArray.from_arrays(offsets, pa.array(labels)),
            pa.array(lengths),
            pa.array(np.zeros(BIG_ROWS, np.int32)),
            empty,
            empty,
            empty,
            empty,
        ],
        schema=ARROW_SCHEMA,
    )
    path = tmp_path_factory.mktemp("big") / "train.arrow"
    write_arrow(iter([table]), path)
    return path


def traced_peak(fn) -> int:
    """Peak bytes Python (and numpy) allocated while `fn` ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def arrow_allocated(fn) -> int:
    """Bytes Arrow's memory pool grew by while `fn` ran and its result was alive."""
    before = pa.total_allocated_bytes()
    result = fn()
    grown = pa.total_allocated_bytes() - before
    del result
    return grown


def read_a_batch(path: Path):
    table = TokenTable(path)
    picks = np.random.default_rng(1).choice(len(table), 64, replace=False)
    batch = [(table.input_ids[i], table.labels[i]) for i in picks]
    assert int(table.lengths.sum()) > 0 and all(len(ids) == len(lab) for ids, lab in batch)
    return table, table.lengths, batch


MB = 1 << 20


def test_reading_lengths_and_a_batch_holds_little_memory(big_table):
    assert big_table.stat().st_size > 10 * MB
    assert len(TokenTable(big_table)) == BIG_ROWS
    lazy = traced_peak(lambda: read_a_batch(big_table))
    eager = traced_peak(lambda: read_arrow(big_table).to_pydict())
    # lengths are 400 kB per list column (int32 per row); the rows themselves are views into the mapped file
    assert lazy < 4 * MB, f"TokenTable + lengths + 64 rows allocated {lazy / MB:.1f} MB"
    # positive control: the same measure sees the whole table as Python objects
    assert eager > 50 * MB and eager > 20 * lazy, f"to_pydict allocated only {eager / MB:.1f} MB"


def test_the_table_is_memory_mapped_not_read_into_arrow_memory(big_table):
    mapped = arrow_allocated(lambda: read_a_batch(big_table))
    assert mapped < MB, f"TokenTable allocated {mapped / MB:.1f} MB of Arrow memory"
    # positive control: the same file read (not mapped) lands in Arrow's pool
    read = arrow_allocated(lambda: pa.ipc.open_file(pa.OSFile(str(big_table))).read_all())
    assert read > 10 * MB, f"a plain read allocated only {read / MB:.1f} MB of Arrow memory"
