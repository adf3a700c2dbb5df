"""Reading GGUF files in seconds rather than minutes, with the `gguf` package's own reader.

transformers reads a GGUF file (given the `gguf` package) by parsing its header three times (for
the tokenizer, the config and the weights), each time turning every vocabulary string into
Python objects, and rebuilds gguf's tensor-name table once per module of the model; both are
pure functions of the file, so `parsed_once()` computes each once (SmolLM2-135M's import: 73 s
to 25 s here, the folder byte for byte the same; reading back a fine-tuned SmolLM2's f16 and
q8_0 exports: 43 s to 19 s).

Both read through a plain array view of the file's memory map (see `_plain_view_reader`): the
same bytes, without numpy making a memmap object of every slice (Gemma 3 270M's import: 34 s to
20 s). `tensor_reader(path)`, which checks an export's tensors, also steps over the vocabulary's
arrays rather than parsing them item by item.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

_PATCH_LOCK = threading.Lock()  # the patch below is process-wide: one block at a time holds it


def tensor_reader(path: str | Path):
    """gguf's reader for a file's tensors alone: its array metadata (a vocabulary's tokens,
    scores and kinds) stepped over, not parsed item by item, so `fields` holds those arrays empty.
    Reading back and hashing a Gemma 3 270M q8_0 export's 236 tensors: 8.8-11.3 s with the plain view
    alone, 0.5-0.6 s with this one, the same digests (SmolLM2-135M's: 1.9-2.3 s and 0.3-0.4 s)."""
    import gguf

    return _array_skipping_reader(_plain_view_reader(gguf.GGUFReader))(path)


@contextlib.contextmanager
def parsed_once():
    """Within the block, `gguf.GGUFReader` returns one (plain-view) reader per file and
    `get_tensor_name_map` one table per (architecture, layers): transformers imports both from
    `gguf` at each call."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = (_plain_view_reader(real_reader) if mode == "r" else real_reader)(path, mode)
        return readers[key]

    with _PATCH_LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _plain_view_reader(base: type) -> type:
    """`base`, gguf's reader, over a plain ndarray view of its read-only memory map. Every slice of an
    `np.memmap` is a memmap again, made by two Python methods; reading Gemma 3's 262k-token
    vocabulary slices it millions of times (15 of the 33 s of its import). The view reads the
    same mapped bytes, and keeps the map alive as its base."""
    import numpy as np

    class PlainViewReader(base):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    return PlainViewReader


def _array_skipping_reader(base: type) -> type:
    """`base`, gguf's reader, finding where each array field ends from its item type and count (and
    each string's length) without making numpy objects of its items, as gguf does for every one."""
    import struct
    import sys

    import numpy as np
    from gguf import GGUFValueType

    class ArraySkippingReader(base):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type[0]))
            offs = orig_offs + 12
            if scalar is not None:
                offs += int(count[0]) * np.dtype(scalar).itemsize
            elif item_type[0] == GGUFValueType.STRING:
                length = struct.Struct(
                    ("=" if self.byte_order == "I" else "<" if sys.byteorder == "big" else ">") + "Q"
                )
                buffer = memoryview(self.data)
                for _ in range(int(count[0])):
                    offs += 8 + length.unpack_from(buffer, offs)[0]
            else:  # arrays of arrays: gguf's own way
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [item_type, count], [], [GGUFValueType.ARRAY]

    return ArraySkippingReader
