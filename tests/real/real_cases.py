"""The checks of `checks.py` as tests, instantiated by each checkpoint's module with its own fixture."""

from __future__ import annotations

import json
from pathlib import Path

from tests.flows.plain_torch import plain_torch_losses
from tests.real import checks


def check_logits(store: Path) -> None:
    """The baseline eval's own parity check: the base model's logits on 4 eval rows, JAX against PyTorch."""
    parity = _metrics(store / "baseline_eval")["parity"]
    assert parity["dtype"] == "float32" and parity["tokens"] >= 40
    diff, scale = parity["max_abs_diff"], parity["max_abs_logit"]
    assert diff <= checks.LOGITS_RTOL * scale, f"max |diff| {diff:.2e} at logits up to {scale:.1f}"
    assert parity["top1_agreement"] == 1.0


def check_loss_and_gradients(model, tokenizer) -> None:
    loss_diff, together, worst, worst_diff = checks.loss_and_gradient_errors(model, tokenizer)
    assert loss_diff <= checks.LOSS_RTOL, loss_diff
    assert together <= checks.GRADIENT_RTOL, together
    assert worst_diff <= checks.WORST_GRADIENT_RTOL, (worst, worst_diff)


def check_greedy(model, tokenizer) -> None:
    pairs = checks.greedy_pairs(model, tokenizer)
    for got, expected in pairs:
        assert len(got) == checks.GREEDY_TOKENS and got == expected, (tokenizer.decode(got), tokenizer.decode(expected))


def check_three_steps_export(checkpoint: checks.Checkpoint, result: dict) -> None:
    export, store = Path(result["path"]), checkpoint.store
    assert _only(store / "import_gguf") == checkpoint.folder.name  # the module's own import, reused by the flow
    info = json.loads((export / "export.json").read_text())
    assert info["base_model"] == str(checkpoint.folder)  # the adapter names the imported HF folder as its base
    train = store / "train" / json.loads((export / "manifest.json").read_text())["inputs"]["train"]
    records = [json.loads(line) for line in (train / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    final = _metrics(store / "final_eval")["loss"]
    baseline = _metrics(store / "baseline_eval")["loss"]
    (plain,) = plain_torch_losses([{"base": checkpoint.folder, "adapter": export / "adapter",
                                    "eval_arrow": store / "tokenize" / _only(store / "tokenize") / "eval.arrow"}])
    assert abs(plain - final) <= checks.EXPORT_LOSS_RTOL * final, (plain, final)
    # The 1% check tells a trained adapter from an untrained one only if training moved the loss by more.
    assert baseline - final > 2 * checks.EXPORT_LOSS_RTOL * final, (baseline, final)


def _metrics(stage_folder: Path) -> dict:
    return json.loads((stage_folder / _only(stage_folder) / "metrics.json").read_text())


def _only(folder: Path) -> str:
    (key,) = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
    return key
