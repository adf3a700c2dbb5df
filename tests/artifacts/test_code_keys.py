"""Stage keys hash the code a stage runs: its module, the jaxtune modules it imports, and the
versions of the libraries that do its math."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtune.artifacts.code import (
    LIBRARIES,
    code_digest,
    code_identity,
    library_versions,
    module_digests,
    source_digest,
)

pytestmark = pytest.mark.cache

PACKAGE = Path(__file__).parents[2] / "jaxtune"
AFTER_TRAIN = {"train", "final_eval", "export", "generate", "report"}

SOURCE = '''
"""Module docstring."""
def scale(x):
    """Doubles x."""
    return x * 2  # the factor
'''


def digest(text: str) -> str:
    return source_digest(ast.parse(text))


def test_comments_docstrings_and_layout_keep_the_digest():
    reworded = SOURCE.replace("Doubles x.", "Returns twice x.").replace("# the factor", "# why two")
    reflowed = SOURCE.replace("return x * 2", "return (\n        x * 2\n    )")
    without = SOURCE.replace('    """Doubles x."""\n', "").replace('"""Module docstring."""\n', "")
    assert digest(reworded) == digest(reflowed) == digest(without) == digest(SOURCE)


@pytest.mark.parametrize("edit", [("x * 2", "x * 3"), ("x * 2", "2 * x"), ("def scale(x)", "def scale(y)")])
def test_a_logic_change_changes_the_digest(edit):
    assert digest(SOURCE.replace(*edit)) != digest(SOURCE)


def test_a_string_that_is_not_a_docstring_counts():
    assert digest('def f():\n    x = 1\n    "text"\n') != digest('def f():\n    x = 1\n    "other"\n')


def test_a_stage_is_keyed_by_every_module_it_imports_and_only_those():
    train = code_identity("jaxtune.tasks.train")["modules"]
    # Imported inside functions (runtime), relatively (artifacts), and their packages' __init__.
    for module in (
        "jaxtune.runtime.train.training",
        "jaxtune.runtime.compiled.steps",
        "jaxtune.runtime.modeling.remat",
        "jaxtune.runtime",
        "jaxtune.data.tokenize",
        "jaxtune.artifacts.keys",
        "jaxtune.artifacts.code",
        "jaxtune.config",
    ):
        assert module in train, module
    tokenize = code_identity("jaxtune.tasks.tokenize")["modules"]
    assert "jaxtune.data.rows" in tokenize and not [m for m in tokenize if m.startswith("jaxtune.runtime")]
    evaluate = code_identity("jaxtune.tasks.evaluate")["modules"]
    assert "jaxtune.runtime.measures.parity" in evaluate and "jaxtune.runtime.train.training" not in evaluate
    assert "jaxtune.tasks.train" not in evaluate  # reading a train artifact does not run the trainer


def test_library_versions_are_in_the_digest_and_the_manifest():
    identity = code_identity("jaxtune.tasks.train")
    assert set(identity["libraries"]) == set(LIBRARIES) >= {"torch", "torchax", "jax", "transformers", "peft"}
    assert identity["libraries"] == library_versions()
    import torch

    assert identity["libraries"]["torch"] == torch.__version__
    upgraded = {**identity["libraries"], "transformers": "99.0.0"}
    assert code_digest(identity["modules"], upgraded) != identity["digest"]
    assert code_digest(identity["modules"], identity["libraries"]) == identity["digest"]


def planned_keys_in(package_copy: Path) -> dict[str, str]:
    """The default config's stage keys as a fresh interpreter computes them from the package copy's source."""
    script = (
        "import json, jaxtune; from jaxtune.flows.finetune import load_recipe, planned_keys; "
        "print(json.dumps({'file': jaxtune.__file__, 'keys': planned_keys(load_recipe())}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=package_copy,
        env={**os.environ, "PYTHONPATH": str(package_copy)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(package_copy), result["file"]
    return result["keys"]


def copy_with_edit(root: Path, name: str, path: str | None = None, old: str = "", new: str = "") -> Path:
    """A copy of the jaxtune package under `root/name`, with `old` replaced by `new` in `path`."""
    target = root / name
    shutil.copytree(PACKAGE, target / "jaxtune", ignore=shutil.ignore_patterns("__pycache__"))
    if path is None:
        return target
    file = target / "jaxtune" / path
    text = file.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    file.write_text(text.replace(old, new))
    return target


def test_editing_the_training_loop_rekeys_train_and_downstream_only(tmp_path):
    from jaxtune.flows.finetune import load_recipe, planned_keys

    here = planned_keys(load_recipe())
    moved = planned_keys_in(copy_with_edit(tmp_path, "same"))
    assert moved == here, "the package's location is not in any key"
    commented = planned_keys_in(
        copy_with_edit(
            tmp_path,
            "commented",
            "runtime/train/training.py",
            '    """`max_steps`, or the optimizer steps in `epochs` passes over the feed\'s micro-batches."""',
            '    """The optimizer steps to take: `max_steps`, else `epochs` passes\' worth."""  # reworded',
        )
    )
    assert commented == here, "a docstring or comment is not code"
    edited = planned_keys_in(
        copy_with_edit(
            tmp_path,
            "edited",
            "runtime/train/training.py",
            "return max(cfg.epochs * feed.micro_batches_per_epoch // cfg.grad_accumulation, 1)",
            "return max(cfg.epochs * feed.micro_batches_per_epoch // cfg.grad_accumulation, 2)",
        )
    )
    changed = {stage for stage in here if edited[stage] != here[stage]}
    assert changed == AFTER_TRAIN, changed


def test_editing_the_tokenizer_code_rekeys_everything_after_the_model(tmp_path):
    from jaxtune.flows.finetune import load_recipe, planned_keys

    here = planned_keys(load_recipe())
    edited = planned_keys_in(
        copy_with_edit(tmp_path, "edited", "data/tokenize.py", "IGNORE_INDEX = -100", "IGNORE_INDEX = -101")
    )
    changed = {stage for stage in here if edited[stage] != here[stage]}
    # data.tokenize is read by tokenize and by the runtime (IGNORE_INDEX), not by the offline model's builders.
    assert changed == set(here) - {"build_tokenizer", "build_model"}, changed


def test_module_digests_follow_relative_imports():
    digests = module_digests("jaxtune.artifacts")
    assert {
        "jaxtune",
        "jaxtune.artifacts",
        "jaxtune.artifacts.keys",
        "jaxtune.artifacts.ref",
        "jaxtune.artifacts.store",
    } <= set(digests)


def test_a_spurious_ast_recursion_error_is_parsed_again(monkeypatch):
    """CPython 3.11 can raise SystemError('AST constructor recursion depth mismatch') when threads
    build ASTs at once; the code key must not fail a flow for it, nor hide any other error."""
    from jaxtune.artifacts import code

    real_parse, calls = ast.parse, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=198, after=76)")
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(code.ast, "parse", flaky)
    assert code._parse(code.module_file("jaxtune.config")).body and len(calls) == 2

    def broken(*args, **kwargs):
        raise SystemError("something else")

    monkeypatch.setattr(code.ast, "parse", broken)
    with pytest.raises(SystemError, match="something else"):
        code._parse(code.module_file("jaxtune.config"))


def test_a_file_edited_within_one_process_is_digested_afresh(tmp_path):
    """Module digests are cached by source text within a process, never by path alone: an edit,
    or an import dropped, shows at the next `module_digests` call. (`code_identity` keeps what it
    first read on purpose, one level up.)"""
    package = tmp_path / "jaxtune"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from jaxtune import b\nX = b.Y + 1\n")
    (package / "b.py").write_text("Y = 1\n")
    first = module_digests("jaxtune.a", package)
    assert set(first) == {"jaxtune", "jaxtune.a", "jaxtune.b"}
    assert module_digests("jaxtune.a", package) == first
    (package / "b.py").write_text("Y = 2\n")
    edited = module_digests("jaxtune.a", package)
    assert edited["jaxtune.b"] != first["jaxtune.b"] and edited["jaxtune.a"] == first["jaxtune.a"]
    (package / "a.py").write_text("X = 1\n")
    assert set(module_digests("jaxtune.a", package)) == {"jaxtune", "jaxtune.a"}
