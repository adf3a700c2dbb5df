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

    parsed, real = [], gguf.GGUFReader

    def counting(path, *args, **kwargs):
        parsed.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    write_hf_folder(file, tmp_path / "imported")
    assert parsed == ["tiny.gguf"]  # transformers alone parses it three times: tokenizer, config, weights
    assert gguf.GGUFReader is counting, "the memo is undone after the import"
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "imported").iterdir())
    for name in names:
        assert (tmp_path / "imported" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
