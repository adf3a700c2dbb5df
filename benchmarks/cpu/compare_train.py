"""The training comparisons: train_vs_torch_fp32 (with nonpad_fraction), train_vs_torch_fp32_same_shape,
train_vs_recipe, and mfu (which reuses train_vs_torch_fp32's jaxtune measurement)."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

from benchmarks.common.harness import (
    Context,
    entry,
    fastest,
    free_memory,
    log,
    machine_info,
    matmul_run,
    rounds,
    say,
    skipped,
    torch_thread_counts,
    torch_threads,
)
from benchmarks.common.train_step import JaxtuneTrainer, TorchTrainer, api_state, micro_batch, with_segments
from benchmarks.cpu.models import (
    IGNORE_INDEX,
    SKIP_SMOLLM2,
    dolly_rows,
    jaxtune_model,
    model_label,
    pad_id_of,
    real_model_folder,
    recipe_lora,
    right_pad,
    torch_batch,
    torch_lora_model,
    vocab_of,
)
from benchmarks.cpu.training import PackedJaxtune, PaddedTorch, jaxtune_packed_training, matmul_n, training_rows


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
    round_ratios = [
        t / j for t, j in zip(times[setting], result["pass_times"])
    ]  # same rows: time ratio = throughput ratio
    common = {"model": model_label(ctx), "rows": result["rows"], "real_tokens": result["real_tokens"], "batch_size": 8}
    torch_lengths, torch_nonpad = theirs.lengths, theirs.nonpad
    del ours, theirs
    free_memory()
    return {
        "train_vs_torch_fp32": entry(
            result["tokens_per_second"] / torch_tps,
            result["tokens_per_second"],
            torch_tps,
            "real tokens/s",
            "jaxtune, packed",
            f"PyTorch eager SDPA, padded per batch, {setting[9:]}",
            "higher: jaxtune faster",
            **common,
            jaxtune_detail=result,
            torch_pass_times=times,
            round_ratios=round_ratios,
            torch_padded_lengths=torch_lengths,
            note="passes over all rows in alternating rounds (PyTorch on each thread count, then "
            "jaxtune); PyTorch's figure is its faster thread count",
        ),
        "nonpad_fraction": entry(
            result["nonpad_fraction"],
            result["nonpad_fraction"],
            torch_nonpad,
            "share of slots",
            "jaxtune packed",
            "padded per batch (PyTorch, for reference)",
            "higher: less padding",
            **common,
            packed_shape=result["packed_shape"],
        ),
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
    return {
        key: entry(
            torch_s / jax_s,
            jax_s,
            torch_s,
            "s/step",
            "jaxtune",
            f"PyTorch eager SDPA, {setting[9:]}",
            "higher: jaxtune faster",
            model=model_label(ctx),
            shape=[4, 128],
            real_tokens=real,
            jaxtune_times=jax_times,
            torch_times=times,
            round_ratios=round_ratios,
            jaxtune_compile_seconds=compile_s,
            api=api,
            note="steps in alternating rounds; PyTorch's figure is its faster thread count",
        )
    }


def recipe_step(model) -> Callable:
    """torchax's own `make_train_step`, un-jitted, as the published recipe uses it: plain optax AdamW
    with clipping, HF forward with input_ids and attention_mask, shifted cross-entropy."""
    import optax
    import torch
    import torchax.train
    from torchax import interop

    module = model.module

    def forward(weights, buffers, batch):
        return torch.func.functional_call(
            module,
            (weights, buffers),
            args=(),
            kwargs={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False},
        ).logits

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
        )

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
        note = (
            f"the un-jitted recipe's warm-up step on {model_label(ctx)} took over {RECIPE_WARMUP_LIMIT_S} s: "
            "both sides measured on the demo model instead"
        )
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
    feed = [
        ({k: jnp.asarray(b[k]) for k in ("input_ids", "attention_mask")}, jnp.asarray(b["labels"])) for b in batches
    ]
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
    return entry(
        ours["tokens_per_second"] / theirs,
        ours["tokens_per_second"],
        theirs,
        "real tokens/s",
        "jaxtune, packed",
        "torchax make_train_step un-jitted, rows padded to 512",
        "higher: jaxtune faster",
        model=model_label(ctx),
        recipe_seconds_per_step=per_step,
        recipe_step_times=times,
        recipe_warmup_seconds=times[0],
        recipe_steps_per_pass=len(batches),
        real_tokens=ours["real_tokens"],
        note=f"recipe: {ctx.recipe_steps} steps timed after 1 warm-up; its tokens/s = real tokens of all rows / "
        "(steps to cover them x median step time): every recipe step is (8, 512) whatever its rows",
    )


def bench_mfu(ctx: Context) -> dict:
    """Model FLOPs utilisation of jaxtune's SmolLM2 train step: against the spec-sheet peak and a measured matmul peak."""
    machine = machine_info()
    mhz = machine["cpu_mhz"]
    cores = machine["cores"]
    flags = set(machine["flags"])
    # Zen 4 (AMD family 25, models 0x10-0x1f and 0x60-0x7f; this EPYC is family 25 model 17, Genoa): two 256-bit FMA
    # pipes; AVX-512 instructions run as two 256-bit halves, so the fp32 rate is that of 2 x 256-bit FMA units.
    fma_units, simd_fp32 = 2, 8
    assumption = (
        "2 FMA pipes x 8 fp32 lanes (256-bit datapaths; Zen 4 splits each AVX-512 op into two 256-bit halves, "
        "so AVX-512 doubles no throughput) x 2 FLOPs per FMA = 32 FLOPs/cycle/core"
    )
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
    lines = [
        f"peak: {cores} cores x {mhz:.0f} MHz (/proc/cpuinfo 'cpu MHz') x {per_cycle} FLOPs/cycle/core = {peak / 1e9:.1f} GFLOP/s",
        f"  assumption: {assumption}",
        f"measured peak: float32 jnp.dot {n}^3 = {2 * n**3 / 1e9:.1f} GFLOP in {dot_s:.3f} s (median of {len(dot_times)}, "
        f"timed in the rounds of jaxtune's training passes) = "
        f"{measured / 1e9:.1f} GFLOP/s ({measured / peak:.0%} of peak)",
    ]
    derivation = {
        "cores": cores,
        "cpu_mhz": mhz,
        "flops_per_cycle_per_core": per_cycle,
        "assumption": assumption,
        "peak_flops": peak,
        "matmul_n": n,
        "matmul_seconds": dot_s,
        "matmul_times": dot_times,
        "measured_peak_flops": measured,
    }
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
    derivation.update(
        {"model_flops": f, "tokens_per_second": ours["tokens_per_second"], "achieved_flops": achieved, "lines": lines}
    )
    return {
        "mfu": entry(
            achieved / peak,
            achieved / 1e9,
            peak / 1e9,
            "GFLOP/s",
            "jaxtune train step (model FLOPs)",
            "spec peak",
            "higher: better utilisation",
            mfu_derivation=derivation,
        ),
        "mfu_vs_measured_peak": entry(
            achieved / measured,
            achieved / 1e9,
            measured / 1e9,
            "GFLOP/s",
            "jaxtune train step (model FLOPs)",
            "measured jnp.dot peak",
            "higher: better utilisation",
        ),
    }
