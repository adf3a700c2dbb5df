"""Cache keys and content digests."""

import hashlib
import os

import pytest
from pydantic import BaseModel

from jaxtune.artifacts import artifact_key, canonical_json, file_digest, tree_digest

BASE = dict(
    stage="tokenize",
    code="3",
    config={"max_length": 512, "seed": 0},
    inputs={"data": "abc", "model": "def"},
)


class Section(BaseModel):
    max_length: int = 512
    seed: int = 0


def test_key_is_deterministic_hex_of_fixed_length():
    key = artifact_key(**BASE)
    assert key == artifact_key(**BASE)
    assert len(key) == 20
    assert int(key, 16) >= 0


def test_key_is_sha256_prefix_of_canonical_payload():
    payload = {"stage": BASE["stage"], "code": "3", "config": BASE["config"], "inputs": BASE["inputs"]}
    text = '{"code":"3","config":{"max_length":512,"seed":0},"inputs":{"data":"abc","model":"def"},"stage":"tokenize"}'
    assert canonical_json(payload) == text
    assert artifact_key(**BASE) == hashlib.sha256(text.encode()).hexdigest()[:20]


@pytest.mark.parametrize(
    "change",
    [
        {"stage": "train"},
        {"code": "4"},
        {"config": {"max_length": 256, "seed": 0}},
        {"config": {"max_length": 512, "seed": 0, "extra": None}},
        {"config": None},
        {"inputs": {"data": "abd", "model": "def"}},
        {"inputs": {"data": "abc"}},
        {"inputs": {"dataset": "abc", "model": "def"}},
    ],
)
def test_each_argument_changes_the_key(change):
    assert artifact_key(**{**BASE, **change}) != artifact_key(**BASE)


def test_dict_order_does_not_change_the_key():
    reordered = dict(BASE, config={"seed": 0, "max_length": 512}, inputs={"model": "def", "data": "abc"})
    assert artifact_key(**reordered) == artifact_key(**BASE)


def test_pydantic_section_keys_like_its_json_dump():
    assert artifact_key(**dict(BASE, config=Section())) == artifact_key(**BASE)
    assert artifact_key(**dict(BASE, config=Section(seed=1))) != artifact_key(**BASE)


def test_values_without_json_form_are_rejected():
    with pytest.raises(TypeError):
        artifact_key(**dict(BASE, config={"when": object()}))


def test_file_digest_matches_hashlib(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)  # spans several read chunks
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert file_digest(path) == hashlib.sha256(data).hexdigest()


def test_a_large_settled_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    from jaxtune.artifacts import keys

    monkeypatch.setattr(keys, "_REMEMBERED_FROM_BYTES", 1 << 20)
    reads = []
    monkeypatch.setattr(keys.hashlib, "sha256", lambda *data: reads.append(1) or hashlib.new("sha256", *data))
    data = bytearray(os.urandom(2 << 20))

    def expected():
        return hashlib.new("sha256", bytes(data)).hexdigest()

    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert file_digest(path) == expected() and len(reads) == 1
    assert file_digest(path) == expected() and len(reads) == 2, "just written: read again"

    monkeypatch.setattr(keys, "_SETTLED_AFTER_NS", 0)
    file_digest(path)
    assert file_digest(path) == expected() and len(reads) == 3, "settled: read once more, then known"
    data[len(data) // 2] ^= 0xFF  # same size, same inode: only the file's times tell
    with open(path, "r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert file_digest(path) == expected() and len(reads) == 4


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "weights.bin").write_bytes(b"\x00\x01\x02")
    return root


def test_tree_digest_follows_content_not_mtime(tmp_path):
    root = _tree(tmp_path / "model")
    before = tree_digest(root)
    os.utime(root / "config.json", (1_000_000, 1_000_000))
    assert tree_digest(root) == before
    (root / "config.json").write_text('{"a": 2}')
    assert tree_digest(root) != before


def test_tree_digest_sees_names_and_new_files_and_equal_trees_match(tmp_path):
    first = _tree(tmp_path / "one")
    second = _tree(tmp_path / "two")
    assert tree_digest(first) == tree_digest(second)
    (second / "sub" / "weights.bin").rename(second / "sub" / "other.bin")
    assert tree_digest(second) != tree_digest(first)
    (first / "extra.txt").write_text("x")
    assert tree_digest(first) != tree_digest(_tree(tmp_path / "three"))


def test_tree_digest_excludes_only_named_entries(tmp_path):
    root = _tree(tmp_path / "model")
    before = tree_digest(root)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "result.json").write_text("{}")
    assert tree_digest(root) != before
    assert tree_digest(root, exclude={".git", "result.json"}) == before
    assert tree_digest(root, exclude={"sub"}) != before


def test_tree_digest_of_missing_folder_raises(tmp_path):
    with pytest.raises(NotADirectoryError):
        tree_digest(tmp_path / "absent")
