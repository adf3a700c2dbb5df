"""The store under faults: a damaged artifact file is noticed and its stage recomputed; a write
that fails midway (disk full) and a disk too small for training leave no folder that looks complete."""

from __future__ import annotations

import errno
import json
from collections import namedtuple
from pathlib import Path

import pytest

from jaxtune.artifacts.keys import file_digest

pytestmark = pytest.mark.badinput

HINT = " (--debug shows the traceback)"


def stage_states(stdout: str) -> dict[str, str]:
    return dict(line.split() for line in stdout.splitlines()[:-1])


def test_an_artifact_file_damaged_on_disk_is_noticed_and_its_stage_recomputed(jaxtune_after_eval):
    [arrow] = jaxtune_after_eval.store.glob("tokenize/*/train.arrow")
    manifest = json.loads((arrow.parent / "manifest.json").read_text())
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    arrow.write_bytes(bytes(data))
    done = jaxtune_after_eval.run("--until=tokenize")
    assert done.status == 0, done.stderr
    assert stage_states(done.stdout) == {"build_tokenizer": "Cached", "build_model": "Cached", "tokenize": "Completed"}
    assert file_digest(arrow) == manifest["files"]["train.arrow"]["sha256"], "rebuilt, not reused"


def test_a_write_that_fails_midway_leaves_no_folder_that_looks_complete(jaxtune_after_eval, monkeypatch):
    from jaxtune.data import tokenize

    def disk_full(rows, path):
        Path(path).write_bytes(b"ARROW1" + b"\0" * 100)  # the first part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tokenize, "write_arrow", disk_full)
    before = jaxtune_after_eval.folders()
    done = jaxtune_after_eval.run("--set=data.max_eval_rows=20", "--until=tokenize")
    assert done.status == 1
    assert done.last_line.startswith("jaxtune: tokenize: [Errno 28] No space left on device")
    assert jaxtune_after_eval.folders() == before, "no new folder, no temp folder left"


def test_training_checks_the_disk_has_room_for_checkpoints_and_artifact_before_its_first_step(
    jaxtune_after_eval, monkeypatch
):
    from jaxtune.artifacts import space

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    before = jaxtune_after_eval.folders()
    done = jaxtune_after_eval.run("--set=train.checkpoint_every=2", "--until=train")
    assert done.status == 1
    assert done.last_line.startswith("jaxtune: train: needs about ")
    assert " for its artifact and 2 checkpoints (" in done.last_line
    assert done.last_line.endswith(f"but only 4.1 KB is free; free some space or move store.root{HINT}")
    assert jaxtune_after_eval.folders() == before
    assert "step 1 " not in done.stderr, "no training step ran"
