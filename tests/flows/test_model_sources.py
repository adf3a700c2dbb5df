"""Which model goes with which data: any pairing, and a GGUF file keyed by its content."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxtune.config import load_config
from tests.flows.toy import TOY, run_toy, states


def _keys(*overrides: str) -> dict[str, str]:
    from jaxtune.flows.finetune import planned_keys

    return planned_keys(load_config(None, list(overrides)))


def test_a_gguf_file_is_imported_first_and_keyed_by_its_bytes_not_its_path(tmp_path):
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    moved = tmp_path / "b" / "renamed.gguf"
    moved.parent.mkdir()
    shutil.copy(first, moved)
    keys = _keys(f"model.name={first}")
    assert list(keys)[:2] == ["import_gguf", "tokenize"]  # no offline build stages, the import before tokenize
    assert _keys(f"model.name={moved}") == keys
    edited = bytearray(first.read_bytes())
    edited[100] ^= 1
    moved.write_bytes(bytes(edited))
    changed = _keys(f"model.name={moved}")
    assert {stage for stage in keys if changed[stage] == keys[stage]} == set()  # every stage reads the model


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.gguf.*no such GGUF file"):
        _keys(f"model.name={tmp_path / 'nothere.gguf'}")


def test_the_chat_template_setting_keys_every_stage_that_formats_or_decodes_text():
    plain, gemma = _keys(*TOY), _keys(*TOY, "model.chat_template=gemma")
    assert {stage for stage in plain if plain[stage] != gemma[stage]} == {
        "tokenize",
        "baseline_eval",
        "train",
        "final_eval",
        "export",
        "generate",
        "report",
    }


@pytest.mark.slow
def test_the_offline_model_trains_its_tokenizer_on_a_users_own_file(tmp_path):
    from transformers import AutoTokenizer

    rows = [
        {"prompt": f"Where does the quorbix number {i} live?", "completion": f"The quorbix {i} lives in Zandervale."}
        for i in range(40)
    ]
    data = tmp_path / "own.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    store = tmp_path / "store"
    result = run_toy(
        store,
        f"data.source={data}",
        "data.format=prompt_completion",
        "data.max_train_rows=null",
        "data.max_eval_rows=null",
        until="tokenize",
    )
    assert states(result) == {"build_tokenizer": "Completed", "build_model": "Completed", "tokenize": "Completed"}
    (folder,) = (store / "build_tokenizer").iterdir()
    own = AutoTokenizer.from_pretrained(folder)
    # A word only this file has, 80 times, is one token of its tokenizer (7 bytes, so 7 pieces
    # for a BPE that never saw it, such as the bundled data's).
    assert len(own.tokenize(" quorbix")) == 1
    stats = json.loads(next((store / "tokenize").glob("*/stats.json")).read_text())
    assert stats["rows_in"] == 40
    assert stats["pad_id"] == own.pad_token_id is not None  # what train and eval pad with, without the tokenizer


def test_a_content_keyed_tokenizer_is_opened_once_per_process_and_again_once_edited(tmp_path, monkeypatch):
    """open_tokenizer shares one tokenizer per (folder content, settings); an edited folder has a new
    key and is opened afresh, a hub id (whose revision can move) is opened each time."""
    from transformers import AutoTokenizer

    from jaxtune.config import DataConfig, ModelConfig
    from jaxtune.data.rows import read_rows
    from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer
    from jaxtune.tasks import sources

    folder = tmp_path / "model"
    train_tokenizer(texts_for_tokenizer(read_rows(DataConfig())[:50]), 300, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    opened = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    cfg = ModelConfig(name=str(folder))
    first = sources.open_tokenizer(sources.model_ref(cfg), cfg)
    assert sources.open_tokenizer(sources.model_ref(cfg), cfg) is first and opened == [str(folder.resolve())]
    templated = sources.open_tokenizer(sources.model_ref(cfg), ModelConfig(name=str(folder), chat_template="gemma"))
    assert templated is not first and templated.chat_template != first.chat_template and len(opened) == 2
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    edited = sources.open_tokenizer(sources.model_ref(cfg), cfg)
    assert len(opened) == 3 and edited.model_max_length == 77 and first.model_max_length != 77
    hub = sources.ArtifactRef(stage="hub", key="k", path=f"{folder}@None")
    monkeypatch.setattr(sources, "pretrained_location", lambda ref: (str(folder), None))
    assert sources.open_tokenizer(hub, cfg) is not sources.open_tokenizer(hub, cfg) and len(opened) == 5
