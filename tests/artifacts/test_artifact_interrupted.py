"""A writer killed mid-write leaves no artifact, only a temp folder that clean_temp removes."""

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
