"""The session's real store is shared by every module: an import another module made is found,
not made again, whatever path the GGUF file was placed at."""

import shutil

import pytest

from tests.real import checks

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_a_checkpoint_imported_once_is_found_by_the_next_module_at_any_path(real_store, tmp_path, monkeypatch):
    from jaxtune.offline.checkpoints import place_smollm2
    from jaxtune.tasks import import_gguf

    first = checks.import_checkpoint(place_smollm2, real_store)  # this module's, or another's already
    manifest = first.folder / "manifest.json"
    made = manifest.stat().st_mtime_ns

    def no_import(gguf, folder):
        raise AssertionError(f"{gguf} imported again")

    monkeypatch.setattr(import_gguf, "write_hf_folder", no_import)

    def elsewhere(folder):
        copy = tmp_path / "moved" / "renamed.gguf"  # the same bytes: the key is the content's
        copy.parent.mkdir()
        shutil.copyfile(first.gguf, copy)
        return copy

    again = checks.import_checkpoint(elsewhere, real_store)
    assert again.folder == first.folder and manifest.stat().st_mtime_ns == made
    assert again.gguf != first.gguf
    assert [p.name for p in (real_store / "import_gguf").iterdir() if p.name == first.folder.name] == [
        first.folder.name
    ]
