"""`jaxtune doctor MODEL`: check that a model computes on JAX what it computes in PyTorch,
and what a training run on it will hold in memory, before a long run is started.

Parity is checked in float32, where any difference beyond ~1e-6 means an op is computed
wrongly rather than rounded differently. The memory plan is XLA's own, for one train step
in the dtype and batch shape the config trains with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxtune.config import JaxtuneConfig
from jaxtune.errors import DoctorError

if TYPE_CHECKING:  # the runtime is imported where a check runs, not with the CLI
    from jaxtune.runtime.measures.memory import MemoryPlan

LOGITS_TOLERANCE = 1e-4  # max |Δ logits|, times max(1, max |logits|)
LOSS_TOLERANCE = 1e-3  # relative
GRADIENT_TOLERANCE = 1e-3  # ‖Δ grad‖ / ‖grad‖ of the worst tensor
DECODE_TOKENS = 32
PROMPT_LENGTHS = (13, 6)
MEMORY_CHECK = "train step memory, peak"
EVAL_CHECK = "eval step memory, peak"
DECODE_CHECK = "decode memory, peak"
CPU_PLAN = (
    "XLA:CPU, which computes bf16 matmuls in float32 and keeps float32 copies of the weights for them: "
    "an accelerator needs less. For an accelerator's own plan: --target v5e-1 (or v6e-1, v5p-8, h100, ...)"
)


@dataclass
class Row:
    check: str
    value: str
    limit: str = ""
    ok: bool | None = None  # None: information, not a check


@dataclass
class Diagnosis:
    model: str
    summary: str
    rows: list[Row] = field(default_factory=list)
    plan_only: bool = False  # a target's memory plan, no parity checked (`jaxtune.checks.target_plan`)

    @property
    def ok(self) -> bool:
        return all(row.ok is not False for row in self.rows)


def diagnose(name: str, config: JaxtuneConfig, revision: str | None = None, tokens: int = 48) -> Diagnosis:
    """Logits, loss, gradients and greedy tokens on JAX vs PyTorch; sizes and XLA's memory plan."""
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import parity
    from jaxtune.runtime.modeling.model import load_torch_model, to_jax

    module = load_torch_model(name, revision, config.model.trust_remote_code, "float32")
    total = sum(p.numel() for p in module.parameters())
    kind = module.config.model_type
    module = as_trained(module, config, randomize_lora=True)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    model = to_jax(module, make_placement(config.mesh))
    method = f"LoRA r={config.lora.r} on {_targets(config)}" if config.train.method == "lora" else "full fine-tuning"
    diagnosis = Diagnosis(model=name, summary=f"{kind}, {method}; parity in float32 on {tokens} tokens")

    batch, labels = _batch(model.config.vocab_size, tokens)
    valid = batch["attention_mask"].astype(bool)
    expected = parity.torch_logits(model, batch)
    logits_diff = float(np.abs(parity.jax_logits(model, batch) - expected)[valid].max())
    logits_limit = LOGITS_TOLERANCE * max(1.0, float(np.abs(expected[valid]).max()))
    diagnosis.rows.append(
        Row("logits max |diff|", f"{logits_diff:.2e}", f"{logits_limit:.1e}", logits_diff <= logits_limit)
    )

    jax_loss, jax_grads = parity.jax_loss_and_grads(model, batch, labels)
    torch_loss, torch_grads = parity.torch_loss_and_grads(model, batch, labels)
    loss_diff = abs(jax_loss - torch_loss) / max(abs(torch_loss), 1e-12)
    diagnosis.rows.append(
        Row(
            "loss relative diff",
            f"{loss_diff:.2e} (loss {torch_loss:.4f})",
            f"{LOSS_TOLERANCE:.0e}",
            loss_diff <= LOSS_TOLERANCE,
        )
    )
    worst, grad_diff = parity.worst_gradient(jax_grads, torch_grads)
    worst = worst.removeprefix("base_model.model.").removesuffix(".default.weight")
    diagnosis.rows.append(
        Row(
            "gradient relative diff",
            f"{grad_diff:.2e} (worst: {worst})",
            f"{GRADIENT_TOLERANCE:.0e}",
            grad_diff <= GRADIENT_TOLERANCE,
        )
    )

    pad = module.config.get_text_config().pad_token_id or 0
    prompts = [row[:n].tolist() for row, n in zip(_rng().integers(0, model.config.vocab_size, (2, 64)), PROMPT_LENGTHS)]
    together = parity.jax_greedy(model, prompts, DECODE_TOKENS, pad)
    matched = sum(
        got == parity.torch_greedy(model.module, prompt, DECODE_TOKENS, pad) for got, prompt in zip(together, prompts)
    )
    diagnosis.rows.append(
        Row(
            "greedy decode == generate",
            f"{matched}/{len(prompts)} prompts x {DECODE_TOKENS} tokens",
            "all",
            matched == len(prompts),
        )
    )

    diagnosis.rows.append(Row("parameters", f"{total:,}"))
    diagnosis.rows.append(Row("trainable parameters", f"{trainable:,} ({100 * trainable / total:.2f}%)"))
    del model, module
    diagnosis.rows += _memory(name, revision, config)
    return diagnosis


def as_trained(module, config: JaxtuneConfig, randomize_lora: bool):
    """The module as the config trains it: LoRA attached (B drawn small and random when
    `randomize_lora`, since at PEFT's B = 0 no A gets a gradient), or every weight trainable."""
    import torch

    from jaxtune.runtime.modeling.model import attach_lora
    from jaxtune.runtime.modeling.quantize import load_base, quantize_base

    if config.train.method == "full":
        return module.requires_grad_(True)
    try:
        module = attach_lora(module, config.lora)
    except ValueError as e:  # a ModelError names the model's linear layers
        raise DoctorError(str(e)) from None
    if config.model.base_quantization == "gguf":  # the file's own blocks, as the quantize_base stage reads them
        from jaxtune.gguf.blocks import read_blocks

        arrays, schemes, _ = read_blocks(config.model.name, module.config)
        load_base(module, {key: torch.from_numpy(value) for key, value in arrays.items()}, schemes)
    elif config.model.base_quantization != "none":
        quantize_base(module, config.model.base_quantization)
    if randomize_lora:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return module


def _targets(config: JaxtuneConfig) -> str:
    targets = config.lora.target_modules
    return targets if isinstance(targets, str) else ",".join(targets)


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _batch(vocab_size: int, tokens: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Two rows of random tokens, the second right-padded to two thirds, so the mask is exercised too."""
    ids = _rng().integers(0, vocab_size, (2, tokens)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 2 * tokens // 3 :] = 0
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return {"input_ids": ids, "attention_mask": mask}, labels


def train_length(config: JaxtuneConfig) -> int:
    """The longest row a train step holds: data.max_length, or for GRPO a prompt of that with its sampled answer."""
    if config.train.objective == "grpo":
        return config.data.max_length + config.rl.max_completion_length
    return config.data.max_length


def train_objective(config: JaxtuneConfig):
    """The objective the train step computes, with its settings (what its batch carries beside the rows)."""
    from jaxtune.runtime.compiled.preference import objective_of

    return objective_of(config.train.objective, config.preference, config.rl)


def _memory(name: str, revision: str | None, config: JaxtuneConfig) -> list[Row]:
    """XLA's plan for one train step at (train.batch_size, data.max_length) in the training dtype."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.measures import fit
    from jaxtune.runtime.modeling.model import load_torch_model, to_jax

    dtype = config.model.model_copy(update={"name": name}).compute_dtype
    module = as_trained(
        load_torch_model(name, revision, config.model.trust_remote_code, dtype), config, randomize_lora=False
    )
    model = to_jax(module, make_placement(config.mesh))
    train = config.train
    try:
        chosen = fit.choose(
            model,
            steps.make_optimizer(train),
            train,
            lambda run: (None, train_length(config), 0),
            objective=train_objective(config),
        )
    except fit.NothingFits as e:  # on a device that reports its memory (an accelerator)
        if e.fit is None:
            return [Row(MEMORY_CHECK, f"does not compile: {e}", "", False)]
        chosen = e.fit
    return _memory_rows(chosen.plan, config, dtype, chosen)


def fit_row(chosen, train) -> Row:
    """How the train step runs on the devices: `train.remat` resolved (see `runtime.measures.fit`)."""
    return Row("train step runs as", chosen.describe(train))


def _memory_rows(plan: MemoryPlan, config: JaxtuneConfig, dtype: str, chosen=None) -> list[Row]:
    """The mesh the plan is for, its peak against the device's memory (FAIL when over), its parts,
    and when it does not fit, a mesh of the same devices that would (or that none would) and the settings to change."""
    from jaxtune.runtime.measures import memory

    train = chosen.train_config(config.train) if chosen else config.train
    shape = (
        f"{dtype}, {train.optimizer}, remat {train.remat}, "
        f"{train.grad_accumulation} x {train.batch_size} x {train_length(config)}"
    )
    limit = size_text(plan.device_limit) if plan.device_limit else "not reported"
    fits = None if not plan.device_limit else plan.peak <= plan.device_limit
    rows = [
        Row("mesh", memory.mesh_text(plan.mesh, plan.devices)),
        *([fit_row(chosen, config.train)] if chosen else []),
        Row(MEMORY_CHECK, f"{size_text(plan.peak)} ({shape})", limit, fits),
        *part_rows(plan),
    ]
    if plan.platform == "cpu":
        rows.append(Row("  planned by", CPU_PLAN))
    if fits is False:
        rows.append(Row("  to fit", memory.advice(plan, train)))
    return rows


def part_rows(plan: MemoryPlan) -> list[Row]:
    """The memory plan's parts, one row each, indented under its peak; the frozen base's linear
    layers under the parameters."""
    rows = [
        Row(f"  {label}", size_text(getattr(plan, key)))
        for label, key in (
            ("parameters", "parameters"),
            ("gradients", "gradients"),
            ("optimizer state", "optimizer_state"),
            ("activations per micro-batch", "activations_per_micro_batch"),
        )
    ]
    if plan.base.get("held"):
        rows.insert(1, Row("    of which frozen base layers", base_text(plan.base)))
    return rows


def base_text(base: dict) -> str:
    """'1.21 GiB as int4 (0.27x of 4.46 GiB in bfloat16); int8 would hold 2.30 GiB', or '4.46 GiB in
    bfloat16; int8 would hold 2.30 GiB, int4 1.19 GiB' (model.base_quantization; by the layers' shapes)."""
    unquantized = f"{size_text(base['unquantized'])} in {base['compute_dtype']}"
    others = [f"{scheme} {size_text(n)}" for scheme, n in base.get("by_scheme", {}).items() if scheme != base["scheme"]]
    would = f"; {others[0].replace(' ', ' would hold ', 1)}{''.join(', ' + o for o in others[1:])}" if others else ""
    if base["scheme"] == "none":
        return unquantized + would
    return (
        f"{size_text(base['held'])} as {base['scheme']} "
        f"({base['held'] / base['unquantized']:.2f}x of {unquantized}){would}"
    )


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def verdict(diagnosis: Diagnosis) -> str:
    """The diagnosis in one line: what fits or agrees, or what does not."""
    failed = {r.check for r in diagnosis.rows if r.ok is False}
    if diagnosis.plan_only:
        if failed:
            return "MEMORY: a step does not fit the target as configured"
        checks = {r.check for r in diagnosis.rows}
        planned = [check.split()[0] for check in (MEMORY_CHECK, EVAL_CHECK, DECODE_CHECK) if check in checks]
        steps = (
            f"{', '.join(planned[:-1])} and {planned[-1]} steps' XLA peaks are"
            if len(planned) > 1
            else f"{planned[0]} step's XLA peak is"
        )
        return f"fits: the {steps} within the target's memory (parity not checked: run doctor without --target)"
    if not failed:
        return "parity ok"
    if failed == {MEMORY_CHECK}:
        return "parity ok, but MEMORY: the train step does not fit the device as configured (see 'to fit')"
    return "PARITY FAILED: do not train on this model until the failing check is understood"


def _cells(diagnosis: Diagnosis) -> list[tuple[str, str, str, str]]:
    return [(r.check, r.value, r.limit, {True: "ok", False: "FAIL", None: ""}[r.ok]) for r in diagnosis.rows]


def render(diagnosis: Diagnosis) -> str:
    """The diagnosis as an aligned text table."""
    head = ("check", "value", "limit", "status")
    rows = _cells(diagnosis)
    widths = [max(len(str(x)) for x in column) for column in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join(
        [
            f"jaxtune doctor: {diagnosis.model} ({diagnosis.summary})",
            line(head),
            line(["-" * w for w in widths]),
            *map(line, rows),
            verdict(diagnosis),
        ]
    )


def render_markdown(diagnosis: Diagnosis) -> str:
    """The diagnosis as a markdown table under its model and summary, its verdict last (a Prefect artifact)."""
    escape = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    rows = [f"| {' | '.join(escape(c) for c in cells)} |" for cells in _cells(diagnosis)]
    return "\n".join(
        [
            f"# {diagnosis.model}",
            "",
            diagnosis.summary,
            "",
            "| check | value | limit | status |",
            "|---|---|---|---|",
            *rows,
            "",
            f"**{verdict(diagnosis)}**",
        ]
    )
