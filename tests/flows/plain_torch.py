"""Eval loss of exported models computed in a process that imports neither jaxtune, torchax nor JAX
(`tests.plain_process`)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.plain_process import run_plain

# Exports are checked against the pipeline's own eval loss at 1e-4 relative (float32; 2e-6
# measured). An export that lost its trained tensors would score the baseline loss instead, so
# the check tells the two apart only if training moved the loss by far more than that: the flow
# tests require a drop of 10x the tolerance (measured: 3.5% in 4 toy steps, 0.85% or more in the
# 8 steps of each family's run).
EXPORT_RTOL = 1e-4
TRAINED_MARGIN = 10 * EXPORT_RTOL

SCRIPT = """
import json, sys, torch, pyarrow as pa
from peft import PeftModel
from transformers import AutoModelForCausalLM

def eval_loss(model, eval_arrow):
    table = pa.ipc.open_file(eval_arrow).read_all().to_pydict()
    nll = count = 0.0
    with torch.no_grad():
        for ids, labels in zip(table["input_ids"], table["labels"]):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            keep = target != -100
            nll += torch.nn.functional.cross_entropy(logits[keep].float(), target[keep], reduction="sum").item()
            count += keep.sum().item()
    return nll / count

losses = []
for case in json.loads(sys.argv[1]):
    if case["adapter"]:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(case["base"]), case["adapter"])
    else:
        model = AutoModelForCausalLM.from_pretrained(case["base"])
    losses.append(eval_loss(model.eval(), case["eval_arrow"]))
assert "torchax" not in sys.modules and "jax" not in sys.modules, "plain PyTorch only"
print(json.dumps(losses))
"""


def plain_torch_losses(cases: list[dict]) -> list[float]:
    """cases: {"base": model dir, "adapter": PEFT adapter dir or None, "eval_arrow": path}."""
    cases = [{k: str(v) if isinstance(v, Path) else v for k, v in case.items()} for case in cases]
    return json.loads(run_plain(SCRIPT, json.dumps(cases)).strip().splitlines()[-1])
