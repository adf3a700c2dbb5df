"""jaxtune's side of the accelerator benchmark, one child process (`jaxtune`): the recipes' train steps
(LoRA, then full), then greedy decoding, built as the pipeline's stages build them: the recipe's
config, `open_model`, `make_optimizer`, `make_train_step`, `greedy_generate`; then, where asked for,
a GRPO step (grpo.py). Each section gets its share of the process's time (`SECTIONS`); a
case is not started past its section's share."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.accelerator import grpo
from benchmarks.accelerator.jaxtune_model import (
    COMPILING,
    describe_phases,
    load_phases,
    monitor_compiling,
    open_benchmark_model,
    show_runtime_lines,
    ticking,
)
from benchmarks.accelerator.shared import (
    Results,
    Settings,
    case_name,
    jax_memory,
    jaxtune_side,
    measure_cases,
    process_rss,
    prompts,
    train_batch,
)
from benchmarks.common.harness import log

PROFILE_STEPS = 3  # steps profiled after a case's timed ones (--profile)
CPU_MATMUL_N = 1024

# The sections in order, with the seconds each needs on one H200 for the Gemma 3 1B shape's first cases:
# the time left is shared among the sections still to run in these proportions. GRPO's is a guess, not yet
# measured: its two compiles (the sampling program, the update's step) and 13 steps of a few seconds.
SECTIONS = {"lora": 130, "full": 80, "decode": 45, "grpo": 240}


def run(settings: Settings, folder: Path, work: Path, until: float) -> None:
    """Every section by `until` (seconds since the epoch: the
    parent's kill); each line is written as soon as it is known."""
    import os

    from jaxtune.runtime.devices import compile_cache
    from jaxtune.runtime.measures import flops

    results = Results(work, "jaxtune")
    show_runtime_lines()
    monitor_compiling()
    cache = os.environ.get(compile_cache.SHARED_FOLDER_VARIABLE)  # as `jaxtune run` keeps one, when given
    if cache:
        compile_cache.enable(cache)
    results.add(event="device", **device_info(), peak=flops.chip_peak(), compile_cache=cache)
    results.add(event="matmul", **measured_matmul(settings))
    names = [name for name in SECTIONS if name in settings.sections]
    for i, section in enumerate(names):
        left = until - time.time()
        deadline = time.perf_counter() + left * SECTIONS[section] / sum(SECTIONS[n] for n in names[i:])
        if section == "decode":
            run_decode(settings, folder, results)
        elif section == "grpo":
            grpo.run_grpo(settings, folder, results, deadline)
        else:
            run_train(settings, folder, results, section, deadline)


def run_train(settings: Settings, folder: Path, results: Results, method: str, deadline: float) -> None:
    """`method`'s train step on every case, in order, none started after `deadline`."""
    import jax

    from jaxtune.runtime.measures import flops

    start = time.perf_counter()
    runtime = show_runtime_lines()
    runtime.taken()
    with ticking(f"jaxtune {method}: opening the model"):
        cfg, model = open_benchmark_model(settings, folder, method)
    seconds = time.perf_counter() - start
    phases = load_phases(runtime.taken(), seconds)
    # the process's peak resident memory once loaded: a base quantized on the way never holds its float weights whole
    results.add(
        event="loaded",
        method=method,
        seconds=seconds,
        phases=phases,
        host_peak_bytes=process_rss()["peak_bytes"],
    )
    log(f"jaxtune {method}: model opened in {seconds:.1f} s ({describe_phases(phases)})")
    for rows, length in settings.cases:  # counted before any case runs, so a cut case's other sides still get an MFU
        # attention as the model computes it: half the row causally, at most the window in a sliding layer
        per_token = flops.train_flops_per_token(model, flops.attended_keys(model.config, length))
        half_row = flops.train_flops_per_token(model, (length + 1) / 2)["total"]  # as before: every layer global
        results.add(
            event="flops",
            method=method,
            case=case_name(rows, length),
            per_token=per_token["total"],
            per_token_half_row=half_row,
            detail=per_token,
        )
    initial = jax.device_get(model.weights)  # each case starts from these, with one copy on the device at a time

    for remat in settings.remats:
        run_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"remat": remat})})
        side = jaxtune_side(method, remat)

        def prepare(case, run_cfg=run_cfg, side=side):
            step, plan, profile = train_case(settings, run_cfg, model, initial, case, results, side)
            return step, lambda: {**plan(), **jax_memory(model.placement.mesh.devices.flat[0])}, profile

        measure_cases(results, settings, side, prepare, deadline)


def train_case(settings: Settings, cfg, model, initial: dict, case: tuple[int, int], results: Results, side: str):
    """(step, plan, profile): step(i) -> loss at i = 0, jaxtune's train step on batch i of `case` from the `initial`
    weights (the step donates the weights it is given, so the model gets a fresh copy of them for each case); plan()
    -> XLA's memory plan of that step; profile(i) -> the breakdown of `PROFILE_STEPS` steps from i on (`profile_steps`),
    None without --profile. The step runs as the train stage runs it: `fit.choose` picks train.remat auto's policy,
    loss chunk and micro-batch split from compiled plans (a fixed policy is compiled once); the choice is a result
    line (event "fit")."""
    import jax
    import numpy as np

    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.measures import fit
    from jaxtune.runtime.train.packing import unpacked_segments

    rows, length = case
    model.weights = jax.device_put(initial, jax.tree.map(lambda a: a.sharding, model.weights))
    optimizer = steps.make_optimizer(cfg.train)
    started, before = time.perf_counter(), dict(COMPILING)
    chosen = fit.choose(
        model,
        optimizer,
        cfg.train.model_copy(update={"batch_size": rows, "grad_accumulation": 1}),
        lambda run: (run.batch_size, length, 0),
    )
    results.add(
        event="fit",
        case=case_name(rows, length),
        side=side,
        fit_seconds=time.perf_counter() - started,
        compiling={k: v - before.get(k, 0) for k, v in COMPILING.items() if v != before.get(k, 0)},
        **chosen.record(),
    )
    spent = {k: v - before.get(k, 0) for k, v in COMPILING.items() if v != before.get(k, 0)}
    log(
        f"{side} {case_name(rows, length)}: chosen in {time.perf_counter() - started:.1f} s ("
        + describe_phases({k.removesuffix("_seconds"): v for k, v in spent.items() if k.endswith("_seconds")})
        + f"): {chosen.describe(cfg.train.model_copy(update={'batch_size': rows}))}"
    )
    split = chosen.split
    spec = steps.StepSpec(chosen.remat, chunk_tokens=chosen.chunk_tokens)
    train_step = steps.make_train_step(model, optimizer, spec)
    schedule = steps.learning_rate_schedule(cfg.train, cfg.train.max_steps)
    state = {"weights": model.weights}
    state["opt"] = steps.init_optimizer(model, optimizer, state["weights"])
    vocab = model.config.vocab_size
    feed = []
    profiled = PROFILE_STEPS if settings.profile else 0
    for i in range(
        1 + settings.warmups + settings.steps + profiled
    ):  # on the device before timing, as the other side's
        batch = train_batch(settings, vocab, rows, length, i)
        batch = {**batch, **unpacked_segments(batch["attention_mask"])}
        feed.append(
            model.placement.shard_micro_batches(
                {k: np.asarray(v, np.int32).reshape(split, rows // split, length) for k, v in batch.items()}
            )
        )

    def step(i: int):
        batch = dict(feed[i])
        labels = batch.pop("labels")
        loss, state["weights"], state["opt"] = train_step(
            state["weights"], model.buffers, state["opt"], batch, labels, steps.step_key(cfg.train.seed, i), schedule(i)
        )
        jax.block_until_ready((loss, state["weights"], state["opt"]))
        return float(loss) if i == 0 else None

    def plan() -> dict:
        return {
            "plan_peak_bytes": chosen.plan.peak,
            "plan_code_bytes": chosen.plan.code,
            "remat": chosen.remat,
            "loss_chunk_tokens": chosen.chunk_tokens,
            "split": split,
        }

    def profile(first: int) -> dict:
        # The program fit.choose compiled for these shapes: JAX still holds it, so this compiles nothing.
        compiled = steps.compiled_train_step(model, optimizer, split, rows // split, length, spec)
        folder = Path(settings.profile) / f"{side}-{case_name(rows, length)}"
        found = profile_steps(step, first, folder, compiled.as_text())
        log(f"{side} {case_name(rows, length)}: profiled {PROFILE_STEPS} steps into {folder}")
        return {**found, "program_flops": chosen.plan.cost.get("flops")}

    return step, plan, profile if settings.profile else None


def profile_steps(step, first: int, folder: Path, hlo: str) -> dict:
    """Steps first, first + 1, ... (`PROFILE_STEPS`) inside `jax.profiler.trace(folder)`, each in a
    StepTraceAnnotation, with the program's optimized HLO beside the trace: their breakdown
    (`profile_breakdown.breakdown`, which reads the folder again later:
    `python -m benchmarks.analysis.profile_breakdown FOLDER`)."""
    import jax

    from benchmarks.analysis import profile_breakdown

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train_step.hlo").write_text(hlo)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no event per Python call, which would slow the host between the steps
    with jax.profiler.trace(str(folder), profiler_options=options):
        for i in range(first, first + PROFILE_STEPS):
            with jax.profiler.StepTraceAnnotation(profile_breakdown.STEP, step_num=i):
                step(i)
    return profile_breakdown.breakdown(folder)


def device_info() -> dict:
    import jax

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "hbm_bandwidth": hbm_bandwidth(device),
    }


def hbm_bandwidth(device) -> float | None:
    """Bytes/s of the device's memory, from the chip table `doctor
    --target` plans with; None for a CPU or an unknown kind."""
    from jaxtune.runtime.devices import targets

    tpus = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e", "TPU v5p": "v5p", "TPU v5": "v5p", "TPU v4": "v4"}
    name = next((chip for kind, chip in tpus.items() if device.device_kind.startswith(kind)), None)
    if name is not None:
        return targets.CHIPS[name].hbm_bandwidth
    gpu = next((chip for chip in targets.GPUS.values() if chip.gpu.name == device.device_kind), None)
    return gpu.hbm_bandwidth if gpu else None


def measured_matmul(settings: Settings) -> dict:
    """FLOP/s of an (n, n) @ (n, n) matmul in the weights' dtype, median of 10 after a warm-up: the
    measured peak MFU is also taken against."""
    import statistics

    import jax
    import jax.numpy as jnp

    from benchmarks.common.harness import matmul_run

    # on a CPU (a --layers run of a real width on a host without an accelerator) a smaller one: 8192^3 takes minutes
    n = settings.matmul_n if jax.devices()[0].platform != "cpu" else min(settings.matmul_n, CPU_MATMUL_N)
    run = matmul_run(n, jnp.dtype(settings.dtype))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    log(f"matmul {n}^3 {settings.dtype}: {2 * n**3 / seconds / 1e12:.1f} TFLOP/s")
    return {"n": n, "dtype": settings.dtype, "seconds": seconds, "flops_per_second": 2 * n**3 / seconds}


def run_decode(settings: Settings, folder: Path, results: Results) -> None:
    """Greedy decoding of the prompts as the generate stage decodes them (`greedy_generate`, no end-of-sequence
    stop): the first call compiles, then the median of `decode_repeats` calls."""
    import statistics

    import jax

    from jaxtune.runtime.decoding.inference import greedy_generate

    _, model = open_benchmark_model(settings, folder, None)
    batch = prompts(settings, model.config.vocab_size).tolist()
    # What one decoding step reads at least: every weight (the tied head reads the whole embedding).
    weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves((model.weights, model.buffers)))

    def timed(batch: list) -> tuple[list, float, list[float]]:
        """(tokens, the first call's seconds, the next `decode_repeats` calls' seconds)."""
        seconds = []
        for _ in range(1 + settings.decode_repeats):
            start = time.perf_counter()
            tokens = greedy_generate(model, batch, len(batch), settings.new_tokens, eos_ids=(), pad_id=0)
            seconds.append(time.perf_counter() - start)
        return tokens, seconds[0], seconds[1:]

    for count in (settings.prompts, *settings.decode_batches):
        tokens, first, times = timed(
            batch if count == settings.prompts else prompts(settings, model.config.vocab_size, count).tolist()
        )
        seconds = statistics.median(times)
        new = count * settings.new_tokens
        if count == settings.prompts:  # the batch compared with `generate`
            results.add(event="decode", side="jaxtune", first_call_seconds=first, tokens=tokens)
            results.add(
                event="decode",
                side="jaxtune",
                seconds=seconds,
                times=times,
                new_tokens_per_second=new / seconds,
                weight_bytes=weight_bytes,
                **jax_memory(model.placement.mesh.devices.flat[0]),
            )
        results.add(
            event="decode_batch",
            side="jaxtune",
            prompts=count,
            first_call_seconds=first,
            seconds=seconds,
            new_tokens_per_second=new / seconds,
            weight_bytes=weight_bytes,
        )
        log(f"jaxtune decode, {count} prompts: {new / seconds:,.0f} new tokens/s (first call {first:.1f} s)")
