"""Reading GGUF files in seconds rather than minutes, with the `gguf` package's own reader.

transformers reads a GGUF file (given the `gguf` package) by parsing its header three times (for
the tokenizer, the config and the weights), each time turning every vocabulary string into
Python objects, and rebuilds gguf's tensor-name table once per module of the model; both are
pure functions of the file, so `parsed_once()` computes each once (SmolLM2-135M's import: 73 s
to 25 s here, the folder byte for byte the same; reading back a fine-tuned SmolLM2's f16 and
q8_0 exports: 43 s to 19 s).

`plain_reader(path)` is gguf's reader over a plain array view of its memory map (see
`_plain_view_reader`): the same bytes, without numpy making a memmap object of every slice
(Gemma 3 270M's import: 34 s to 20 s).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

_PATCH_LOCK = threading.Lock()  # the patch below is process-wide: one block at a time holds it


def plain_reader(path: str | Path):
    """`gguf.GGUFReader(path)`, read through a plain ndarray view of its memory map."""
    import gguf

    return _plain_view_reader(gguf.GGUFReader)(path)


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
