"""A GRPO step in the accelerator benchmark (jaxtune's section `grpo`; the other parts have no GRPO step):
`rollouts.train_grpo` on the LoRA recipe, as the train stage runs it for train.objective grpo, and the
report's split of its step into sampling, the update and the rest.

A case PxGxN: P prompts of `grpo_prompt_length` random tokens, G answers to each sampled at temperature 1
(rl's defaults otherwise: no KL term, one optimizer step per sampled batch), N new tokens an answer, and one
optimizer step on the P x G answers (train.batch_size P x G, grad_accumulation 1, train.remat auto: the memory
plan may split the batch). The end token is an id past the vocabulary, which sampling never picks: every
answer runs all N tokens, the worst case for sampling's time. The reward, the share of an answer's even token
ids, needs no text and differs between answers, so every group has something to learn.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.accelerator.jaxtune_model import COMPILING, open_benchmark_model
from benchmarks.accelerator.shared import Results, Settings, case_name, jax_memory, prompts
from benchmarks.common.harness import log


def even_share(rows: np.ndarray, answers: list[list[int]]) -> np.ndarray:
    """(n, 1) rewards: the share of each answer's token ids that are even."""
    return np.asarray([[np.mean(np.asarray(a) % 2 == 0) if a else 0.0] for a in answers], np.float32)


def run_grpo(settings: Settings, folder: Path, results: Results, deadline: float) -> None:
    """Every GRPO case in turn, none started after `deadline`; a failed case is recorded and the next runs."""
    import gc
    import traceback

    import jax

    cfg, model = open_benchmark_model(settings, folder, "lora")
    # What one decoding step reads at least: every weight, as the decode section counts it.
    weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves((model.weights, model.buffers)))
    initial = jax.device_get(model.weights)  # each case starts from these (the update donates the weights)
    for case in settings.grpo_cases:
        name = case_name(*case)
        if time.perf_counter() > deadline:
            results.add(event="grpo", case=name, skipped="not started: the grpo section's share of the time was used")
            continue
        try:
            model.weights = jax.device_put(initial, jax.tree.map(lambda a: a.sharding, model.weights))
            grpo_case(settings, cfg, model, case, results, weight_bytes)
        except Exception as e:  # noqa: BLE001  (one case's failure must not lose the cases after it)
            traceback.print_exc()
            results.add(event="grpo", case=name, error=f"{type(e).__name__}: {e}"[:300])
            log(f"jaxtune grpo {name}: failed ({type(e).__name__})")
        gc.collect()


def grpo_case(settings: Settings, cfg, model, case: tuple[int, int, int], results: Results, weight_bytes: int) -> None:
    """1 + warmups + steps GRPO steps of one case; the memory plan and each step's record are result lines as
    they come (a child cut at its limit keeps the steps it finished)."""
    from jaxtune.config import RLConfig
    from jaxtune.runtime.train import rollouts

    n_prompts, generations, new_tokens = case
    name, vocab = case_name(*case), model.config.vocab_size
    train = cfg.train.model_copy(
        update={
            "batch_size": n_prompts * generations,
            "grad_accumulation": 1,
            "max_steps": 1 + settings.warmups + settings.steps,
        }
    )
    rl = RLConfig(num_generations=generations, max_completion_length=new_tokens, temperature=1.0)
    results.add(
        event="grpo",
        case=name,
        answers=n_prompts * generations,
        new_tokens=new_tokens,
        prompt_length=settings.grpo_prompt_length,
        end_token=vocab,
        weight_bytes=weight_bytes,
        steps=train.max_steps,
    )
    started, before = time.perf_counter(), dict(COMPILING)
    compiled = lambda: {k: v - before.get(k, 0) for k, v in COMPILING.items() if v != before.get(k, 0)}  # noqa: E731

    def on_log(records: list[dict]) -> None:
        for record in records:
            if "memory_plan" in record:  # logged once train.remat auto has chosen, before the first step
                plan = record["memory_plan"]
                results.add(
                    event="grpo_plan",
                    case=name,
                    fit_seconds=time.perf_counter() - started,
                    compiling=compiled(),
                    plan_peak_bytes=plan["peak"],
                    plan_code_bytes=plan["code"],
                    **plan["fit"],
                    message=record["message"],
                )
                log(
                    f"jaxtune grpo {name}: remat {plan['fit']['remat']} chosen after {time.perf_counter() - started:.0f} s "
                    f"({', '.join(f'{k} {v:.0f}' for k, v in compiled().items())})"
                )
            elif "loss" in record:
                results.add(event="grpo_step", case=name, **record)
                log(
                    f"jaxtune grpo {name} step {record['step']}: {record['step_seconds']:.2f} s "
                    f"(sampling {record['sample_seconds']:.2f} s, update {record['update_seconds']:.2f} s)"
                )

    batch = prompts(settings, vocab, n_prompts, settings.grpo_prompt_length).tolist()
    rollouts.train_grpo(model, batch, even_share, ["even_ids"], train, rl, pad_id=0, eos_ids=(vocab,), on_log=on_log)
    results.add(
        event="grpo",
        case=name,
        seconds=time.perf_counter() - started,
        run_compiling=compiled(),
        **jax_memory(model.placement.mesh.devices.flat[0]),
    )


# --------------------------------------------------------------------------------------------
# The report: figures from the result lines, and their Markdown
# --------------------------------------------------------------------------------------------


def grpo_results(settings: Settings, lines: list[dict], parts: dict, bandwidth: float | None) -> dict:
    """{case: figures, or {"missing": why}} of every GRPO case the run asked for."""
    return {
        case_name(*case): case_figures(lines, case_name(*case), settings.warmups, parts, bandwidth)
        for case in settings.grpo_cases
    }


def case_figures(lines: list[dict], case: str, warmups: int, parts: dict, bandwidth: float | None) -> dict:
    """One case's figures over its timed steps (after the first, which compiles, and the warm-ups): sums of
    seconds and tokens, so the shares of the step add up."""
    mine = [line for line in lines if line.get("case") == case and line.get("event", "").startswith("grpo")]
    figures: dict = {}  # the case's lines and its memory plan's, merged (the train cases' figures' names)
    for line in mine:
        if line["event"] in ("grpo", "grpo_plan"):
            figures.update({k: v for k, v in line.items() if k not in ("event", "case", "part")})
    steps = sorted((line for line in mine if line["event"] == "grpo_step"), key=lambda line: line["step"])
    if steps and steps[0]["step"] == 1:  # sampling's program and the update's compile in it
        figures.update(
            first_step_seconds=steps[0]["step_seconds"],
            first_sample_seconds=steps[0]["sample_seconds"],
            first_update_seconds=steps[0]["update_seconds"],
        )
    timed = [s for s in steps if s["step"] > 1 + warmups]
    figures["timed_steps"] = len(timed)
    if not timed:
        part = parts.get("jaxtune", {}).get("status", "not run")
        figures["missing"] = (
            f"failed: {figures['error']}"
            if "error" in figures
            else figures.get("skipped") or f"not measured: jaxtune {part}"
        )
        return figures
    figures.update(step_figures(timed, figures["answers"]))
    if bandwidth and figures.get("weight_bytes"):
        figures["weight_read_bound"] = figures["answers"] * bandwidth / figures["weight_bytes"]
        figures["sampling_of_bound"] = figures["sampling_tokens_per_second"] / figures["weight_read_bound"]
    return figures


def step_figures(timed: list[dict], answers: int) -> dict:
    """Sampling tokens/s (the answers' tokens over sampling's seconds), update tokens/s (the rows' real tokens,
    prompts and answers, over the update's seconds) and each one's share of the steps' seconds."""
    total = lambda key: sum(s[key] for s in timed)  # noqa: E731
    sampled = sum(answers * s["completion_length"] for s in timed)  # no end token emitted: answers x new tokens
    step, sample, update = total("step_seconds"), total("sample_seconds"), total("update_seconds")
    n = len(timed)
    return {
        "step_seconds": step / n,
        "sample_seconds": sample / n,
        "update_seconds": update / n,
        "sampled_tokens": sampled / n,
        "update_tokens": total("tokens") / n,
        "sampling_tokens_per_second": sampled / sample,
        "update_tokens_per_second": total("tokens") / update,
        "sample_share": sample / step,
        "update_share": update / step,
        "rest_share": 1 - (sample + update) / step,
        "completion_length": total("completion_length") / n,
        "truncated": total("truncated") / n,
        "reward": total("reward") / n,
    }
