"""JAX's persistent compilation cache: compiled XLA programs kept on disk between processes.

A rerun (or a later run with the same model and shapes) then loads the train, eval and decode
programs instead of compiling them again. The step's learning rate is an input, not a constant,
so a new rate or schedule hits the same entry.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

MIN_COMPILE_SECONDS = 0.5  # programs that compile faster than this are not worth a file
# JAX's own setting of that threshold, which wins when it is set.
MIN_COMPILE_SECONDS_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# A folder holding one cache for every store on this machine, in place of each store's own.
SHARED_FOLDER_VARIABLE = "JAXTUNE_COMPILE_CACHE"


def enable(folder: str | Path) -> Path:
    """Use `folder` (created if missing) as the process's compilation cache from now on."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(folder):
        compilation_cache.set_cache_dir(str(folder))
        compilation_cache.reset_cache()  # a cache opened on another folder would otherwise stay in use
        if MIN_COMPILE_SECONDS_VARIABLE not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


def folder_of(store_root: str | Path) -> Path:
    """`$JAXTUNE_COMPILE_CACHE` when set (several stores, one cache), else `<store root>/xla-cache`."""
    shared = os.environ.get(SHARED_FOLDER_VARIABLE)
    return Path(shared) if shared else Path(store_root) / "xla-cache"
