"""The finetune flow with train.objective dpo and simpo on the bundled preference pairs: stages, keys, metrics, names."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from jaxtune.data.rows import OFFLINE_PAIRS
from tests.flows.toy import artifact, run_in_new_store, run_toy, states

pytestmark = [pytest.mark.preference, pytest.mark.slow]
DPO = ("data.format=preference", "train.objective=dpo", "train.eval_every=2")


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    return run_in_new_store(tmp_path_factory, *DPO)


def test_dpo_runs_the_reference_stage_and_starts_at_ln_2(dpo_run):
    store, result = dpo_run
    assert list(states(result)) == [
        "build_tokenizer",
        "build_model",
        "tokenize",
        "reference",
        "baseline_eval",
        "train",
        "final_eval",
        "export",
        "generate",
        "report",
    ]
    log = [json.loads(line) for line in (artifact(store, "train") / "log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 1 and log[0]["loss"] == pytest.approx(
        math.log(2), abs=1e-5
    )  # LoRA's B = 0: policy = reference
    baseline = json.loads((artifact(store, "baseline_eval") / "metrics.json").read_text())["preference"]
    assert baseline["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert (baseline["accuracy"], baseline["margin"], baseline["pairs"]) == (0.5, pytest.approx(0.0, abs=1e-5), 24)
    summary = json.loads((artifact(store, "train") / "summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["packed"]
    evals = [r for r in log if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]


def test_the_report_and_names_say_the_objective(dpo_run):
    store, _ = dpo_run
    report = (artifact(store, "report") / "report.md").read_text()
    assert "Preference tuning (dpo) on 24 held-out pairs" in report and "| preference accuracy | 0.500 |" in report
    assert "64 pairs in" not in report and "pairs in:" in report
    final = json.loads((artifact(store, "report") / "report.json").read_text())["preference"]
    assert final["objective"] == "dpo" and set(final["accuracy"]) == {"before", "after"}
    generations = (artifact(store, "generate") / "generations.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in generations]
    assert len(prompts) == len(set(prompts)) == 4  # each pair's prompt once, its chosen answer the reference


def test_the_report_names_the_pairs_training_helped_least(dpo_run):
    """Both evals record each pair's margin and log-probabilities, which average to the metrics;
    the report's hardest pairs are those whose margin rose least or fell, with the pair's texts."""
    store, _ = dpo_run

    def pairs(stage: str) -> dict:
        return json.loads((artifact(store, stage) / "pairs.json").read_text())

    before, after = pairs("baseline_eval"), pairs("final_eval")
    metrics = json.loads((artifact(store, "final_eval") / "metrics.json").read_text())["preference"]
    for figure in ("margin", "chosen_logp", "rejected_logp"):
        assert len(after[figure]) == 24 and np.mean(after[figure]) == pytest.approx(metrics[figure], abs=1e-5)
    assert np.mean(np.sign(after["margin"]) / 2 + 0.5) == pytest.approx(metrics["accuracy"])  # ties count half
    assert np.abs(before["margin"]).max() < 1e-5  # DPO's baseline: the policy is its own reference
    hardest = json.loads((artifact(store, "report") / "report.json").read_text())["hardest"]
    changes = sorted(a - b for b, a in zip(before["margin"], after["margin"]))
    assert hardest["compared"] == 24 and [p["change"] for p in hardest["pairs"]] == pytest.approx(changes[:5], abs=2e-6)
    source = {
        (r["prompt"], r["chosen"], r["rejected"]) for r in map(json.loads, OFFLINE_PAIRS.read_text().splitlines())
    }
    for p in hardest["pairs"]:
        assert (p["baseline_margin"], p["final_margin"]) == (before["margin"][p["pair"]], after["margin"][p["pair"]])
        assert (p["prompt"], p["chosen"], p["rejected"]) in source
    worse = hardest["worse_by_category"]
    assert sum(m["rows"] for m in worse.values()) == 24
    assert sum(m["worse"] for m in worse.values()) == sum(a < b for b, a in zip(before["margin"], after["margin"]))
    text = (artifact(store, "report") / "report.md").read_text()
    assert "## Hardest pairs" in text and f"| {hardest['pairs'][0]['pair']} |" in text


def test_a_second_run_is_cached_and_the_reference_follows_the_base_model(dpo_run):
    store, _ = dpo_run
    again = run_toy(store, *DPO)
    assert set(states(again).values()) == {"Cached"}
    changed = run_toy(store, *DPO, "preference.beta=0.5")
    ran = {stage for stage, state in states(changed).items() if state == "Completed"}
    assert ran == {"baseline_eval", "train", "final_eval", "export", "generate", "report"}  # not tokenize, reference
    other_base = run_toy(store, *DPO, "model.tiny.seed=1", until="reference")
    assert states(other_base)["reference"] == "Completed"


def test_simpo_has_no_reference_stage(tmp_path):
    result = run_toy(
        tmp_path, "data.format=preference", "train.objective=simpo", "preference.beta=2.0", until="baseline_eval"
    )
    assert "reference" not in states(result)
    baseline = json.loads((artifact(tmp_path, "baseline_eval") / "metrics.json").read_text())["preference"]
    # SimPO's reward is beta times the mean token log-probability: the model's own ranking, before any training.
    assert 0.0 < baseline["accuracy"] < 1.0 and baseline["margin"] != 0.0


def test_until_reference_needs_dpo(tmp_path):
    with pytest.raises(ValueError, match="no reference stage"):
        run_toy(tmp_path, until="reference")


def test_a_run_can_start_from_an_earlier_runs_export(tmp_path):
    """SFT then DPO: model.name names the SFT recipe, which runs first; the DPO run's keys follow its weights."""
    import yaml

    from jaxtune.config import load_config
    from jaxtune.errors import ConfigError
    from jaxtune.flows.finetune import finetune, planned_keys
    from tests.flows.toy import TOY

    sft = tmp_path / "sft.yaml"
    sft_config = load_config(None, [*TOY, f"store.root={tmp_path / 'store'}", "export.merge=true"]).model_dump(
        mode="json"
    )
    sft.write_text(yaml.safe_dump(sft_config))
    dpo = [*TOY, f"store.root={tmp_path / 'store'}", f"model.name={sft}", "model.dtype=float32", *DPO[:2]]
    with pytest.raises(ConfigError, match="export.merge: true"):
        unmerged = tmp_path / "unmerged.yaml"
        unmerged.write_text(yaml.safe_dump({**sft_config, "export": {"merge": False}}))
        finetune(overrides=[*dpo, f"model.name={unmerged}"], until="tokenize")

    first = finetune(overrides=dpo, until="baseline_eval")
    merged = tmp_path / "store" / "export" / planned_keys(load_config(sft))["export"] / "merged"
    assert (merged / "config.json").is_file()
    reference = tmp_path / "store" / "reference" / planned_keys(load_config(None, dpo))["reference"]
    assert states(first)["reference"] == "Completed" and reference.is_dir()
    evals = [json.loads(f.read_text()) for f in (tmp_path / "store" / "baseline_eval").glob("*/metrics.json")]
    (baseline,) = [metrics for metrics in evals if "preference" in metrics]  # the other is the SFT run's
    assert baseline["preference"]["loss"] == pytest.approx(math.log(2), abs=1e-5)

    # The SFT run trains longer: its export changes, and with it the DPO run's reference.
    sft.write_text(yaml.safe_dump({**sft_config, "train": {**sft_config["train"], "max_steps": 5}}))
    again = finetune(overrides=dpo, until="reference")
    assert states(again)["reference"] == "Completed"
    assert planned_keys(load_config(None, dpo))["reference"] != reference.name


def test_a_run_can_start_from_an_adapter_and_its_base(tmp_path):
    """model.name an earlier run's LoRA export (adapter/ over its base): merged once, by its own
    stage, into what that run's export.merge writes; the key follows the adapter's weights."""
    from safetensors.numpy import load_file, save_file

    from jaxtune.config import load_config
    from jaxtune.errors import ModelError
    from jaxtune.flows.finetune import finetune, planned_keys
    from tests.flows.toy import TOY

    store = tmp_path / "store"
    run_toy(store, "export.merge=true", until="export")
    (export,) = (store / "export").iterdir()
    dpo = [*TOY, f"store.root={store}", f"model.name={export}", "model.dtype=float32", *DPO[:2]]
    first = finetune(overrides=dpo, until="reference")
    assert states(first)["merge_adapter"] == "Completed" and states(first)["reference"] == "Completed"
    (merged,) = (store / "merge_adapter").iterdir()
    ours, theirs = load_file(str(merged / "model.safetensors")), load_file(str(export / "merged" / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=1e-6, err_msg=name)

    # Another adapter over the same base: merged again, and the reference follows.
    adapter = tmp_path / "adapter"
    shutil.copytree(export / "adapter", adapter)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(
        {k: v * 2 if "lora_B" in k else v for k, v in weights.items()}, str(adapter / "adapter_model.safetensors")
    )
    other = [*dpo, f"model.name={adapter}"]
    assert planned_keys(load_config(None, other))["reference"] != planned_keys(load_config(None, dpo))["reference"]
    assert states(finetune(overrides=other, until="tokenize"))["merge_adapter"] == "Completed"

    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(
        ModelError, match=r"adapter_config.json: a IA3 adapter; jaxtune starts from LoRA adapters alone"
    ):
        finetune(overrides=other, until="tokenize")
