"""The GGUF import parses the file once and writes what transformers' own reader writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.test_model_errors import write_tiny_gguf

pytestmark = pytest.mark.badinput


def plain_transformers_folder(gguf: Path, folder: Path) -> None:
    """The folder as transformers writes it with nothing memoized: what the import must equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def test_the_import_reads_the_header_once_and_writes_transformers_own_folder(tmp_path, monkeypatch):
    import gguf

    from jaxtune.tasks.import_gguf import write_hf_folder

    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    plain_transformers_folder(file, tmp_path / "plain")

    parsed = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    write_hf_folder(file, tmp_path / "imported")
    assert parsed == ["tiny.gguf"]  # transformers alone parses it three times: tokenizer, config, weights
    assert gguf.GGUFReader is Counting, "the memo is undone after the import"
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "imported").iterdir())
    for name in names:
        assert (tmp_path / "imported" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_callers_sharing_a_store_import_a_file_once(tmp_path, monkeypatch):
    """Two callers at once (as two test modules or `jaxtune chat` beside a flow run): the second
    waits on the stage's store lock, then finds the first one's folder."""
    import threading
    import time

    from jaxtune.config import ModelConfig
    from jaxtune.tasks import import_gguf
    from jaxtune.tasks.sources import model_ref

    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    copy = tmp_path / "elsewhere" / "renamed.gguf"  # the same bytes under another name: the same key
    copy.parent.mkdir()
    copy.write_bytes(file.read_bytes())
    built, write = [], import_gguf.write_hf_folder

    def slow_write(gguf, folder):
        built.append(gguf)
        time.sleep(0.5)  # long enough for the other caller to arrive while this one builds
        write(gguf, folder)

    monkeypatch.setattr(import_gguf, "write_hf_folder", slow_write)
    refs = {}
    callers = [
        threading.Thread(
            target=lambda p=p: refs.__setitem__(
                p, import_gguf.imported(tmp_path / "store", model_ref(ModelConfig(name=str(p))))
            )
        )
        for p in (file, copy)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(built) == 1
    assert refs[file] == refs[copy]
    assert [p.name for p in (tmp_path / "store" / "import_gguf").iterdir()] == [refs[file].key]
