"""quantized_base_int8 and quantized_base_int4: the LoRA train step's real tokens/s over a base
held as int8 or int4 blocks (`model.base_quantization`), against the same step over the float
base, on the same packed micro-batches, in alternating rounds.

On this CPU the ratio is below 1: XLA:CPU dequantizes each layer's codes before its matmul, and
the matmuls themselves are the same float32 ones, so dequantizing is added work with nothing
saved; the base is small enough that its bytes do not bound the step. On an accelerator whose
step reads the base from HBM at every layer (a large model at a small batch), reading a quarter
of the bytes is what a quantized base saves, and XLA fuses the dequantizing into the matmul's
operand read.
"""

from __future__ import annotations

from benchmarks.common.harness import Context, entry, free_memory, log, rounds, skipped
from benchmarks.common.train_step import JaxtuneTrainer, micro_batch
from benchmarks.cpu.models import SKIP_SMOLLM2, jaxtune_model, model_label, pad_id_of, recipe_lora
from benchmarks.cpu.training import packed_epoch, training_rows


def bench_quantized_base(ctx: Context) -> dict:
    """Real tokens/s of one pass over the training rows, packed: LoRA r=8 q/k/v/o over an int8 and an int4 base vs the float32 base."""
    keys = ("quantized_base_int8", "quantized_base_int4")
    folder, ids, labels = training_rows(ctx)
    if folder is None:
        return dict.fromkeys(keys, skipped(SKIP_SMOLLM2))
    import jax

    from jaxtune.runtime.modeling.quantize import quantize_base

    shape, packed = packed_epoch(ids, labels, pad_id_of(folder))
    feed = [micro_batch(b) for b in packed]
    real = sum(len(r) for r in ids)
    passes = {}
    for scheme in ("none", "int8", "int4"):
        model = jaxtune_model(
            folder,
            "float32",
            recipe_lora(),
            before_jax=None if scheme == "none" else lambda module, scheme=scheme: quantize_base(module, scheme),
        )
        trainer = JaxtuneTrainer(model)
        jax.block_until_ready(trainer.step(*feed[0]))  # compiles
        log(f"{scheme}: compiled")

        def one_pass(trainer=trainer):
            loss = None
            for batch, labels_ in feed:
                loss = trainer.step(batch, labels_)
            jax.block_until_ready(loss)

        passes[scheme] = one_pass
    times = rounds(passes, ctx.reps, "quantized-base training pass")
    passes.clear()
    free_memory()
    import statistics

    tps = {scheme: real / statistics.median(t) for scheme, t in times.items()}
    common = {
        "model": model_label(ctx),
        "real_tokens": real,
        "packed_shape": [shape.sequences, shape.length],
        "note": "float32 compute; the base's linear layers held as int8/int4 blocks of 64, dequantized in each layer",
    }
    return {
        f"quantized_base_{scheme}": entry(
            tps[scheme] / tps["none"],
            tps[scheme],
            tps["none"],
            "real tokens/s",
            f"jaxtune, {scheme} base",
            "jaxtune, float32 base",
            "higher: the quantized base faster",
            pass_times=times,
            **common,
        )
        for scheme in ("int8", "int4")
    }
