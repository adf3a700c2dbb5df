"""Writing, verifying, replacing and removing artifact folders."""

import json
import os
from datetime import datetime

import pytest
from pydantic import BaseModel, ValidationError

from jaxtune.artifacts import ArtifactRef, ArtifactStore, file_digest
from jaxtune.errors import ArtifactMissing

STAGE = "tokenize"
KEY = "0123456789abcdef0123"
META = dict(inputs={"data": "aaaa", "model": "bbbb"}, config={"max_length": 64}, code={"digest": "2"})


class Section(BaseModel):
    max_length: int = 64


def _write(store, key=KEY, files=None, **meta):
    files = {"train.arrow": b"rows", "stats/summary.json": b'{"n": 3}'} if files is None else files
    with store.writing(STAGE, key, **{**META, **meta}) as folder:
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return store.ref(STAGE, key)


def _leftovers(store):
    return sorted(p.name for p in (store.root / STAGE).iterdir() if p.name.startswith(".tmp-"))


def test_write_then_ref_round_trip(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    ref = _write(store)
    assert ref == ArtifactRef(stage=STAGE, key=KEY, path=str(tmp_path / "store" / STAGE / KEY))
    assert store.folder(STAGE, KEY) == tmp_path / "store" / STAGE / KEY
    assert store.verify(STAGE, KEY)
    assert ref.file("train.arrow").read_bytes() == b"rows"
    assert ref.read_json("stats/summary.json") == {"n": 3}
    assert _leftovers(store) == []
    assert ArtifactRef.model_validate_json(ref.model_dump_json()) == ref


def test_ref_is_frozen_and_stays_inside_its_folder(tmp_path):
    ref = _write(ArtifactStore(tmp_path))
    with pytest.raises(ValidationError):
        ref.key = "other"
    with pytest.raises(ValueError):
        ref.file("../other/manifest.json")


def test_manifest_lists_files_and_metadata(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = _write(store, config=Section())
    manifest = store.manifest(STAGE, KEY)
    assert manifest["stage"] == STAGE and manifest["key"] == KEY
    assert manifest["inputs"] == {"data": "aaaa", "model": "bbbb"}
    assert manifest["config"] == {"max_length": 64}
    assert manifest["code"] == {"digest": "2"}
    assert datetime.fromisoformat(manifest["created_at"]).tzinfo is not None
    assert manifest["files"] == {
        "stats/summary.json": {"sha256": file_digest(ref.file("stats/summary.json")), "bytes": 8},
        "train.arrow": {"sha256": file_digest(ref.file("train.arrow")), "bytes": 4},
    }
    text = ref.file("manifest.json").read_text()
    assert text == json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def test_verify_fails_when_a_listed_file_changes(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = _write(store)
    ref.file("train.arrow").write_bytes(b"ROWS")  # same size, other bytes
    assert not store.verify(STAGE, KEY)
    with pytest.raises(ArtifactMissing, match="wrong sha256"):
        store.ref(STAGE, KEY)


def test_verify_fails_when_a_listed_file_is_deleted(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = _write(store)
    ref.file("stats/summary.json").unlink()
    assert not store.verify(STAGE, KEY)
    with pytest.raises(ArtifactMissing) as caught:
        store.ref(STAGE, KEY)
    assert str(store.folder(STAGE, KEY)) in str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)


def test_verify_fails_on_bad_or_foreign_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = _write(store)
    manifest = store.manifest(STAGE, KEY)
    ref.file("manifest.json").write_text(json.dumps({**manifest, "key": "somethingelse"}))
    assert not store.verify(STAGE, KEY)
    ref.file("manifest.json").write_text("{not json")
    assert not store.verify(STAGE, KEY)


def test_verify_ignores_unlisted_result_json(tmp_path):
    store = ArtifactStore(tmp_path)
    ref = _write(store)
    ref.file("result.json").write_text('{"prefect": "record"}')
    assert store.verify(STAGE, KEY)
    assert store.ref(STAGE, KEY) == ref


def test_missing_artifact_raises_naming_the_folder(tmp_path):
    store = ArtifactStore(tmp_path)
    assert not store.verify(STAGE, KEY)
    with pytest.raises(ArtifactMissing, match="manifest.json is missing") as caught:
        store.ref(STAGE, KEY)
    assert caught.value.filename == str(store.folder(STAGE, KEY))
    with pytest.raises(ArtifactMissing):
        store.manifest(STAGE, KEY)


def test_exception_inside_writing_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with store.writing(STAGE, KEY, **META) as folder:
            (folder / "train.arrow").write_bytes(b"partial")
            raise RuntimeError("boom")
    assert not store.folder(STAGE, KEY).exists()
    assert _leftovers(store) == []


def test_exception_while_replacing_keeps_the_old_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store)
    with pytest.raises(RuntimeError):
        with store.writing(STAGE, KEY, **META) as folder:
            (folder / "new.bin").write_bytes(b"new")
            raise RuntimeError("boom")
    assert store.verify(STAGE, KEY)
    assert sorted(store.manifest(STAGE, KEY)["files"]) == ["stats/summary.json", "train.arrow"]


def test_writer_may_not_write_its_own_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(ValueError, match="reserved"):
        _write(store, files={"manifest.json": b"{}"})
    assert not store.folder(STAGE, KEY).exists()
    assert _leftovers(store) == []


def test_replacing_keeps_exactly_the_new_files(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store)
    store.folder(STAGE, KEY).joinpath("result.json").write_text("{}")
    ref = _write(store, files={"eval.arrow": b"new rows"})
    on_disk = sorted(p.relative_to(ref.folder).as_posix() for p in ref.folder.rglob("*") if p.is_file())
    assert on_disk == ["eval.arrow", "manifest.json"]
    assert sorted(store.manifest(STAGE, KEY)["files"]) == ["eval.arrow"]
    assert store.verify(STAGE, KEY)
    assert _leftovers(store) == []


def test_remove_deletes_the_folder(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store)
    assert store.remove(STAGE, KEY) is True
    assert not store.folder(STAGE, KEY).exists()
    assert store.remove(STAGE, KEY) is False
    assert _leftovers(store) == []


def test_clean_temp_spares_live_writers_unless_told(tmp_path):
    store = ArtifactStore(tmp_path)
    # Another key's: a dead writer's folder of KEY itself is removed by the next writer of KEY.
    dead = store.root / STAGE / f".tmp-{'f' * len(KEY)}-999999999-deadbeef"
    dead.mkdir(parents=True)
    with store.writing(STAGE, KEY, **META) as live:
        assert store.clean_temp() == [dead]
        assert live.is_dir()
        assert store.clean_temp(include_live=True) == [live]
        assert not live.exists()
        os.mkdir(live)  # let the context finish cleanly
    assert store.verify(STAGE, KEY)


@pytest.mark.parametrize("stage, key", [("../up", KEY), (STAGE, ".tmp-x"), (STAGE, "a/b"), ("", KEY)])
def test_unsafe_names_are_rejected(tmp_path, stage, key):
    with pytest.raises(ValueError):
        ArtifactStore(tmp_path).folder(stage, key)
