"""JAX's persistent compilation cache: compiled XLA programs kept on disk between processes.

A rerun (or a later run with the same model and shapes) then loads the train, eval and decode
programs instead of compiling them again. The step's learning rate is an input, not a constant,
so a new rate or schedule hits the same entry.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

MIN_COMPILE_SECONDS = 0.5  # programs that compile faster than this are not worth a file


def enable(folder: str | Path) -> Path:
    """Use `folder` (created if missing) as the process's compilation cache from now on."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(folder):
        compilation_cache.set_cache_dir(str(folder))
        compilation_cache.reset_cache()  # a cache opened on another folder would otherwise stay in use
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


def folder_of(store_root: str | Path) -> Path:
    return Path(store_root) / "xla-cache"
