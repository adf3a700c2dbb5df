"""Token tables read lazily: train, evaluate and generate take rows by index from the Arrow file,
so a stage holds the rows of the batch it is building, never the whole table as Python lists.

The file is memory-mapped for its structure (offsets, lengths, the short columns); what is held
per row is its length and offset, about 12 MB for a million rows whatever their text. The token
ids themselves are read with `pread` at each row's place in the file. Mapped, they would count
in the process's memory as they are touched, and more than is read: the kernel maps a whole
large page-cache folio around each row read, 869 MB of a 1M-row table for 800 random rows here.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from jaxtune.data.tokenize import check_token_table


class _File:
    """An Arrow file, mapped, and open for `pread` of the int32 values its arrays point into."""

    def __init__(self, path: Path):
        self.descriptor = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.descriptor)
        self.buffer = pa.py_buffer(mmap.mmap(self.descriptor, 0, access=mmap.ACCESS_READ))

    def position(self, values: pa.Array) -> int:
        """Where in the file the (int32) `values` start."""
        return values.buffers()[1].address - self.buffer.address + 4 * values.offset

    def read(self, position: int, count: int) -> np.ndarray:
        return np.frombuffer(os.pread(self.descriptor, 4 * count, position), np.int32)


class ListColumn(Sequence):
    """The rows of a list<int32> column as numpy arrays: views into the column's buffers, or, for
    a column of a `_File`, read from the file row by row."""

    def __init__(self, column: pa.ChunkedArray, file: _File | None = None):
        self._file = file
        # offsets index the chunk's whole child array, so they hold for sliced chunks too
        self._chunks = [
            (chunk.offsets.to_numpy(), chunk.values.to_numpy() if file is None else file.position(chunk.values))
            for chunk in column.chunks
        ]
        self._starts = np.cumsum([0, *(len(chunk) for chunk in column.chunks)])
        self.lengths = (
            np.concatenate([np.diff(offsets) for offsets, _ in self._chunks]) if self._chunks else np.zeros(0, np.int32)
        )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        chunk = int(np.searchsorted(self._starts, index, side="right")) - 1
        offsets, values = self._chunks[chunk]
        row = index - int(self._starts[chunk])
        begin, end = int(offsets[row]), int(offsets[row + 1])
        return values[begin:end] if self._file is None else self._file.read(values + 4 * begin, end - begin)


class TokenTable:
    """train.arrow or eval.arrow of a tokenize artifact: `input_ids` and `labels` as lazy row
    sequences, `lengths` as one numpy array; other columns on request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        file = _File(self.path)
        self.table = check_token_table(pa.ipc.open_file(file.buffer).read_all(), self.path)
        self.input_ids = ListColumn(self.table.column("input_ids"), file)
        self.labels = ListColumn(self.table.column("labels"), file)
        self.lengths = self.input_ids.lengths

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self) else 0

    def column(self, name: str, rows: int | None = None) -> list:
        """A column (its first `rows` rows) as a Python list: for the short text columns of a few rows."""
        column = self.table.column(name)
        return (column if rows is None else column.slice(0, rows)).to_pylist()
