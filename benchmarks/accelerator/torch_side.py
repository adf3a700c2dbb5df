"""PyTorch's side of the accelerator benchmark, one child process per part: what a PyTorch user runs
on the same weights and batches. transformers with SDPA attention, PEFT LoRA with the recipe's
settings, AdamW (fused on CUDA), eager (`torch-eager`, which also times `model.generate`) or under
`torch.compile` (`torch-compile`). Nothing here imports `jaxtune.runtime`: torchax registers JAX as
a torch device, and torch.compile then fails looking for that device's streams."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.accelerator.shared import RECIPES, Results, Settings, measure_cases, process_rss, prompts, train_batch
from benchmarks.common.harness import log


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_info() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "platform": "cuda" if cuda else "cpu",
        "device_kind": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def run_train(settings: Settings, folder: Path, work: Path, compiled: bool) -> None:
    """The LoRA recipe's step on every case, each from the same initial adapters and a fresh optimizer."""
    import torch

    from jaxtune.config import load_config

    part = "torch-compile" if compiled else "torch-eager"
    results = Results(work, part)
    results.add(event="device", **device_info(), compile_backend=settings.compile_backend if compiled else None)
    if not compiled:
        run_generate(settings, folder, results)  # seconds: before the cases, so a cut in them cannot lose it
    cfg = load_config(RECIPES["lora"])
    module = peft_model(folder, cfg.lora, settings.dtype).to(device())
    results.add(event="loaded")
    initial = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    run = torch.compile(module, backend=settings.compile_backend) if compiled else module

    def prepare(case):
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in initial:
                    p.copy_(initial[name])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what an earlier case (or its failure) left cached
        return train_case(settings, cfg.train, run, case), torch_memory

    measure_cases(results, settings, part, prepare)


def peft_model(folder: Path, lora, dtype: str):
    """The base with SDPA attention and PEFT LoRA, built as `jaxtune.runtime.modeling.model.attach_lora` builds it (the
    same seed before the adapters are drawn, so both sides start from the same adapters)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    settings = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(0)
    return get_peft_model(module, settings).train()


def train_case(settings: Settings, train, module, case: tuple[int, int]):
    """step(i) -> loss at i = 0 (every step ends synchronised: the loss is read back after the update)."""
    import torch

    from benchmarks.common.train_step import TorchTrainer

    rows, length = case
    on = device()
    trainer = TorchTrainer(
        module,
        lr=train.learning_rate,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        fused=on.type == "cuda",
    )
    vocab = module.config.vocab_size
    feed = [
        {k: torch.from_numpy(v).long().to(on) for k, v in train_batch(settings, vocab, rows, length, i).items()}
        for i in range(1 + settings.warmups + settings.steps)
    ]
    if on.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step(i: int):
        loss = trainer.step(feed[i])
        return loss if i == 0 else None

    return step


def torch_memory() -> dict:
    import torch

    if torch.cuda.is_available():
        return {
            "peak_bytes": torch.cuda.max_memory_allocated(),
            "memory_source": "torch.cuda.max_memory_allocated (this case)",
        }
    return process_rss()


def run_generate(settings: Settings, folder: Path, results: Results) -> None:
    """`model.generate`, greedy, on the base model (SDPA attention): a first call, then the median of `decode_repeats`."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common.generate import torch_generate

    module = (
        AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, settings.dtype), attn_implementation="sdpa"
        )
        .to(device())
        .eval()
    )
    batch = prompts(settings, module.config.vocab_size).tolist()
    start = time.perf_counter()
    tokens = torch_generate(module, batch, settings.new_tokens, pad=0)
    results.add(event="decode", side="torch", first_call_seconds=time.perf_counter() - start, tokens=tokens)
    times = []
    for _ in range(settings.decode_repeats):
        start = time.perf_counter()
        torch_generate(module, batch, settings.new_tokens, pad=0)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    new = len(batch) * settings.new_tokens
    results.add(event="decode", side="torch", seconds=seconds, times=times, new_tokens_per_second=new / seconds)
    log(f"torch generate: {new / seconds:,.0f} new tokens/s")
    del module
