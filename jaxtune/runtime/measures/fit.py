"""`train.remat: auto`: how the configured batch runs on the devices at hand, chosen from XLA's own plans.

The user names the batch (`train.batch_size` rows, `train.grad_accumulation` micro-batches) and the
length; what each decoder layer keeps for the backward pass, how many tokens the loss takes per
chunk, and how many micro-batches a step's rows are split into are this module's choice. Each
candidate is the train step compiled for the devices (`memory.memory_plan`), so the test of "fits"
is the devices' own compiler's, not an estimate. In order:

1. the remat policies, least recomputation first (none, matmuls, layer), each first with a large
   loss chunk: each chunk reads the whole output head again, so fewer, larger chunks are faster on
   an accelerator, and a chunk is grown (`loss.grown_chunk_tokens`) from the platform's smallest
   (`loss.chunk_tokens_on`) while its backward pass's logits take at most 1/`CHUNK_SHARE` of the
   memory; then with the smallest chunk, unless the first plan needed more than the larger chunk
   explains. The first plan that fits wins. Where `none` does not fit, it is tried once more on
   fewer rows at a time (`MAX_NONE_SPLIT`) if its plan or refusal says that would fit: no
   recomputation, the same update. `matmuls` is not compiled where `none` needs more than the
   budget by more than `matmuls` could save (`MATMULS_OF_NONE`): each candidate costs a trace and
   a compile, refused or not;
2. where even `layer` does not fit, the micro-batch split: `batch_size` rows run as s micro-batches
   of batch_size / s rows, s times as many per step (the gradients of a step's micro-batches are
   summed inside it, so the update is the one the whole batch gives), the smallest s that fits,
   starting from the split the `layer` plan's activations suggest, at the smallest chunk.

"Fits" means the step's peak plus its code within the device's memory less `HEADROOM`, kept for
what XLA's plan does not hold (the next batch on its way in, the runtime's own buffers). Where
the devices report no memory (the CPU), nothing is compiled to choose: `auto` is `matmuls`.

A fixed policy is obeyed: its plan is compiled with the loss chunk grown as above (again at the
smallest chunk only where that does not fit), and a plan that does not fit the whole device is
refused before the first step (`memory.check_fits`).

None of the choice is in a cache key: like the mesh, it changes where and how fast the numbers
are computed, not which numbers (up to the order of float sums). `train.remat` itself is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from jaxtune.config import REMAT_POLICIES, TrainConfig
from jaxtune.errors import PlanDoesNotFit
from jaxtune.runtime.devices import compile_cache, executables
from jaxtune.runtime.measures import memory
from jaxtune.runtime.modeling import loss

HEADROOM = 0.03  # of the device's memory, kept free beyond XLA's plan
POLICIES = REMAT_POLICIES  # least recomputation first
WITHOUT_LIMIT = "matmuls"  # auto where the devices report no memory
# `matmuls` recomputes only what lies between a layer's matmuls, so it needs most of what `none` needs:
# 0.95x of it on this CPU's tiny Llama, 1.49x on a TPU v5e (GRPO's 64 x 384 rows of Gemma 3 1B, where XLA
# keeps more under the policy than it chose to without). Where `none` needs more than the budget by more
# than that could save, `matmuls` is not compiled: a refused candidate costs a trace and a compile all the same.
MATMULS_OF_NONE = 0.75
# Before any recomputation, `none` is tried on fewer rows at a time (up to this many micro-batches per configured
# one) where its first plan or refusal says that would fit with this margin: the step's flops are the same, and
# the update the whole batch gives, where `layer` would run each layer's forward twice (about 1.3x the time).
# No margin: one more compile where the estimate is just short costs less than the recomputing step it saves
# (Gemma 3 4B, layers stacked, LoRA 8 x 1024 on a v5e: refused at 27.2 GB on 8 rows, so 4.3 micro-batches by
# estimate with a 0.9 margin and layer chosen, MFU 51%; none in 4 micro-batches plans 14.3 GiB of 15.28).
MAX_NONE_SPLIT, NONE_SPLIT_MARGIN = 4, 1.0
CHUNK_SHARE = 8  # the loss's chunk is first tried as large as 1/8 of the budget allows (`loss.grown_chunk_tokens`)

REFUSED_BYTES = re.compile(r"\(([\d.]+)G\) exceeds")  # libtpu's "... temporaries (21.49G) exceeds available HBM"

# (rows, length, segments) of one micro-batch of a config: what the feed would give the step (rows None:
# `memory.memory_plan`'s default, train.batch_size rows, or pairs of rows for a preference objective).
Shape = Callable[[TrainConfig], tuple[int, int, int]]


class NothingFits(PlanDoesNotFit):
    """No way of running the batch fits (auto), or the fixed policy is refused; `fit` is the most
    economical candidate that compiled (None when the compiler refused every one)."""

    def __init__(self, message: str, fit: Fit | None):
        super().__init__(message)
        self.fit = fit


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way of running the batch that `choose` weighed, and what came of it: the bytes its plan needs
    where it compiled, the compiler's words where it refused it, or why it was not compiled."""

    remat: str
    split: int  # each configured micro-batch run as this many
    chunk_tokens: int
    needed: int | None = None  # its plan's peak plus code
    activations: int | None = None  # of which one micro-batch's activations
    refused: str | None = None
    skipped: str | None = None

    def record(self) -> dict:
        """The fields that hold something, as the summary and the logged plan keep them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def least_needed(self) -> int:
        """The bytes it needs, or where the compiler refused it, the least its refusal says it would
        ("HLO temporaries (21.49G) exceeds ..."; 0 when it names no figure)."""
        if self.needed is not None:
            return self.needed
        found = REFUSED_BYTES.search(self.refused or "")
        return int(float(found[1]) * 2**30) if found else 0

    def text(self) -> str:
        what = (
            f"remat {self.remat}" + (f" split {self.split}" if self.split > 1 else "") + f" chunk {self.chunk_tokens}"
        )
        if self.skipped is not None:
            return f"{what} not compiled (none needs too much)"
        return f"{what} needs {_gib(self.needed)}" if self.needed is not None else f"{what} refused"


@dataclasses.dataclass
class Fit:
    """The chosen way to run a config's steps, its plan, and every candidate compiled to find it."""

    remat: str
    chunk_tokens: int
    split: int  # each configured micro-batch runs as this many
    plan: memory.MemoryPlan
    chosen_by: str  # "auto", "fixed" or "no device memory reported"
    budget: int | None  # bytes a plan may need (peak + code): the device's memory less HEADROOM
    tried: list[Candidate] = dataclasses.field(default_factory=list)

    @classmethod
    def from_record(cls, record: dict) -> "Fit":
        """A `Fit` kept as `dataclasses.asdict` gives it (`executables.remember`)."""
        return cls(
            **{
                **record,
                "plan": memory.MemoryPlan.from_record(record["plan"]),
                "tried": [Candidate(**entry) for entry in record["tried"]],
            }
        )

    def train_config(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` as it runs: the chosen policy, `batch_size` and `grad_accumulation` split."""
        return cfg.model_copy(
            update={
                "remat": self.remat,
                "batch_size": cfg.batch_size // self.split,
                "grad_accumulation": cfg.grad_accumulation * self.split,
            }
        )

    def record(self) -> dict:
        return {
            "remat": self.remat,
            "loss_chunk_tokens": self.chunk_tokens,
            "split": self.split,
            "chosen_by": self.chosen_by,
            "headroom": HEADROOM,
            "budget_bytes": self.budget,
            "tried": [candidate.record() for candidate in self.tried],
        }

    def describe(self, cfg: TrainConfig) -> str:
        """'remat auto: none, loss chunks of 1024 tokens, 1 x 8
        rows per step (needs 9.81 GiB of 15.28 GiB; tried ...)'."""
        run = self.train_config(cfg)
        needed = self.plan.needed
        limit = f" of {_gib(self.budget)} ({HEADROOM:.0%} of the device kept free)" if self.budget else ""
        split = f", batch_size {cfg.batch_size} split into {self.split} micro-batches" if self.split > 1 else ""
        tried = "; ".join(candidate.text() for candidate in self.tried[:-1])
        return (
            f"train.remat {cfg.remat}: {self.remat} ({self.chosen_by}), loss chunks of {self.chunk_tokens} tokens, "
            f"{run.grad_accumulation} x {run.batch_size} rows per step{split}; needs {_gib(needed)}{limit}"
            + (f"; did not fit: {tried}" if tried else "")
        )


def choose(
    model, optimizer, cfg: TrainConfig, shape: Shape, fused: bool = True, objective=None, limit: int | None = None
) -> Fit:
    """The `Fit` of `cfg` on the model's devices (memory `limit`, else what they report); MemoryError,
    in one line with what would fit, when nothing does (or a fixed policy does not)."""
    limit = limit or memory.device_limit()
    recalled, kept = _recalled(model, optimizer, cfg, shape, fused, objective, limit)
    if recalled is not None:
        return recalled
    found = _choose(model, optimizer, cfg, shape, fused, objective, limit)
    if kept is not None:
        executables.remember(kept, dataclasses.asdict(found))
    return found


def _recalled(model, optimizer, cfg: TrainConfig, shape: Shape, fused: bool, objective, limit: int | None):
    """(the `Fit` chosen before for the same model, optimizer, objective, batch, shapes, device memory and
    code, or None; the key it is kept under, or None where nothing is kept). A recalled fit costs no
    trace or compile; its executable loads at the first step (`executables`)."""
    from jaxtune.runtime.compiled import programs, steps

    optimizer_settings = steps.optimizer_settings(optimizer)
    if executables.folder() is None or optimizer_settings is None:
        return None, None
    settings = repr(
        (
            optimizer_settings,
            objective,
            fused,
            limit,
            HEADROOM,
            cfg.remat,
            cfg.batch_size,
            cfg.grad_accumulation,
            shape(cfg),
        )
    )
    kept = executables.key("fit", programs.structure(model), settings, "")
    record = executables.recall(kept)
    if record is None:
        return None, kept
    found = Fit.from_record(record)
    executables.logger.info("%s (the plan chosen before, recalled with no compile)", found.describe(cfg))
    return found, kept


def _choose(model, optimizer, cfg: TrainConfig, shape: Shape, fused: bool, objective, limit: int | None) -> Fit:
    platform = model.placement.mesh.devices.flat[0].platform
    base = loss.chunk_tokens_on(platform, vocab_size(model))
    tried: list[Candidate] = []

    def plan(remat: str, split: int, chunk: int = base) -> memory.MemoryPlan | None:
        """The plan of one candidate, None when the compiler refuses it for want of memory."""
        run = cfg.model_copy(
            update={
                "remat": remat,
                "batch_size": cfg.batch_size // split,
                "grad_accumulation": cfg.grad_accumulation * split,
            }
        )
        rows, length, segments = shape(run)
        entry = Candidate(remat, split, chunk)
        try:
            found = memory.memory_plan(
                model,
                optimizer,
                run,
                length,
                rows=rows,
                fused=fused,
                limit=limit,
                objective=objective,
                segments=segments,
                chunk_tokens=chunk,
            )
        except Exception as error:  # XLA:TPU refuses, at compile time, a step that does not fit
            refused = compile_cache.refusal(error)
            if refused is None:
                raise
            tried.append(dataclasses.replace(entry, refused=refused))
            return None
        tried.append(dataclasses.replace(entry, needed=found.needed, activations=found.activations_per_micro_batch))
        return found

    budget = int(limit * (1 - HEADROOM)) if limit else None
    fits = lambda found: found is not None and found.needed <= budget  # noqa: E731
    rows, length, _ = shape(cfg)
    chunk = (
        loss.grown_chunk_tokens(base, vocab_size(model), budget // CHUNK_SHARE, (rows or cfg.batch_size) * length)
        if budget
        else base
    )
    if cfg.remat != "auto" or not limit:
        # The policy is the user's (or, with no memory reported, the one default); the loss chunk is
        # still grown where the device has room for it, and falls back to the smallest when not.
        remat = fixed(cfg.remat)
        found = plan(remat, 1, chunk)
        if chunk > base and not fits(found):
            chunk, found = base, plan(remat, 1)
        if found is None:
            raise NothingFits(
                f"train.remat={remat} does not compile for the device: {tried[-1].refused}. {memory.knobs(cfg)}",
                None,
            )
        chosen_by = "fixed" if cfg.remat != "auto" else "no device memory reported"
        return Fit(remat, chunk, 1, found, chosen_by, budget, tried)

    extra = (chunk - base) * vocab_size(model) * loss.CHUNK_BYTES_PER_LOGIT  # beyond the smallest chunk's need
    found, none_entry, none_need = None, None, 0
    for policy in POLICIES:
        if policy == "matmuls" and none_need * MATMULS_OF_NONE > budget:
            tried.append(Candidate(policy, 1, chunk, skipped=_skipped(none_entry, budget)))
            continue
        found = plan(policy, 1, chunk)
        if fits(found):
            return Fit(policy, chunk, 1, found, "auto", budget, tried)
        if chunk > base and tried[-1].least_needed() - extra <= budget:  # the smallest chunk may fit
            found = plan(policy, 1)
            if fits(found):
                return Fit(policy, base, 1, found, "auto", budget, tried)
        if policy == "none":  # fewer rows at a time before any recomputation, where that would fit by estimate
            none_entry, none_need = tried[-1], tried[-1].least_needed()
            split = _none_split(cfg, model, optimizer, found, none_need, budget)
            if split:
                split_plan = plan("none", split)
                if fits(split_plan):
                    return Fit("none", base, split, split_plan, "auto", budget, tried)
    split, found = _split(cfg, model, found, budget, lambda s: plan("layer", s), fits)
    if not fits(found):
        raise NothingFits(
            _nothing_fits(cfg, shape, tried, budget),
            Fit("layer", base, split, found, "auto", budget, tried) if found else None,
        )
    return Fit("layer", base, split, found, "auto", budget, tried)


def _none_split(
    cfg: TrainConfig, model, optimizer, found: memory.MemoryPlan | None, need: int, budget: int
) -> int | None:
    """The fewest micro-batches (at most `MAX_NONE_SPLIT`) per configured one at which `none` would fit by
    estimate (`_least_split`), from its unsplit plan or, where the compiler refused it, its refusal."""
    if not need:
        return None
    if found is not None:
        state, activations = _state_and_activations(found)
    else:  # the refusal's figure is the temporaries alone: the arguments are the weights and optimizer state
        from jaxtune.runtime.compiled import steps

        trained = memory.device_bytes(model.weights)  # the temporaries hold their gradients and accumulator too
        opt_state = steps.optimizer_state_shapes(optimizer, model.weights, model.placement.replicated)
        state = 3 * trained + memory.device_bytes(model.buffers) + memory.device_bytes(opt_state)
        activations = max(need - 2 * trained, 0)
    least = _least_split(state, activations, budget * NONE_SPLIT_MARGIN)
    return next((s for s in _splits(cfg, model) if least and least <= s <= MAX_NONE_SPLIT), None)


def _split(
    cfg: TrainConfig, model, layer_plan: memory.MemoryPlan | None, budget: int, plan, fits
) -> tuple[int, memory.MemoryPlan | None]:
    """(split, plan): the fewest micro-batches per configured one (a divisor of `batch_size` leaving
    each device a row) whose `layer` plan fits, starting from the split the unsplit plan's
    activations suggest; (the last split tried, its plan or None where refused) when none does."""
    splits = _splits(cfg, model)
    least = _least_split(*_state_and_activations(layer_plan), budget) if layer_plan is not None else None
    if least:
        splits = [s for s in splits if s >= least] or splits[-1:]
    last, found = 1, layer_plan
    for split in splits:
        last, found = split, plan(split)
        if fits(found):
            break
    return last, found


def _splits(cfg: TrainConfig, model) -> list[int]:
    """The micro-batch splits of `batch_size` there are: its divisors from 2 that leave each device a row."""
    shards = model.placement.batch_shards
    return [s for s in range(2, cfg.batch_size + 1) if cfg.batch_size % s == 0 and cfg.batch_size // s >= shards]


def _state_and_activations(plan: memory.MemoryPlan) -> tuple[int, int]:
    """A plan's bytes that stay with fewer rows (weights, optimizer state) and those that shrink with them."""
    activations = plan.activations_per_micro_batch
    return plan.needed - activations, activations


def _least_split(state: int, activations: int, room: int) -> int | None:
    """The fewest micro-batches that would bring state + activations / s within `room`, by estimate;
    None where the state alone does not fit or nothing shrinks."""
    return math.ceil(activations / (room - state)) if room > state and activations else None


def _nothing_fits(cfg: TrainConfig, shape: Shape, tried: list[Candidate], budget: int) -> str:
    """One line: what was tried, what it needed, and what would fit (a shorter length, a mesh)."""
    rows, length, _ = shape(cfg)
    last = tried[-1]
    needed = f"needs {_gib(last.needed)}" if last.needed is not None else f"is refused by the compiler ({last.refused})"
    smallest = cfg.batch_size // last.split
    return (
        f"train.batch_size={cfg.batch_size} rows of {length} tokens do not fit the device: even remat layer "
        f"with {smallest} row{'s' * (smallest != 1)} per micro-batch {needed}, and {_gib(budget)} is free "
        f"({HEADROOM:.0%} kept). Try {_what_would_fit(last, length, budget)}, or: {memory.knobs(cfg)}"
    )


def _what_would_fit(last: Candidate, length: int, budget: int) -> str:
    """A length and a number of fsdp devices that would fit by estimate, from the last plan that compiled:
    its activations shrink with the length (about linearly, with attention in tiles), its state
    (weights, gradients, optimizer state) with the devices it is split over."""
    general = (
        "a shorter data.max_length, or more devices on mesh.fsdp "
        "(parameters, gradients and optimizer state split over them)"
    )
    if last.activations is None:
        return general
    activations, state = last.activations, last.needed - last.activations
    found = []
    if state < budget and activations:
        shorter = int(length * (budget - state) / activations) // 128 * 128
        if shorter >= 128:
            found.append(
                f"data.max_length={shorter} (about {_gib(state + activations * shorter / length)} by estimate)"
            )
    if activations < budget:
        devices = math.ceil(state / (budget - activations))
        found.append(f"mesh.fsdp={devices} on {devices} devices (about {_gib(state / devices + activations)} each)")
    return " or ".join(found) if found else general


def fixed(remat: str) -> str:
    """`remat` as one policy without a search: auto is what it is where no memory is reported."""
    return WITHOUT_LIMIT if remat == "auto" else remat


def vocab_size(model) -> int:
    """Rows of the model's output head: the logits per token the loss computes."""
    module = model.module
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    head = base.get_output_embeddings()
    return int(head.weight.shape[0])


def _skipped(none: Candidate, budget: int) -> str:
    need = f"needs {_gib(none.needed)}" if none.needed is not None else f"was refused ({none.refused[:120]})"
    return (
        f"not compiled: remat none {need}, more than {MATMULS_OF_NONE:g}x of which is past the "
        f"{_gib(budget)} budget, and matmuls saves less than that"
    )


def _gib(n: int | None) -> str:
    n = n or 0
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
