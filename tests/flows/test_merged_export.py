"""`export.merge`: the LoRA (and modules_to_save) folded into the base weights as a plain HF model,
checked in a fresh plain-PyTorch process against the base model with the exported adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.plain_torch import EXPORT_RTOL
from tests.flows.toy import run_toy, states, toy_config
from tests.plain_process import run_plain

pytestmark = pytest.mark.slow

# Merged and base + adapter compute the same function in float32, up to the rounding of W + s * B @ A:
# measured 3.4e-7 (untied) and 3.2e-7 (tied embeddings) of the largest logit (about 0.5 on the toy model).
# The base alone differs from the merged model by 1.3x to 1.6x that logit, so a merge that lost the
# adapter's effect fails by five orders of magnitude.
MERGE_RTOL = 1e-5

SCRIPT = """
import json, sys, torch, pyarrow as pa
from pathlib import Path
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

folder, eval_arrow, rows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
base_dir = json.loads((folder / "export.json").read_text())["base_model"]

def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

def tensors(path):
    with safe_open(path, "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}

table = pa.ipc.open_file(eval_arrow).read_all().to_pydict()
ids = table["input_ids"][:rows]
def logits(model):
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([row])).logits[0] for row in ids])  # (tokens, vocab)

merged = load(folder / "merged")
nll = count = 0.0  # the final eval's loss, token-weighted over every eval row
with torch.no_grad():
    for row, labels in zip(table["input_ids"], table["labels"]):
        target = torch.tensor(labels[1:])
        keep = target != -100
        nll += torch.nn.functional.cross_entropy(merged(input_ids=torch.tensor([row])).logits[0, :-1][keep], target[keep],
                                                 reduction="sum").item()
        count += keep.sum().item()
with_adapter = PeftModel.from_pretrained(load(base_dir), folder / "adapter").eval()
merged_logits, adapter_logits, base_logits = logits(merged), logits(with_adapter), logits(load(base_dir))
merged_tensors = {}
for path in sorted((folder / "merged").glob("*.safetensors")):
    merged_tensors.update(tensors(path))
base_tensors = {}
for path in sorted(Path(base_dir).glob("*.safetensors")):
    base_tensors.update(tensors(path))
# Tensors the adapter holds in full (modules_to_save), under the base model's names.
adapter_tensors = tensors(folder / "adapter" / "adapter_model.safetensors")
saved = {name.removeprefix("base_model.model."): t for name, t in adapter_tensors.items() if "lora_" not in name}
assert "torchax" not in sys.modules and "jax" not in sys.modules, "plain PyTorch only"
print(json.dumps({
    "tokens": merged_logits.shape[0],
    "magnitude": adapter_logits.abs().max().item(),
    "merged_vs_adapter": (merged_logits - adapter_logits).abs().max().item(),
    "merged_vs_base": (merged_logits - base_logits).abs().max().item(),
    "merged_names": sorted(merged_tensors),
    "base_names": sorted(base_tensors),
    "saved_vs_merged": {n: (t - merged_tensors[n]).abs().max().item() for n, t in saved.items()},
    "saved_vs_base": {n: (t - base_tensors.get(n, base_tensors["model.embed_tokens.weight"])).abs().max().item()
                      for n, t in saved.items()},
    "merged_tied": merged.config.tie_word_embeddings,
    "merged_loss": nll / count,
}))
"""


def merge_check(export_folder: Path, store: Path, rows: int = 4) -> dict:
    """Compare `export_folder`'s merged/ with base + adapter/ on `rows` eval rows, in plain PyTorch."""
    eval_arrow = next(store.glob("tokenize/*/eval.arrow"))
    return json.loads(
        run_plain(SCRIPT, str(export_folder), str(eval_arrow), str(rows), timeout=600).strip().splitlines()[-1]
    )


def assert_merged_is_base_plus_adapter(check: dict) -> None:
    rel = check["merged_vs_adapter"] / check["magnitude"]
    base_rel = check["merged_vs_base"] / check["magnitude"]
    print(
        f"merged vs base + adapter: {check['merged_vs_adapter']:.2e} on logits up to {check['magnitude']:.3f} "
        f"({rel:.1e} relative, {check['tokens']} tokens); base alone: {base_rel:.2f} relative"
    )
    assert check["tokens"] > 50
    assert rel <= MERGE_RTOL, f"merged differs from base + adapter by {rel:.2e} of the largest logit"
    assert base_rel >= 1e3 * MERGE_RTOL, f"the base alone is within {base_rel:.2e}: the check could not tell"
    adapter_parts = ("lora_", "base_model.", "modules_to_save", "original_module")
    adapterish = [n for n in check["merged_names"] if any(part in n for part in adapter_parts)]
    assert not adapterish, adapterish
    # The toy trains embed_tokens and lm_head in full: the merged model holds exactly the trained copies.
    assert set(check["saved_vs_merged"]) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(d == 0.0 for d in check["saved_vs_merged"].values()), check["saved_vs_merged"]
    assert all(d > 1e-3 for d in check["saved_vs_base"].values()), "training left a module_to_save unchanged"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def merged_export(store) -> Path:
    return Path(run_toy(store, "export.merge=true", until="export")["path"])


def test_merged_model_gives_the_logits_of_base_plus_adapter(store, merged_export):
    from jaxtune.flows.finetune import planned_keys

    assert json.loads((merged_export / "export.json").read_text())["merged"] == "merged"
    assert (merged_export / "merged" / "tokenizer.json").is_file()
    check = merge_check(merged_export, store)
    assert_merged_is_base_plus_adapter(check)
    # An export that lost the LoRA tensors merges and adapts alike, to the base: only the trained model's own loss tells.
    final_eval = store / "final_eval" / planned_keys(toy_config(store, "export.merge=true"))["final_eval"]
    assert check["merged_loss"] == pytest.approx(
        json.loads((final_eval / "metrics.json").read_text())["loss"], rel=EXPORT_RTOL
    )
    assert check["merged_names"] == check["base_names"]
    assert check["merged_tied"] is False


def test_merging_unties_embeddings_that_modules_to_save_trained_apart(tmp_path):
    """A tied base whose embed_tokens and lm_head are trained as two modules_to_save: the merged
    model must keep both trained matrices, not re-tie lm_head to the embedding on load."""
    store = tmp_path / "store"
    result = run_toy(store, "model.tiny.tie_word_embeddings=true", "export.merge=true", until="export")
    export_folder = Path(result["path"])
    check = merge_check(export_folder, store)
    assert_merged_is_base_plus_adapter(check)
    assert "lm_head.weight" not in check["base_names"], "the toy base is not tied"
    assert check["merged_names"] == sorted([*check["base_names"], "lm_head.weight"])
    assert check["merged_tied"] is False


def test_without_merge_no_merged_folder(store, merged_export):
    result = run_toy(store, until="export")
    assert {s for s, state in states(result).items() if state != "Cached"} == {"export"}
    folder = Path(result["path"])
    assert folder != merged_export and (folder / "adapter").is_dir()
    assert not (folder / "merged").exists() and "merged" not in json.loads((folder / "export.json").read_text())


def test_export_dtype_bfloat16_writes_bf16_tensors(store, merged_export):
    """`export.dtype=bfloat16`: every tensor of adapter/ and merged/ is bf16, the float32 export's value
    rounded once (the merge is taken in float32, then cast)."""
    import torch
    from safetensors import safe_open

    result = run_toy(store, "export.merge=true", "export.dtype=bfloat16", until="export")
    assert {s for s, state in states(result).items() if state != "Cached"} == {"export"}
    half_export = Path(result["path"])
    for part in ("adapter", "merged"):
        files = sorted(p.name for p in (half_export / part).glob("*.safetensors"))
        assert files and files == sorted(p.name for p in (merged_export / part).glob("*.safetensors"))
        for file in files:
            with (
                safe_open(half_export / part / file, "pt") as half,
                safe_open(merged_export / part / file, "pt") as full,
            ):
                assert sorted(half.keys()) == sorted(full.keys())
                for name in half.keys():
                    tensor, reference = half.get_tensor(name), full.get_tensor(name)
                    assert (tensor.dtype, reference.dtype) == (torch.bfloat16, torch.float32), f"{part}/{file}: {name}"
                    assert torch.equal(tensor, reference.to(torch.bfloat16)), f"{part}/{file}: {name}"
