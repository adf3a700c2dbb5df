"""What every real checkpoint must pass, written once for the SmolLM2 and Gemma 3 test modules.

Parity is measured on the imported float32 weights with LoRA on every linear layer, B drawn
small and random (at PEFT's B = 0 no A gets a gradient), on two chat-formatted prompts, the
second right-padded, so masks and the template's special tokens are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Logits: JAX and PyTorch add the same float32 products in different orders (XLA's CPU dot
# against oneDNN's), so each dot product rounds differently, and 30 layers compound that.
# Measured on these prompts: 1.2e-4 on SmolLM2's logits up to 37.5, 2.1e-4 on Gemma 3's up to
# 89.6: 3e-6 of the logits' scale, where every layer's output is within about 1e-7 of its scale
# of a float64 reference on both backends. The bound, 5e-5 of the scale, leaves 15x headroom
# yet fails on any wrong op: a dropped rope, a missing norm offset or embedding scale moves
# logits by a sizeable fraction of their scale.
LOGITS_RTOL = 5e-5
LOSS_RTOL = 1e-3
# Gradients: all LoRA gradients as one vector within 1e-3 relative (measured 2.2e-5 on SmolLM2,
# 3.0e-4 on Gemma 3), and no single tensor beyond 3e-3 (measured 8.5e-5 and 1.04e-3). On Gemma 3,
# whose residual stream reaches 1e5 before the final norm, JAX's float32 backward is further from
# a float64 reference than PyTorch's (worst tensor 8.4e-4 against 1.2e-5, a k_proj lora_A of small
# gradient norm), while every layer's forward output agrees with float64 as closely on both (about
# 1e-7 of its scale).
GRADIENT_RTOL = 1e-3
WORST_GRADIENT_RTOL = 3e-3
GREEDY_TOKENS = 16
# The exported adapter's eval loss in plain PyTorch against the final eval's on JAX, both float32:
# measured 3.2e-6 relative on SmolLM2 (2.234900 against 2.234907) and 8.1e-6 on Gemma 3 (4.118072
# against 4.118105), the same rounding of summation order as the logits'. The bound, 1e-4, leaves
# 12x over Gemma 3, where training moved the loss by 10.5% (SmolLM2) and 26% (Gemma 3). An adapter
# exported at 0.9 of its scale (lora_alpha) scores 6.8e-3 away on SmolLM2, which the 1% bound this
# replaces passed; at half its scale, 4.2e-2.
EXPORT_LOSS_RTOL = 1e-4
# The exported GGUF files against the merged float32 model they were written from, read back by
# transformers' GGUF reader (independent of the writer). f16: the file computes what the merged model
# computes with its matrices rounded to f16, up to float32 summation order (the bound of the logits
# above; measured after three LoRA steps: identical logits, on SmolLM2 and on Gemma 3 with its norms'
# +1 taken off again). q8_0 (each weight to 1/127 of its 32-block's largest magnitude) moves logits
# further, so it is checked by the teacher-forced top-1 token over both questions and their greedy
# answers: measured 110 of 113 positions kept on SmolLM2, 69 of 71 on Gemma 3; the bound allows
# about 3x SmolLM2's misses.
GGUF_Q8_0_TOP1 = 0.9
QUESTIONS = ("What is the capital of France?", "Which of these animals is a fish: goat, crow, cod?")


@dataclass(frozen=True)
class Checkpoint:
    gguf: Path
    folder: Path  # the import_gguf artifact: an HF folder
    store: Path
    chat_template: str | None


def import_checkpoint(place, store: Path, chat_template: str | None = None) -> Checkpoint:
    """The checkpoint placed beside `store` and imported into it, or found there: `store` may be
    shared by every module of the session (the import is keyed by the file's bytes, and locked)."""
    from jaxtune.config import ModelConfig
    from jaxtune.tasks.import_gguf import imported
    from jaxtune.tasks.sources import model_ref

    gguf = place(store.parent / "real-models")  # placing is atomic and idempotent
    ref = imported(store, model_ref(ModelConfig(name=str(gguf))))
    return Checkpoint(gguf=gguf, folder=Path(ref.path), store=store, chat_template=chat_template)


def tokenizer_of(checkpoint: Checkpoint):
    from jaxtune.artifacts import ArtifactRef
    from jaxtune.config import ModelConfig
    from jaxtune.tasks.sources import open_tokenizer

    ref = ArtifactRef(stage="import_gguf", key="k", path=str(checkpoint.folder))
    return open_tokenizer(ref, ModelConfig(chat_template=checkpoint.chat_template))


def lora_model(checkpoint: Checkpoint):
    """The float32 model with random-B LoRA on every linear layer, on JAX (`doctor`'s set-up)."""
    from jaxtune.checks.doctor import as_trained
    from jaxtune.config import load_config
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import load_torch_model, to_jax

    config = load_config(None, [f"model.name={checkpoint.folder}", "lora.target_modules=all-linear"])
    module = load_torch_model(str(checkpoint.folder), None, False, "float32")
    return to_jax(as_trained(module, config, randomize_lora=True), make_placement(config.mesh))


def prompts(tokenizer) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]


def parity_batch(tokenizer) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The two prompts right-padded together; labels are the real tokens."""
    rows = prompts(tokenizer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id or 0
    ids = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)
    return {"input_ids": ids, "attention_mask": mask}, np.where(mask == 1, ids, -100).astype(np.int32)


def loss_and_gradient_errors(model, tokenizer) -> tuple[float, float, str, float]:
    """(relative loss difference, relative difference of all LoRA gradients together, the worst
    tensor's name and its relative difference)."""
    from jaxtune.runtime.measures import parity

    batch, labels = parity_batch(tokenizer)
    jax_loss, jax_grads = parity.jax_loss_and_grads(model, batch, labels)
    torch_loss, torch_grads = parity.torch_loss_and_grads(model, batch, labels)
    names = sorted(torch_grads)
    together = parity.relative_diff(
        np.concatenate([jax_grads[n].ravel() for n in names]), np.concatenate([torch_grads[n].ravel() for n in names])
    )
    name, worst = parity.worst_gradient(jax_grads, torch_grads)
    return abs(jax_loss - torch_loss) / abs(torch_loss), together, name, worst


def greedy_pairs(model, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(compiled KV-cache decoder, `generate(do_sample=False)`) tokens for each prompt, no early stop."""
    from jaxtune.runtime.measures import parity

    rows = prompts(tokenizer)
    pad = tokenizer.pad_token_id or 0
    together = parity.jax_greedy(model, rows, GREEDY_TOKENS, pad)
    return [(got, parity.torch_greedy(model.module, row, GREEDY_TOKENS, pad)) for got, row in zip(together, rows)]


def three_lora_steps(checkpoint: Checkpoint, tmp: Path, *overrides: str) -> dict:
    """The pipeline up to export: 3 LoRA steps on 24 of the bundled rows, in the checkpoint's store.
    Returns the flow's result and `keys`, every stage's key in that store."""
    from jaxtune.config import load_config
    from jaxtune.data.rows import OFFLINE_DATA
    from jaxtune.flows.finetune import finetune, planned_keys

    rows = tmp / "rows.jsonl"  # a few rows: tokenizing all 6,000 would take longer than training
    rows.write_text("".join(OFFLINE_DATA.read_text().splitlines(keepends=True)[:24]))
    settings = [
        f"model.name={checkpoint.gguf}",
        "model.dtype=float32",
        f"store.root={checkpoint.store}",
        f"data.source={rows}",
        "data.eval_fraction=0.25",
        "data.max_length=96",
        "lora.r=8",
        "train.max_steps=3",
        "train.batch_size=4",
        "train.warmup_steps=0",
        "train.learning_rate=1e-3",
        "train.log_every=1",
    ]
    if checkpoint.chat_template:
        settings.append(f"model.chat_template={checkpoint.chat_template}")
    config = load_config(None, [*settings, *overrides])
    return {**finetune(config=config, until="export"), "keys": planned_keys(config)}


def check_gguf_export(export: Path) -> None:
    """`export`'s GGUF files against its merged model, on the QUESTIONS with a greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxtune.gguf.reader import parsed_once
    from jaxtune.runtime.measures import parity

    def load(folder, gguf_file=None):
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()

    tokenizer = AutoTokenizer.from_pretrained(export / "merged")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    merged = load(export / "merged")
    rows = [parity.torch_greedy(merged, ids, GREEDY_TOKENS, pad) for ids in prompts(tokenizer)]
    rounded = load(export / "merged")
    for parameter in rounded.parameters():
        if parameter.ndim == 2:
            parameter.data = parameter.data.to(torch.float16).float()
    # transformers' own reader, with each file's header parsed once rather than three times (see import_gguf).
    gguf = export / "gguf"
    [f16_file], [q8_0_file] = gguf.glob("*-f16.gguf"), gguf.glob("*-q8_0.gguf")
    with parsed_once():
        f16, q8_0 = load(gguf, f16_file.name), load(gguf, q8_0_file.name)
        # The file's tokenizer as transformers rebuilds it (Gemma 3's: 27 s without parsed_once, 11 s with).
        reread = AutoTokenizer.from_pretrained(gguf, gguf_file=f16_file.name)
    with torch.no_grad():
        agreed = total = 0
        for ids, answer in zip(prompts(tokenizer), rows):
            tokens = torch.tensor([ids + answer])
            expected, got = rounded(tokens).logits[0], f16(tokens).logits[0]
            scale = expected.abs().max().item()
            diff = (got - expected).abs().max().item()
            print(f"gguf f16: max |logit difference| {diff:.2e} at logits up to {scale:.1f}")
            assert diff <= LOGITS_RTOL * scale, (diff, scale)
            quantized = q8_0(tokens).logits[0].argmax(-1)
            agreed += (quantized == merged(tokens).logits[0].argmax(-1)).sum().item()
            total += len(ids) + len(answer)
    print(f"gguf q8_0: top-1 agreement with the merged model {agreed}/{total}")
    assert agreed >= GGUF_Q8_0_TOP1 * total
    # The file's tokenizer splits the prompts as the trained model's does.
    # (No digits: transformers' reader knows no `smollm` pre-tokenizer and would not split them one by one.)
    assert reread.chat_template == tokenizer.chat_template
    conversation = [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": "The cod, a fish."}]
    for text in (*QUESTIONS, "  spaces,\tand é ü 狐", tokenizer.apply_chat_template(conversation, tokenize=False)):
        assert reread.encode(text) == tokenizer.encode(text), text
