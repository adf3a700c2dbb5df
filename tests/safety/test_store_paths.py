"""Paths that escape the store are refused, and what lies outside an artifact folder is never
trusted as part of it: names, manifest entries, symlinks, a store root that is a file, and
changed bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxtune.artifacts import MANIFEST, ArtifactRef, ArtifactStore

pytestmark = pytest.mark.safety

STAGE = "tokenize"
KEY = "0123456789abcdef0123"
META = dict(inputs={"data": "aaaa"}, config={"max_length": 64}, code={"digest": "1"})
ESCAPES = ["..", "../x", "/abs", ".hidden", "a/b", "x/../../y", "", ".", "~", "a\0b", "key\n"]


def _publish(store: ArtifactStore, files: dict[str, bytes] | None = None, key: str = KEY) -> ArtifactRef:
    files = {"train.arrow": b"rows" * 16, "stats/summary.json": b'{"n": 3}'} if files is None else files
    with store.writing(STAGE, key, **META) as folder:
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return store.ref(STAGE, key)


def _rewrite_manifest(store: ArtifactStore, change) -> None:
    path = store.folder(STAGE, KEY) / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ESCAPES)
def test_a_stage_or_key_that_is_not_a_plain_name_is_refused(tmp_path, name):
    store = ArtifactStore(tmp_path / "store")
    for call in (store.folder, store.scratch):
        with pytest.raises(ValueError, match="invalid artifact stage"):
            call(name, KEY)
        with pytest.raises(ValueError, match="invalid artifact key"):
            call(STAGE, name)
    with pytest.raises(ValueError):
        with store.writing(STAGE, name, **META):
            pytest.fail("a folder was handed out for an escaping key")
    assert list(tmp_path.iterdir()) == [], "nothing was created, inside the store or beside it"


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "..", "", ".", "stats/../../x"])
def test_a_ref_refuses_a_file_name_that_leaves_its_folder(tmp_path, name):
    ref = ArtifactRef(stage=STAGE, key=KEY, path=str(tmp_path / STAGE / KEY))
    with pytest.raises(ValueError, match="not a relative path inside artifact"):
        ref.file(name)
    with pytest.raises(ValueError):
        ref.read_json(name)


def test_a_ref_gives_paths_inside_its_folder(tmp_path):
    ref = ArtifactRef(stage=STAGE, key=KEY, path=str(tmp_path / STAGE / KEY))
    assert ref.file("stats/summary.json") == tmp_path / STAGE / KEY / "stats" / "summary.json"
    assert ref.file("./train.arrow") == tmp_path / STAGE / KEY / "train.arrow"


def test_a_store_root_with_dotdot_resolves(tmp_path):
    (tmp_path / "a").mkdir()
    store = ArtifactStore(tmp_path / "a" / ".." / "store")
    assert store.root == (tmp_path / "store").resolve()
    assert ".." not in store.root.parts
    ref = _publish(store)
    assert Path(ref.path) == (tmp_path / "store" / STAGE / KEY).resolve()
    assert store.verify(STAGE, KEY)


# -- manifests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["../outside", "/abs", "stats/../../outside"])
def test_a_manifest_listing_a_file_outside_its_folder_is_not_trusted(tmp_path, entry):
    store = ArtifactStore(tmp_path / "store")
    _publish(store)
    # A real file at the named place, with its true digest: only the name makes it wrong.
    outside = (store.folder(STAGE, KEY) / entry) if not entry.startswith("/") else tmp_path / "abs"
    outside = outside.resolve()
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_bytes(b"not part of the artifact")
    from jaxtune.artifacts import file_digest

    listed = entry if not entry.startswith("/") else str(outside)
    _rewrite_manifest(store, lambda m: m["files"].update({listed: {"sha256": file_digest(outside), "bytes": 24}}))
    problem = store.problem(STAGE, KEY)
    assert problem is not None and repr(listed) in problem and "malformed" in problem
    assert not store.verify(STAGE, KEY)
    with pytest.raises(FileNotFoundError, match="no verified artifact"):
        store.ref(STAGE, KEY)


def test_a_damaged_artifact_is_recomputed_by_the_stage(tmp_path):
    """The store does not trust it, so build_artifact builds it again, and then it verifies."""
    from jaxtune.tasks.stage import build_artifact

    calls = []

    def build(folder: Path) -> None:
        calls.append(folder)
        (folder / "rows.txt").write_text("rows")

    ref = build_artifact(tmp_path / "store", STAGE, "jaxtune.tasks.tokenize", {"n": 1}, {}, build)
    store = ArtifactStore(tmp_path / "store")
    path = Path(ref.path) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"]["../outside"] = {"sha256": "0" * 64, "bytes": 0}
    path.write_text(json.dumps(manifest))
    assert not store.verify(STAGE, ref.key)
    again = build_artifact(tmp_path / "store", STAGE, "jaxtune.tasks.tokenize", {"n": 1}, {}, build)
    assert len(calls) == 2 and again == ref and store.verify(STAGE, ref.key)
    assert "../outside" not in json.loads(path.read_text())["files"]


def test_a_file_whose_bytes_changed_but_not_its_size_fails_verification(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    ref = _publish(store)
    path = ref.file("train.arrow")
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert path.stat().st_size == len(data)
    assert store.problem(STAGE, KEY) == "listed file train.arrow has the wrong sha256"
    assert not store.verify(STAGE, KEY)


# -- symlinks ------------------------------------------------------------------------------------


def test_writing_refuses_a_symlink_to_a_file_outside_and_names_it(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the artifact")
    with pytest.raises(ValueError, match=r"weights/model\.bin is a symlink out of the artifact folder"):
        with store.writing(STAGE, KEY, **META) as folder:
            (folder / "weights").mkdir()
            (folder / "weights" / "model.bin").symlink_to(secret)
    assert not store.folder(STAGE, KEY).exists() and not store.verify(STAGE, KEY)
    assert not list((tmp_path / "store" / STAGE).iterdir()), "the temp folder is gone"
    assert secret.read_text() == "outside the artifact"


@pytest.mark.parametrize("target", ["../../secret.txt", "../..", "/"])
def test_writing_refuses_relative_and_directory_links_out(tmp_path, target):
    store = ArtifactStore(tmp_path / "store")
    (tmp_path / "secret.txt").write_text("outside")
    with pytest.raises(ValueError, match="link is a symlink"):
        with store.writing(STAGE, KEY, **META) as folder:
            (folder / "link").symlink_to(target)
    assert not store.folder(STAGE, KEY).exists()


def test_writing_refuses_an_absolute_link_even_into_its_own_temp_folder(tmp_path):
    """It would point into the temp folder, which is renamed on publishing."""
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ValueError, match="alias.txt is a symlink by absolute path"):
        with store.writing(STAGE, KEY, **META) as folder:
            (folder / "real.txt").write_text("x")
            (folder / "alias.txt").symlink_to(folder / "real.txt")


def test_writing_keeps_a_relative_link_inside_the_folder(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    with store.writing(STAGE, KEY, **META) as folder:
        (folder / "real.txt").write_text("x")
        (folder / "alias.txt").symlink_to("real.txt")
    assert store.verify(STAGE, KEY)
    assert set(store.manifest(STAGE, KEY)["files"]) == {"real.txt", "alias.txt"}


def test_a_listed_file_replaced_by_a_link_out_is_reported(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    ref = _publish(store)
    inside = ref.file("train.arrow")
    copy = tmp_path / "elsewhere.arrow"
    copy.write_bytes(inside.read_bytes())  # same bytes, so size and sha256 alone would pass
    inside.unlink()
    inside.symlink_to(copy)
    problem = store.problem(STAGE, KEY)
    assert problem is not None and "train.arrow" in problem and "out of the artifact folder" in problem
    assert not store.verify(STAGE, KEY)


def test_a_listed_folder_replaced_by_a_link_out_is_reported(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    ref = _publish(store)
    stats = ref.file("stats")
    elsewhere = tmp_path / "elsewhere"
    os.rename(stats, elsewhere)
    stats.symlink_to(elsewhere, target_is_directory=True)
    problem = store.problem(STAGE, KEY)
    assert problem is not None and "stats/summary.json" in problem and "out of the artifact folder" in problem


def test_a_manifest_that_is_a_link_out_is_reported(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    _publish(store)
    manifest = store.folder(STAGE, KEY) / MANIFEST
    elsewhere = tmp_path / "manifest-elsewhere.json"
    elsewhere.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(elsewhere)
    assert "link out of the artifact folder" in store.problem(STAGE, KEY)


def test_removing_an_artifact_never_deletes_what_its_links_point_at(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    _publish(store)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data.txt").write_text("keep me")
    (store.folder(STAGE, KEY) / "planted").symlink_to(keep, target_is_directory=True)
    assert store.remove(STAGE, KEY)
    assert not store.folder(STAGE, KEY).exists()
    assert (keep / "data.txt").read_text() == "keep me"


# -- the store root ------------------------------------------------------------------------------


def test_a_store_root_that_is_a_file_is_refused_naming_it(tmp_path):
    root = tmp_path / "store"
    root.write_text("I am a file")
    with pytest.raises(NotADirectoryError, match="needs a folder, not a file") as error:
        ArtifactStore(root)
    assert str(root) in str(error.value)
    below = root / "sub"
    with pytest.raises(NotADirectoryError) as error:
        ArtifactStore(below)
    assert str(root) in str(error.value) and str(below) in str(error.value)
    assert root.read_text() == "I am a file"


def test_the_flow_refuses_a_store_root_that_is_a_file_before_any_stage(tmp_path):
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import StageRunner

    root = tmp_path / "store"
    root.write_text("I am a file")
    config = load_config(None, [f"store.root={root}"])
    with pytest.raises(NotADirectoryError) as error:
        StageRunner(Path(config.store.root).resolve(), set(), config)
    assert str(root) in str(error.value)
    # The one line `jaxtune run` prints for it names the file.
    from jaxtune.cli.main import _one_line

    assert str(root) in _one_line(error.value) and "not a file" in _one_line(error.value)


def test_a_listed_file_replaced_by_a_symlink_loop_is_reported_not_raised(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    ref = _publish(store)
    inside = ref.file("train.arrow")
    inside.unlink()
    inside.symlink_to("train.arrow")  # points at itself
    problem = store.problem(STAGE, KEY)
    assert problem is not None and "train.arrow" in problem
    assert not store.verify(STAGE, KEY)
