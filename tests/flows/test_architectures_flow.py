"""The whole pipeline on every family: tokenize through report with LoRA, and the exported
adapter reloads in plain PyTorch with the eval loss the pipeline measured (within 1%).

Gemma 3, the offline default's family, runs the same checks in test_finetune_flow.py (with
LoRA on every projection plus trained embeddings) and in test_recipes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxtune.config import ARCHITECTURES, load_config
from tests.flows.plain_torch import EXPORT_RTOL, TRAINED_MARGIN, plain_torch_losses
from tests.flows.shapes import TOY_MODEL

pytestmark = [pytest.mark.parity, pytest.mark.slow]

FAMILIES = [family for family in ARCHITECTURES if family != "gemma3"]

SETTINGS = [
    *TOY_MODEL,
    "data.max_train_rows=64",
    "data.max_eval_rows=24",
    "data.max_length=96",
    # Every family's own linear layers (GPT-2 and Phi-3 fuse q/k/v), no fully trained modules.
    "lora.target_modules=all-linear",
    "lora.modules_to_save=[]",
    "train.max_steps=8",
    "train.batch_size=4",
    "train.log_every=4",
    "train.warmup_steps=1",
    "generate.num_prompts=4",
    "generate.max_new_tokens=6",
    "generate.batch_size=4",
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """One run per family, sharing a store (and so the tokenizer)."""
    from jaxtune.flows.finetune import finetune

    store = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        config = load_config(None, [*SETTINGS, f"model.tiny.architecture={family}", f"store.root={store}"])
        result = finetune(config=config)
        report = json.loads((Path(result["path"]) / "report.json").read_text())
        manifest = json.loads((Path(result["path"]) / "manifest.json").read_text())
        report["eval_arrow"] = store / "tokenize" / manifest["inputs"]["tokenize"] / "eval.arrow"
        out[family] = report
    return out


@pytest.fixture(scope="module")
def plain_losses(reports) -> dict[str, float]:
    cases = []
    for report in reports.values():
        adapter = Path(report["export"]["path"])
        base = json.loads((adapter.parent / "export.json").read_text())["base_model"]
        cases.append({"base": base, "adapter": adapter, "eval_arrow": report["eval_arrow"]})
    return dict(zip(reports, plain_torch_losses(cases)))


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_trains_and_certifies_each_family(family, reports):
    report = reports[family]
    assert report["baseline"]["loss"] - report["final"]["loss"] >= TRAINED_MARGIN * report["baseline"]["loss"], report
    assert report["export"]["kind"] == "peft_adapter"
    assert report["parity"]["max_abs_diff"] <= 1e-4 and report["parity"]["top1_agreement"] == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_adapter_reloads_in_plain_pytorch_with_the_same_loss(family, reports, plain_losses):
    assert plain_losses[family] == pytest.approx(reports[family]["final"]["loss"], rel=EXPORT_RTOL)
