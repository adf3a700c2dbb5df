"""Shared measurement: jaxtune training on the Dolly-like rows (packed), and PyTorch on the same
rows. train_vs_torch_fp32, train_vs_recipe, nonpad_fraction and mfu share these sides."""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from benchmarks.common.harness import Context, free_memory, log, matmul_run, rounds, torch_threads
from benchmarks.common.train_step import JaxtuneTrainer, TorchTrainer, api_state, micro_batch
from benchmarks.cpu.models import (
    dolly_rows,
    jaxtune_model,
    pad_id_of,
    real_model_folder,
    recipe_lora,
    right_pad,
    torch_batch,
    torch_lora_model,
    vocab_of,
)


def training_rows(ctx: Context):
    """The rows train_vs_torch_fp32, train_vs_recipe, nonpad_fraction and mfu share."""
    folder = real_model_folder(ctx)
    ids, labels = dolly_rows(ctx.train_rows, vocab_of(folder), seed=0)
    return folder, ids, labels


def packed_epoch(ids, labels, pad_id: int, batch_size: int = 8, max_length: int = 512):
    """jaxtune's packed micro-batches covering every row exactly once (the first epoch)."""
    from jaxtune.runtime.train import packing

    lengths = [len(r) for r in ids]
    shape = packing.packed_shape(lengths, batch_size, max_length)
    count = packing.micro_batches_per_epoch(lengths, shape, seed=0)
    plan = packing.packed_micro_batches(lengths, shape, seed=0)
    batches = [packing.pack(ids, labels, next(plan), pad_id, shape) for _ in range(count)]
    return shape, batches


def matmul_n(ctx: Context) -> int:
    return 2048 if ctx.quick else 4096


class PackedJaxtune:
    """jaxtune's side of the training comparisons: the training rows packed as its loop packs them,
    LoRA r=8 q/k/v/o, float32, compiled on construction. `one_pass` trains once over every row."""

    def __init__(self, ctx: Context):
        import jax

        from jaxtune.runtime.train import packing

        folder, ids, labels = training_rows(ctx)
        self.shape, packed = packed_epoch(ids, labels, pad_id_of(folder))
        self.rows, self.real = len(ids), sum(len(r) for r in ids)
        self.nonpad = float(np.mean([packing.nonpad_fraction(b) for b in packed]))
        log(
            f"jaxtune: {len(ids)} rows packed into {len(packed)} micro-batches of {self.shape.sequences} x {self.shape.length}"
        )
        self.model = jaxtune_model(folder, "float32", recipe_lora())
        self.trainer = JaxtuneTrainer(self.model)
        self.feed = [micro_batch(b) for b in packed]
        self.api = api_state(self.trainer.step_fn)
        self.flops = model_flops(self.model, ids)
        log(f"jaxtune API: {self.api}")
        start = time.perf_counter()
        jax.block_until_ready(self.trainer.step(*self.feed[0]))  # compiles (one shape: every micro-batch is S x L)
        self.compile_seconds = time.perf_counter() - start
        log(f"jaxtune: first step (compile + run) {self.compile_seconds:.1f} s")
        self.loss = None

    def one_pass(self) -> None:
        import jax

        loss = None
        for batch, labels in self.feed:
            loss = self.trainer.step(batch, labels)
        self.loss = float(jax.block_until_ready(loss))

    def summary(self, times: list[float]) -> dict:
        seconds = statistics.median(times)
        return {
            "tokens_per_second": self.real / seconds,
            "seconds_per_pass": seconds,
            "pass_times": times,
            "real_tokens": self.real,
            "rows": self.rows,
            "micro_batches": len(self.feed),
            "packed_shape": [self.shape.sequences, self.shape.length],
            "nonpad_fraction": self.nonpad,
            "compile_seconds": self.compile_seconds,
            "final_loss": self.loss,
            "api": self.api,
            "trainable_parameters": int(sum(np.prod(w.shape) for w in self.model.weights.values())),
            "flops": self.flops,
        }


class PaddedTorch:
    """PyTorch's side: eager, SDPA, AdamW, clip 1.0, PEFT LoRA r=8 q/k/v/o, float32, the training rows in
    batches of 8 each padded to its longest row (DataCollatorWithPadding). Warmed up on construction."""

    def __init__(self, ctx: Context):
        folder, ids, labels = training_rows(ctx)
        batches = [right_pad(ids[i : i + 8], labels[i : i + 8], pad_id_of(folder)) for i in range(0, len(ids), 8)]
        self.real = sum(len(r) for r in ids)
        self.lengths = [int(b["input_ids"].shape[1]) for b in batches]
        self.nonpad = self.real / sum(b["input_ids"].size for b in batches)
        self.trainer = TorchTrainer(torch_lora_model(folder, recipe_lora()))
        self.feed = [torch_batch(b) for b in batches]
        log(f"PyTorch: {len(batches)} batches padded to {self.lengths}; warm-up step")
        self.trainer.step(self.feed[0])

    def one_pass(self, threads: int) -> None:
        with torch_threads(threads):
            for batch in self.feed:
                self.trainer.step(batch)


def jaxtune_packed_training(ctx: Context) -> dict:
    """jaxtune over the training rows, packed: real tokens/s, median of passes. Measured alongside PyTorch by
    train_vs_torch_fp32 when that runs first; alone otherwise (--only)."""
    if "jaxtune_packed" not in ctx.memo:
        side = PackedJaxtune(ctx)
        times = rounds({"jaxtune": side.one_pass, "matmul": matmul_run(matmul_n(ctx))}, ctx.reps, "jaxtune training")
        ctx.memo["jaxtune_packed"] = {**side.summary(times["jaxtune"]), "matmul_times": times["matmul"]}
        del side
        free_memory()
    return ctx.memo["jaxtune_packed"]


def model_flops(model, ids) -> dict:
    """Training FLOPs over `ids` (real tokens only) for a JaxModel, from its module's shapes."""
    import torch

    module = model.module
    n_matmul = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    n_trainable = int(sum(np.prod(w.shape) for w in model.weights.values()))
    cfg = model.config
    heads, head_dim = (
        cfg.num_attention_heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    d_attn, layers = heads * head_dim, cfg.num_hidden_layers
    tokens = sum(len(r) for r in ids)
    squares = sum(len(r) ** 2 for r in ids)
    dense = tokens * (2 * n_matmul + 2 * n_matmul + 2 * n_trainable)
    attention = 3 * (2 * 2 * layers * d_attn) * squares  # forward 4·layers·t·d_attn per token, backward twice that
    out = {
        "n_matmul": int(n_matmul),
        "n_trainable": n_trainable,
        "layers": layers,
        "d_attn": d_attn,
        "real_tokens": tokens,
        "sum_row_length_squared": int(squares),
        "dense_flops": int(dense),
        "attention_flops": int(attention),
        "total_flops": int(dense + attention),
        "flops_per_token": (dense + attention) / tokens,
    }
    with contextlib.suppress(ImportError, AttributeError):  # cross-check against jaxtune's own count, where it has one
        from jaxtune.runtime.measures import flops

        theirs = flops.train_flops_per_token(model, squares / tokens)  # context: the token-weighted mean row length
        out["jaxtune_flops_module_per_token"] = float(theirs["total"])
    return out
