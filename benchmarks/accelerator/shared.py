"""What every process of the accelerator benchmark shares: its settings, the model's weights (built
once, from a config-only folder, with a fixed seed), the batches and prompts (the same random tokens
on each side), and the result lines a child writes as it goes."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common.harness import ROOT, log

CONFIGS = ROOT / "benchmarks" / "configs"  # config.json of each published shape; no weights, no tokenizer
RECIPES = {
    "lora": ROOT / "configs" / "gemma3-1b-dolly-lora.yaml",
    "full": ROOT / "configs" / "gemma3-1b-dolly-full-adafactor.yaml",
}
DEFAULT_MODEL = "gemma-3-1b"
# --tiny: a few layers of the chosen family at toy sizes, so every part runs on a CPU in seconds.
TINY_SIZES = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
PROGRESS_SECONDS = 10.0  # building the weights says how far it is this often
TINY_WINDOW = 16  # shorter than the tiny cases' rows, so sliding-window layers mask something


@dataclass(frozen=True)
class Settings:
    """One run's settings, written to the work folder for its children to read."""

    model: str  # a folder of benchmarks/configs
    tiny: bool
    dtype: str  # the weights' dtype on both sides: the recipes' bfloat16, or float32 for --tiny
    cases: tuple[tuple[int, int], ...]  # (rows, length) of the train steps, in the order they run
    steps: int  # timed steps per case
    warmups: int  # untimed steps after the first (the compile) and before the timed ones
    prompts: int
    prompt_length: int
    new_tokens: int
    decode_repeats: int  # timed decodes after the first
    matmul_n: int  # the measured peak: an (n, n) @ (n, n) matmul in the weights' dtype
    compile_backend: str  # torch.compile's backend
    seed: int = 0
    remats: tuple[str, ...] = ("auto",)  # train.remat settings jaxtune's train cases run with, side by side
    sections: tuple[str, ...] = (
        "lora",
        "full",
        "decode",
    )  # jaxtune's sections that run, in this order (grpo: asked for)
    decode_batches: tuple[int, ...] = ()  # jaxtune's greedy decoding again at these batches (prompts), after `prompts`
    overrides: tuple[
        str, ...
    ] = ()  # KEY=VALUE settings of the recipes jaxtune's side runs, as `jaxtune run --set` takes them
    profile: str = (
        ""  # the folder jaxtune's train cases are profiled into after their timed steps (--profile); "": none
    )
    grpo_cases: tuple[tuple[int, int, int], ...] = ((8, 8, 256),)  # (prompts, generations, new tokens) of a GRPO step
    grpo_prompt_length: int = 128  # tokens of every GRPO prompt (random ids, no padding)
    layers: int | None = None  # decoder layers of the shape, its own count unless given (--layers)

    @classmethod
    def make(
        cls,
        model: str,
        tiny: bool,
        cases: tuple[tuple[int, int], ...] | None = None,
        remats: tuple[str, ...] = ("auto",),
        sections: tuple[str, ...] | None = None,
        overrides: tuple[str, ...] = (),
        profile: str = "",
        grpo_cases: tuple[tuple[int, int, int], ...] | None = None,
        layers: int | None = None,
    ) -> "Settings":
        made = dataclasses.replace(
            cls._make(model, tiny, cases), remats=remats, overrides=overrides, profile=profile, layers=layers
        )
        made = dataclasses.replace(made, grpo_cases=grpo_cases) if grpo_cases else made
        return dataclasses.replace(made, sections=sections) if sections else made

    @classmethod
    def _make(cls, model: str, tiny: bool, cases: tuple[tuple[int, int], ...] | None) -> "Settings":
        if tiny:  # inductor needs 35-45 s a shape for the tiny model on 2 CPU cores; aot_eager 4 s
            return cls(
                model,
                True,
                "float32",
                cases or ((8, 32), (8, 64)),
                steps=2,
                warmups=1,
                prompts=8,
                prompt_length=8,
                new_tokens=8,
                decode_repeats=1,
                matmul_n=256,
                compile_backend="aot_eager",
                decode_batches=(16,),
                sections=("lora", "full", "decode", "grpo"),
                grpo_cases=((2, 4, 8),),
                grpo_prompt_length=16,
            )
        return cls(
            model,
            False,
            "bfloat16",
            cases or ((8, 512), (8, 2048), (16, 512)),
            steps=10,
            warmups=2,
            prompts=8,
            prompt_length=64,
            new_tokens=64,
            decode_repeats=3,
            matmul_n=8192,
            compile_backend="inductor",
            decode_batches=(32, 64),
        )

    def save(self, work: Path) -> None:
        (work / "settings.json").write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, work: Path) -> "Settings":
        raw = json.loads((work / "settings.json").read_text())
        return cls(
            **{
                **raw,
                "cases": tuple(tuple(c) for c in raw["cases"]),
                "remats": tuple(raw.get("remats", ("auto",))),
                "sections": tuple(raw.get("sections", cls.sections)),
                "decode_batches": tuple(raw.get("decode_batches", ())),
                "grpo_cases": tuple(tuple(c) for c in raw.get("grpo_cases", cls.grpo_cases)),
                "overrides": tuple(raw.get("overrides", ())),
            }
        )


def case_name(*sizes: int) -> str:
    """'8x512' (rows x length) or '8x8x256' (GRPO's prompts x generations x new tokens)."""
    return "x".join(str(n) for n in sizes)


def jaxtune_side(method: str, remat: str = "auto") -> str:
    """'jaxtune-lora' (the default, train.remat auto), 'jaxtune-lora-layer' (a fixed policy)."""
    return f"jaxtune-{method}" + ("" if remat == "auto" else f"-{remat}")


def model_config(settings: Settings):
    """The transformers config of the run: the shipped shape, or its family at toy sizes (--tiny)."""
    from transformers import AutoConfig

    raw = json.loads((CONFIGS / settings.model / "config.json").read_text())
    if settings.tiny:
        raw.update(TINY_SIZES)
        if "layer_types" in raw or "sliding_window_pattern" in raw:  # Gemma: one sliding layer, one global
            raw.pop("sliding_window_pattern", None)
            raw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=TINY_WINDOW)
        if "query_pre_attn_scalar" in raw:  # queries scaled by 1/sqrt(head_dim), as the published Gemma 3 1B (256 both)
            raw["query_pre_attn_scalar"] = TINY_SIZES["head_dim"]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            raw[key] = min(raw[key], 2) if isinstance(raw.get(key), int) else None
    if settings.layers is not None:  # the shape's first layers at its width: each costs what it costs in the whole
        raw["num_hidden_layers"] = settings.layers
        if "layer_types" in raw:
            raw["layer_types"] = raw["layer_types"][: settings.layers]
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def build_weights(settings: Settings, folder: Path) -> dict:
    """Random weights of the run's shape from one seed, saved as an HF folder (safetensors shards, their index,
    config.json, generation_config.json), written one group at a time: each decoder layer, then each other module
    holding saved tensors (embeddings, final norm, an untied head). The model is made on the meta device; a group
    is materialised on the CPU, initialised by the model's own `_init_weights` from a seed of its own (settings.seed
    and the group's module path: the same bytes whatever else is built), written as one shard and freed, so the host
    holds one layer or the embedding at a time, never the whole model (Gemma 3 12B: 23.5 GB in bfloat16).
    The tensor names are those `save_pretrained` writes for the same model: a tied head is left to the embedding."""
    import resource

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    config = model_config(settings)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, settings.dtype))
    parameters = sum(p.numel() for p in module.parameters())  # before to_empty's new Parameters untie the head
    groups = weight_groups(module)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total, reported = {}, 0, time.perf_counter()
    for index, (path, (names, owner, whole)) in enumerate(groups.items()):
        if time.perf_counter() - reported >= PROGRESS_SECONDS:
            reported = time.perf_counter()
            log(f"building weights: group {index + 1} of {len(groups)} ({path}), {reported - start:.0f} s so far")
        shard = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        with torch.no_grad():
            owner.to_empty(device="cpu", recurse=whole)
            initialise(module, owner, whole, [settings.seed, *path.encode()])
            tensors = {name: module.get_parameter_or_buffer(name).detach().contiguous() for name in names}
            save_file(tensors, str(folder / shard), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            owner.to_empty(device="meta", recurse=whole)
        release_memory()
        weight_map.update(dict.fromkeys(names, shard))
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n")
    module.config.dtype = settings.dtype  # what save_pretrained records of the model it saves
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(folder)
    if module.can_generate():
        module.generation_config.save_pretrained(folder)
    return {
        "parameters": parameters,
        "vocab_size": module.config.vocab_size,
        "seconds": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # the process's, so far
    }


def release_memory() -> None:
    """Give the host memory of a written group back to the system before the next is made. safetensors' save_file
    leaves each tensor it wrote in a reference cycle (its numpy view of the bytes, made through ctypes), so the
    tensors pile up until the collector happens to run; and glibc keeps freed blocks under its mmap threshold
    (which grows to 32 MB as blocks are freed: most of a layer's matrices) in its heap, where the next layer's
    allocations do not always reuse them (seen: 8 layers of 16 MB grew the peak RSS by 93 MB, by 16 MB with a trim)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def weight_groups(module) -> dict:
    """The saved tensors of a meta-device model in the groups `build_weights` writes, in state_dict order: the
    group's module path -> (tensor names, the module to materialise, with its submodules or not). A decoder layer
    (a class named in `_no_split_modules`) is a group with all its submodules; every other tensor goes with the
    other direct tensors of its module."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = module.state_dict()
    for name in getattr(module, "_keys_to_ignore_on_save", None) or ():
        state.pop(name, None)
    kept = list(remove_tied_weights_from_state_dict(state, module))  # as save_pretrained: a tied head is dropped
    if list(revert_weight_conversion(module, dict.fromkeys(kept))) != kept:
        raise NotImplementedError(f"{type(module).__name__} saves its weights under other names than it holds")
    layer_classes = set(getattr(module, "_no_split_modules", None) or ())
    layers = {}
    for name, sub in module.named_modules():
        if type(sub).__name__ in layer_classes and not any(name.startswith(f"{outer}.") for outer in layers):
            layers[name] = sub
    groups = {}
    for name in kept:
        owner = name.rpartition(".")[0]
        layer = next((outer for outer in layers if owner == outer or owner.startswith(f"{outer}.")), None)
        key = layer if layer is not None else owner
        if key not in groups:
            groups[key] = ([], layers[layer], True) if layer is not None else ([], module.get_submodule(owner), False)
        groups[key][0].append(name)
    return groups


def initialise(module, owner, whole: bool, seed: list[int]) -> None:
    """Initialise a materialised group of `module` as `from_config` does: `owner` (and, if `whole`, each of its
    submodules, children before parents) by the `_init_weights` of the nearest PreTrainedModel at or above it,
    drawing from `seed`."""
    import contextlib

    import torch
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    initialiser = {}  # module -> the PreTrainedModel whose _init_weights initialises it, as smart_apply dispatches
    stack = [(module, module)]
    while stack:
        sub, model = stack.pop()
        model = sub if isinstance(sub, PreTrainedModel) else model
        initialiser[sub] = model
        stack.extend((child, model) for child in sub.children())
    guard = getattr(hf_init, "guard_torch_init_functions", contextlib.nullcontext)
    torch.manual_seed(int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0] >> 1))
    with guard():
        for sub in reversed(list(owner.modules())) if whole else (owner,):
            initialiser[sub]._init_weights(sub)


def train_batch(settings: Settings, vocab: int, rows: int, length: int, index: int) -> dict[str, np.ndarray]:
    """Batch `index` of a (rows, length) case: random tokens, every one real and scored (labels are the
    inputs; each side shifts them), the same for a given case and index in every process."""
    rng = np.random.default_rng([settings.seed, rows, length, index])
    ids = rng.integers(3, vocab, size=(rows, length), dtype=np.int32)  # 0-2: the special ids of the shapes' configs
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids.copy()}


def prompts(settings: Settings, vocab: int, count: int | None = None, length: int | None = None) -> np.ndarray:
    """(count, length) random prompt tokens (`settings.prompts` of them, `settings.prompt_length` long, unless
    given), all the same length: no padding on either side. A larger count starts with the same prompts."""
    rng = np.random.default_rng([settings.seed, 1])
    return rng.integers(3, vocab, size=(count or settings.prompts, length or settings.prompt_length), dtype=np.int32)


class Results:
    """A child's result lines (JSON, one per line), written as they come: a child killed past its
    limit leaves every line it finished."""

    def __init__(self, work: Path, part: str):
        self.path = work / f"{part}.jsonl"

    def add(self, **line) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(line, default=float) + "\n")

    @staticmethod
    def read(work: Path, part: str) -> list[dict]:
        path = work / f"{part}.jsonl"
        if not path.exists():
            return []
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:  # the line being written when the child was killed
                break
        return lines


def measure_cases(results: Results, settings: Settings, side: str, prepare, deadline: float | None = None) -> None:
    """Every case of the run on one side, in order: `prepare(case)` -> (step, memory) or (step, memory,
    profile) (see `measure_case`).
    A case that fails (out of memory, say) is recorded as such, and the next one runs; none starts after `deadline`."""
    import gc
    import traceback

    from benchmarks.common.harness import log

    for case in settings.cases:
        if deadline is not None and time.perf_counter() > deadline:
            results.add(case=case_name(*case), side=side, skipped=f"not started: {side}'s share of the time was used")
            continue
        try:
            measure_case(results, settings, side, case, *prepare(case))
        except Exception as e:  # noqa: BLE001  (one case's failure must not lose the cases after it)
            traceback.print_exc()
            results.add(case=case_name(*case), side=side, error=f"{type(e).__name__}: {e}"[:300])
            log(f"{side} {case_name(*case)}: failed ({type(e).__name__})")
        gc.collect()


def measure_case(
    results: Results, settings: Settings, side: str, case: tuple[int, int], step, memory, profile=None
) -> None:
    """Time one train case on one side: `step(i)` runs synchronously on batch i (returning the loss
    as a float at i = 0). The first step's time is trace + compile + run; then `warmups` untimed
    steps and the median of `steps` timed ones. `memory()` is the side's peak-memory reading;
    `profile(i)`, where given, profiles the steps from i on and returns their breakdown."""
    import itertools
    import traceback

    from benchmarks.common.harness import log, median_time

    rows, length = case
    name = case_name(rows, length)
    start = time.perf_counter()
    loss = step(0)
    first = time.perf_counter() - start
    results.add(case=name, side=side, first_step_seconds=first, step0_loss=loss)
    log(f"{side} {name}: first step {first:.1f} s, loss {loss:.6f}")
    index = itertools.count(1)
    seconds, times = median_time(lambda: step(next(index)), settings.steps, settings.warmups)
    results.add(case=name, side=side, step_seconds=seconds, step_times=times, tokens_per_second=rows * length / seconds)
    log(f"{side} {name}: {seconds * 1e3:.1f} ms a step, {rows * length / seconds:,.0f} tokens/s")
    results.add(
        case=name, side=side, **memory()
    )  # a line of its own: a side cut while reading its plan keeps its times
    if profile is not None:
        try:
            found = profile(1 + settings.warmups + settings.steps)
        except Exception as e:  # noqa: BLE001  (the case's figures stand without its profile)
            traceback.print_exc()
            found = {"error": f"{type(e).__name__}: {e}"[:300]}
        results.add(case=name, side=side, profile=found)


def jax_memory(device) -> dict:
    """The device's peak bytes so far in this process (cases run one after another, so a case that needs
    less than an earlier one shows the earlier peak), or the process's peak RSS where JAX keeps no count (CPU)."""
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {
            "peak_bytes": int(stats["peak_bytes_in_use"]),
            "memory_source": "jax peak_bytes_in_use (process so far)",
        }
    return process_rss()


def process_rss() -> dict:
    """This process's peak resident memory: the memory figure on a CPU, where neither side counts its own."""
    import resource

    return {
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_source": "process peak RSS (CPU)",
    }
