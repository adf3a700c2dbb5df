"""The decode comparisons: decode_vs_torch (batch 1 and 8, against model.generate) and decode_vs_recipe
(per token, against torchax eager with a static cache)."""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common.generate import torch_generate
from benchmarks.common.harness import (
    Context,
    entry,
    fastest,
    free_memory,
    log,
    rounds,
    skipped,
    torch_thread_counts,
    torch_threads,
)
from benchmarks.cpu.models import SKIP_SMOLLM2, model_label, pad_id_of, real_model_folder, vocab_of

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


def chat_prompts(folder: str, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer_config.json").exists():  # the demo model (--model demo) has none: random prompts
        rng = np.random.default_rng(2)
        return [rng.integers(3, vocab_of(folder), size=10 + 3 * i).tolist() for i in range(len(texts))]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]


def bench_decode_vs_torch(ctx: Context) -> dict:
    """Greedy new tokens/s at batch 1 and batch 8: jaxtune's compiled decoders vs model.generate on the same module."""
    folder = real_model_folder(ctx)
    if folder is None:
        return {k: skipped(SKIP_SMOLLM2) for k in ("decode_vs_torch_b1", "decode_vs_torch_b8", "decode_vs_torch")}
    import jax

    from jaxtune.config import MeshConfig
    from jaxtune.runtime.decoding import decode
    from jaxtune.runtime.decoding.stream import StreamDecoder
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import load_torch_model, to_jax

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
    jax.block_until_ready(generate(model, model.weights, model.buffers, ids, mask))  # compiles
    b8_compile = time.perf_counter() - start
    got = {}

    def ours(case: str) -> None:
        if case == "b1":
            got[("jaxtune", case)] = [list(decoder.stream(prompts[0], n))]
        else:
            got[("jaxtune", case)] = np.asarray(
                jax.block_until_ready(generate(model, model.weights, model.buffers, ids, mask))
            ).tolist()

    def theirs(case: str, threads: int) -> None:
        torch_module.set_attn_implementation(attention_of[case])
        with torch_threads(threads):
            got[(threads, case)] = torch_generate(torch_module, cases[case], n, pad)

    out = {}
    for case, rows in (("b1", 1), ("b8", 8)):
        runs = {
            f"PyTorch, {t} thread{'s' * (t > 1)}": functools.partial(theirs, case, t) for t in torch_thread_counts()
        }
        runs["jaxtune"] = functools.partial(ours, case)
        times = rounds(runs, ctx.reps, f"decode {case}")
        ours_times = times.pop("jaxtune")
        ours_s = statistics.median(ours_times)
        setting, theirs_s = fastest(times)
        threads = int(setting.split(", ")[1].split()[0])
        ours_tokens, their_tokens = got[("jaxtune", case)], got[(threads, case)]
        ours_tps, theirs_tps = rows * n / ours_s, rows * n / theirs_s
        out[f"decode_vs_torch_{case}"] = entry(
            ours_tps / theirs_tps,
            ours_tps,
            theirs_tps,
            "new tokens/s",
            "StreamDecoder" if case == "b1" else "make_generate, left-padded",
            f"model.generate(do_sample=False), {attention_of[case]} attention, {setting[9:]}",
            "higher: jaxtune faster",
            model=model_label(ctx),
            batch=rows,
            new_tokens=n,
            prompt_lengths=[len(p) for p in cases[case]],
            same_tokens=their_tokens == ours_tokens,
            rows_with_same_tokens=sum(x == y for x, y in zip(their_tokens, ours_tokens)),
            same_tokens_every_thread_count=all(got[(t, case)] == ours_tokens for t in torch_thread_counts()),
            torch_attention_probe_seconds={k: v for k, v in probes.items() if k.startswith(case)},
            torch_times=times,
            jaxtune_times=ours_times,
            round_ratios=[t / o for t, o in zip(times[setting], ours_times)],
            jaxtune_compile_seconds=decoder.last.compile_seconds if case == "b1" else b8_compile,
            note="runs in alternating rounds (PyTorch on each thread count, then jaxtune); PyTorch's figure is its "
            "faster setting",
        )
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
    from jaxtune.runtime.decoding.decode import _cache_argument
    from jaxtune.runtime.decoding.stream import StreamDecoder
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import load_torch_model, to_jax

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
        out = recipe(
            input_ids=torch.tensor([prompt], device="jax"),
            use_cache=True,
            cache_position=torch.arange(p, device="jax"),
            **{argument: cache},
        )
        token = out.logits[0, -1].argmax().item()
        recipe_tokens.append(token)
        for i in range(warm + n):
            start = time.perf_counter()
            out = recipe(
                input_ids=torch.tensor([[token]], device="jax"),
                use_cache=True,
                cache_position=torch.tensor([p + i], device="jax"),
                **{argument: cache},
            )
            token = out.logits[0, -1].argmax().item()
            times.append(time.perf_counter() - start)
            recipe_tokens.append(token)
            log(f"recipe token {i}: {times[-1]:.2f} s{' (warm-up)' if i < warm else ''}")
    del recipe, cache, out
    recipe_s = statistics.median(times[warm:])
    intervals += [
        statistics.median(stream_token_intervals(decoder, prompt, ctx.decode_tokens)) for _ in range(ctx.reps)
    ]
    ours_s = statistics.median(intervals)
    same = ours_tokens[: len(recipe_tokens)] == recipe_tokens
    del decoder, module
    free_memory()
    return {
        key: entry(
            recipe_s / ours_s,
            1 / ours_s,
            1 / recipe_s,
            "tokens/s (per-token step)",
            "StreamDecoder one-token step",
            f"torchax eager, static KV cache, .item() per token ({attention} attention)",
            "higher: jaxtune faster",
            model=model_label(ctx),
            batch=1,
            recipe_token_times=times,
            recipe_warmup_tokens=warm,
            jaxtune_median_intervals=intervals,
            same_tokens=same,
            note=f"both per-token: median time between consecutive tokens, prefill excluded; jaxtune's from "
            f"{ctx.reps} answers just before and {ctx.reps} just after the recipe's {n} tokens",
        )
    }
