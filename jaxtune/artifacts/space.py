"""Free space in the store, checked before a stage writes something large, so a full disk stops
it at the start with the figures, not hours later in the middle of a checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from jaxtune.errors import NotEnoughSpace

MARGIN = 1.1  # room for logs, manifests, and the filesystem's own rounding


def require_free(folder: str | Path, needed: int, what: str) -> None:
    """Raise NotEnoughSpace when the filesystem holding `folder` has under `needed` (times a margin) bytes free."""
    folder = Path(folder)
    while not folder.exists():  # the stage's own folders may not exist yet; their filesystem does
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed * MARGIN:
        raise NotEnoughSpace(
            f"needs about {_size(needed * MARGIN)} free in {folder} for {what}, "
            f"but only {_size(free)} is free; free some space or move store.root"
        )


def _size(n: float) -> str:
    if n < 1e6:
        return f"{n / 1e3:.1f} KB"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
