"""A writer killed mid-write leaves no artifact, only a temp folder that clean_temp, or the next
writer of its key, removes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtune.artifacts import ArtifactStore
from jaxtune.errors import ArtifactMissing

REPO_ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import sys, time
from jaxtune.artifacts import ArtifactStore

store = ArtifactStore(sys.argv[1])
with store.writing("train", sys.argv[2], inputs={"data": "d"}, config={"steps": 1}, code={"digest": "1"}) as folder:
    with open(folder / "weights.safetensors", "wb") as handle:
        handle.write(b"x" * 4096)
        handle.flush()
        print(folder, flush=True)
        time.sleep(60)
"""


def test_killed_writer_leaves_no_artifact(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    key = "feedfacefeedfaceface"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store.root), key], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        temp = Path(writer.stdout.readline().strip())
        assert temp.name.startswith(f".tmp-{key}-{writer.pid}-"), temp
        assert (temp / "weights.safetensors").stat().st_size == 4096
        assert store.clean_temp() == []  # the writer is still alive
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        writer.stdout.close()
    assert writer.returncode == -signal.SIGKILL
    assert not store.folder("train", key).exists()
    assert not store.verify("train", key)
    with pytest.raises(ArtifactMissing):
        store.ref("train", key)
    assert temp.is_dir()
    assert store.clean_temp() == [temp]
    assert not temp.exists()
    assert list((store.root / "train").iterdir()) == []


def test_the_next_writer_of_a_key_removes_its_dead_writers_temp_folders_and_spares_live_ones(tmp_path):
    """A run killed mid-train leaves its half-built artifact (up to its whole size) in the store;
    the next run writing that key, under the stage's lock, removes it."""
    store = ArtifactStore(tmp_path / "store")
    key, other = "feedfacefeedfaceface", "0123456789abcdef0123"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    stage = store.root / "train"
    leftovers = {
        name: stage / name
        for name in (
            f".tmp-{key}-{dead_pid}-0a0b0c0d",
            f".tmp-{key}-{os.getpid()}-1a1b1c1d",
            f".tmp-{other}-{dead_pid}-2a2b2c2d",
        )
    }
    for folder in leftovers.values():
        (folder / "partial").mkdir(parents=True)
    with store.writing("train", key, inputs={"data": "d"}, config={"steps": 1}, code={"digest": "1"}) as folder:
        (folder / "weights.safetensors").write_bytes(b"x" * 16)
    assert store.verify("train", key)
    assert sorted(p.name for p in stage.iterdir()) == sorted(
        [key, f".tmp-{key}-{os.getpid()}-1a1b1c1d", f".tmp-{other}-{dead_pid}-2a2b2c2d"]
    )
