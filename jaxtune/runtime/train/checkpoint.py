"""Training checkpoints: weights, optimizer state, step, data position and RNG, written atomically.

A checkpoint is a folder `step-00000120/` holding `weights.safetensors`, `optimizer.safetensors`
(every leaf in its own dtype, named by its pytree path) and `state.json`. It is written under a
temporary name and renamed into place, so a run killed at any instant leaves either the whole
checkpoint or none of it. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxtune.runtime.modeling.stacked import Layout

PREFIX = "step-"
KEEP = 2  # the newest checkpoints kept; older ones are removed once a newer one is complete


@dataclass
class Checkpoint:
    path: Path
    step: int
    weights: dict[str, np.ndarray]
    opt_state: Any  # the optimizer's pytree, leaves as numpy arrays
    state: dict  # step, micro_batches (data position), rng, log records so far


def tree_to_arrays(tree: Any) -> dict[str, np.ndarray]:
    """Pytree -> {path string: numpy array}, dtypes kept (optax counts stay int32)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in leaves}


def arrays_to_tree(arrays: dict[str, np.ndarray], template: Any) -> Any:
    """Inverse of `tree_to_arrays`, checked against `template` (e.g. `optimizer.init(weights)`)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    missing = sorted(set(names) - set(arrays))
    if missing or len(names) != len(arrays):
        raise ValueError(
            f"checkpoint optimizer state does not match the optimizer: missing {missing[:3]}, "
            f"{len(arrays)} saved vs {len(names)} expected"
        )
    out = []
    for name, (_, leaf) in zip(names, leaves):
        value = arrays[name]
        if value.shape != np.shape(leaf):
            raise ValueError(f"checkpoint optimizer state {name}: shape {value.shape}, expected {np.shape(leaf)}")
        out.append(value.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def save(folder: Path, step: int, weights: dict, opt_state: Any, state: dict, layout: Layout | None = None) -> Path:
    """Write checkpoint `step` into `folder` atomically and drop all but the newest `KEEP`. With the `layout`
    the weights and optimizer state are held in, both are written in per-layer names, as an unstacked run's."""
    arrays = tree_to_arrays(opt_state)
    if layout is not None:
        weights, arrays = layout.flat(weights), layout.flat_paths(arrays)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{PREFIX}{step:08d}"
    temp = folder / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    save_file(
        {k: np.asarray(jax.device_get(v), order="C") for k, v in weights.items()}, str(temp / "weights.safetensors")
    )
    # asarray, not ascontiguousarray: the latter turns 0-d leaves (counts, norms) into shape (1,)
    save_file({k: np.asarray(v, order="C") for k, v in arrays.items()}, str(temp / "optimizer.safetensors"))
    with open(temp / "state.json", "w") as handle:
        json.dump({**state, "step": step}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of this step from a run that died after writing it
    os.replace(temp, final)
    for old in complete(folder)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


PROGRESS = "progress.json"  # the step the newest attempt last logged, beside the checkpoints
INTERRUPTIONS = "interruptions.json"  # every interruption of this training so far, beside the checkpoints


def note_progress(folder: Path, step: int, stopped_by: str | None = None) -> None:
    """Record that training logged `step` (and, on a stop signal, that it stopped there), so a
    resumed run can count what an interruption lost."""
    _write_json(folder / PROGRESS, {"step": step, "stopped_by": stopped_by})


def read_progress(folder: Path) -> dict | None:
    """What `note_progress` last wrote in `folder`, or None."""
    return _read_json(folder / PROGRESS)


def note_interruptions(folder: Path, interruptions: list[dict]) -> None:
    """Record the interruptions so far. Kept beside the checkpoints, not in them: runs killed
    before they save a newer checkpoint still add up, which is how a restart sees it is stuck."""
    _write_json(folder / INTERRUPTIONS, interruptions)


def read_interruptions(folder: Path) -> list[dict]:
    return _read_json(folder / INTERRUPTIONS) or []


def _write_json(path: Path, value: Any) -> None:
    """Written whole, then renamed into place: a kill mid-write leaves the old file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(json.dumps(value))
    os.replace(temp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def complete(folder: Path) -> list[Path]:
    """Finished checkpoints in `folder`, oldest first (temporary folders of killed runs are ignored)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").is_file())


def newest_step(folder: Path) -> int:
    """The step of the newest complete checkpoint in `folder` (the one `latest` loads), or 0."""
    found = complete(folder)
    return int(json.loads((found[-1] / "state.json").read_text())["step"]) if found else 0


def latest(folder: Path, opt_template: Any, layout: Layout | None = None) -> Checkpoint | None:
    """The newest complete checkpoint, its optimizer state rebuilt on `opt_template`'s structure; with a
    `layout`, its weights and optimizer state stacked as that layout holds them."""
    found = complete(folder)
    if not found:
        return None
    path = found[-1]
    state = json.loads((path / "state.json").read_text())
    weights = load_file(str(path / "weights.safetensors"))
    arrays = load_file(str(path / "optimizer.safetensors"))
    if layout is not None:
        weights = layout.stacked(weights)
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(opt_template)[0]]
        arrays = layout.stacked_paths(arrays, paths)
    opt_state = arrays_to_tree(arrays, opt_template)
    return Checkpoint(path=path, step=int(state["step"]), weights=weights, opt_state=opt_state, state=state)
