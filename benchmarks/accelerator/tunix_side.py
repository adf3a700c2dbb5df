"""Tunix's side of the accelerator benchmark, one child process (`tunix`): a JAX-native peer on the same
chip. Tunix's own Gemma 3 or Llama 3 model (Flax NNX), loaded by its safetensors loader from the very
folder the other sides read, LoRA through qwix with the recipe's rank, alpha and targets, and the
recipe's optimizer in optax, combined as Tunix's PEFT trainer combines them (`nnx.Optimizer` over
`nnx.LoRAParam`, `nnx.value_and_grad` with `nnx.DiffState`, `nnx.jit`).

Its packages come from a site folder of their own, first on sys.path (TUNIX_SITE; see
benchmarks/accelerator/tunix_wheels.sh): only what the step imports, not google-tunix's declared requirements.

What differs from jaxtune's LoRA step, by Tunix's design: no rematerialisation (its default,
RematConfig.NONE; jaxtune's train.remat auto picks one per case), its plain einsum attention over a
(rows, length, length) mask (jaxtune's: its fused attention), the loss over the whole logits at once (jaxtune's is chunked); Gemma's k and
v projections are one fused einsum in Tunix, so qwix gives them one LoRA A between them (PEFT and
jaxtune: one each); qwix makes the adapters in the weights' dtype (bf16 on the chip, so AdamW's state
too; jaxtune keeps both in float32); Tunix's Llama 3 applies no llama3 RoPE scaling (Llama 3.2's factor 32)."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

from benchmarks.accelerator.shared import RECIPES, Results, Settings, jax_memory, measure_cases, train_batch
from benchmarks.common.harness import ROOT

SITE_VARIABLE = "TUNIX_SITE"
DEFAULT_SITE = ROOT / ".tunix-site"  # benchmarks/accelerator/tunix_wheels.sh install's default
# jaxtune's (and PEFT's) LoRA target names -> the modules of Tunix's models they correspond to.
TARGETS = {
    "gemma3_text": {
        "q_proj": ("q_einsum", "qkv_einsum"),
        "k_proj": ("kv_einsum", "qkv_einsum"),
        "v_proj": ("kv_einsum", "qkv_einsum"),
        "o_proj": ("attn_vec_einsum",),
    },
    "llama": {"q_proj": ("q_proj",), "k_proj": ("k_proj",), "v_proj": ("v_proj",), "o_proj": ("o_proj",)},
}


def site() -> Path:
    return Path(os.environ.get(SITE_VARIABLE) or DEFAULT_SITE)


def import_tunix() -> None:
    """Put the site folder first on sys.path, and register `tunix` as a bare package: its __init__ imports
    every trainer and RL learner, and with them grain, TensorFlow Datasets and orbax; its model modules do not."""
    folder = site()
    if not (folder / "tunix").is_dir():
        raise ModuleNotFoundError(
            f"no tunix in {folder} (set {SITE_VARIABLE}, or run benchmarks/accelerator/tunix_wheels.sh install)"
        )
    sys.path.insert(0, str(folder))
    package = types.ModuleType("tunix")
    package.__path__ = [str(folder / "tunix")]
    sys.modules["tunix"] = package


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("google-tunix", "qwix", "flax", "jax", "optax", "safetensors")}


def tunix_config(raw: dict, dtype: str):
    """(Tunix's ModelConfig, the layers' attention kinds or None) of a transformers config.json: for the published
    shapes, Tunix's own `gemma3_1b_pt` and `llama3p2_1b` (tests/test_bench_accelerator.py checks it)."""
    import jax.numpy as jnp

    kind = raw["model_type"]
    if kind == "gemma3_text":
        from tunix.models.gemma3 import model as gemma3

        rope = raw["rope_parameters"]
        if raw["query_pre_attn_scalar"] != raw["head_dim"]:  # Tunix scales queries by 1/sqrt(head_dim) (as the 1B)
            raise ValueError(f"Tunix's Gemma 3 cannot scale queries by 1/sqrt({raw['query_pre_attn_scalar']})")
        config = gemma3.ModelConfig(
            num_layers=raw["num_hidden_layers"],
            num_embed=raw["vocab_size"],
            embed_dim=raw["hidden_size"],
            hidden_dim=raw["intermediate_size"],
            num_heads=raw["num_attention_heads"],
            head_dim=raw["head_dim"],
            num_kv_heads=raw["num_key_value_heads"],
            sliding_window_size=raw["sliding_window"],
            local_base_frequency=rope["sliding_attention"]["rope_theta"],
            global_base_frequency=rope["full_attention"]["rope_theta"],
            param_dtype=jnp.dtype(dtype),
        )
        kinds = tuple(
            gemma3.AttentionType.LOCAL_SLIDING if t == "sliding_attention" else gemma3.AttentionType.GLOBAL
            for t in raw["layer_types"]
        )
        return config, kinds
    if kind == "llama":
        from tunix.models.llama3 import model as llama3

        return llama3.ModelConfig(
            num_layers=raw["num_hidden_layers"],
            vocab_size=raw["vocab_size"],
            embed_dim=raw["hidden_size"],
            hidden_dim=raw["intermediate_size"],
            num_heads=raw["num_attention_heads"],
            head_dim=raw["head_dim"],
            num_kv_heads=raw["num_key_value_heads"],
            rope_theta=int(raw["rope_parameters"]["rope_theta"]),
            norm_eps=raw["rms_norm_eps"],
            weight_tying=raw.get("tie_word_embeddings", False),
        ), None
    raise ValueError(f"the Tunix side runs Gemma 3 and Llama 3 shapes, not {kind}")


def tunix_model(folder: Path, dtype: str):
    """(model, its config.json): Tunix's model of the folder's config, its weights read by Tunix's safetensors loader."""
    import json

    import jax.numpy as jnp

    raw = json.loads((folder / "config.json").read_text())
    config, kinds = tunix_config(raw, dtype)
    if raw["model_type"] == "gemma3_text":
        from tunix.models.gemma3 import model as gemma3
        from tunix.models.gemma3 import params_safetensors

        # Tunix's Gemma 3 cycles this module-level pattern over its layers: the config's own list instead (for the
        # published 1B, the same: 5 local, 1 global; for --tiny's two layers, one of each as on the other sides).
        gemma3.GEMMA3_ATTENTION_PATTERN = kinds
        return params_safetensors.create_model_from_safe_tensors(str(folder), config, dtype=jnp.dtype(dtype)), raw
    from tunix.models.llama3 import params

    return params.create_model_from_safe_tensors(str(folder), config, dtype=jnp.dtype(dtype)), raw


def with_lora(model, kind: str, lora):
    """qwix LoRA on the modules the recipe targets, rank and alpha as the recipe's (adapters from seed 0;
    qwix, as PEFT, starts B at zero, so step 0's loss is the base model's)."""
    import qwix
    from flax import nnx

    names = sorted({name for target in lora.target_modules for name in TARGETS[kind][target]})
    provider = qwix.LoraProvider(
        module_path="|".join(f".*{name}" for name in names), rank=lora.r, alpha=float(lora.alpha)
    )
    return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(0), **model.get_model_input())


def make_optimizer(train):
    """The recipe's optimizer in optax, as jaxtune's `steps.make_optimizer` and `learning_rate_schedule` build it:
    global-norm clipping, then AdamW (optax's betas and epsilon on both sides) on warmup-cosine to 10%."""
    import optax

    warmup = min(train.warmup_steps, train.max_steps - 1)
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, train.learning_rate, warmup),
            optax.cosine_decay_schedule(train.learning_rate, train.max_steps - warmup, alpha=0.1),
        ],
        [warmup],
    )
    return optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm), optax.adamw(schedule, weight_decay=train.weight_decay)
    )


def token_nll(model, tokens):
    """Tunix's default PEFT loss (`peft_trainer._default_loss_fn`): the mean NLL of each next token, every
    position attending causally; taken in float32 (its default takes the logits' dtype) as the other sides do."""
    import jax
    import jax.numpy as jnp

    rows, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (rows, length, length))
    logits, _ = model(tokens, positions, None, mask)  # (rows, length, vocab)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def run(settings: Settings, folder: Path, work: Path) -> None:
    """The LoRA step on every case, each from the same initial adapters and a fresh optimizer."""
    import_tunix()
    import jax
    from flax import nnx

    from jaxtune.config import load_config

    results = Results(work, "tunix")
    device = jax.devices()[0]
    results.add(
        event="device", platform=device.platform, device_kind=device.device_kind, **versions(), site=str(site())
    )
    cfg = load_config(RECIPES["lora"])
    start = time.perf_counter()
    base, raw = tunix_model(folder, settings.dtype)
    model = with_lora(base, raw["model_type"], cfg.lora)
    initial = jax.device_get(nnx.state(model, nnx.LoRAParam))
    results.add(
        event="loaded",
        seconds=time.perf_counter() - start,
        remat="none (Tunix's RematConfig.NONE)",
        lora_parameters=sum(x.size for x in jax.tree.leaves(initial)),
    )

    def prepare(case):
        nnx.update(model, jax.device_put(initial))
        step, plan = train_case(settings, cfg.train, model, raw["vocab_size"], case)
        return step, lambda: {**plan(), **jax_memory(device)}

    measure_cases(results, settings, "tunix", prepare)


def train_case(settings: Settings, train, model, vocab: int, case: tuple[int, int]):
    """(step, plan): step(i) -> loss at i = 0, Tunix's PEFT step (`PeftTrainer._train_step`, less its metrics) on
    batch i; plan() -> XLA's memory plan of that step, as jaxtune's side reports its own (arguments + outputs +
    temporaries - donated), from the program the steps ran (JAX keeps it: lowering it again compiles nothing)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rows, length = case
    optimizer = nnx.Optimizer(model, make_optimizer(train), wrt=nnx.LoRAParam)
    feed = [
        jnp.asarray(train_batch(settings, vocab, rows, length, i)["input_ids"])
        for i in range(1 + settings.warmups + settings.steps)
    ]

    @nnx.jit
    def update(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(token_nll, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, tokens)
        optimizer.update(model, grads)
        return loss

    def step(i: int):
        loss = update(model, optimizer, feed[i])
        jax.block_until_ready((loss, nnx.state(model, nnx.LoRAParam)))
        return float(loss) if i == 0 else None

    def plan() -> dict:
        started = time.perf_counter()
        try:
            stats = update.lower(model, optimizer, feed[0]).compile().memory_analysis()
        except Exception as e:  # noqa: BLE001  (the case's figures stand without its plan)
            return {"plan_error": f"{type(e).__name__}: {e}"[:300]}
        peak = (
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes
        )
        return {
            "plan_peak_bytes": int(peak),
            "plan_code_bytes": int(stats.generated_code_size_in_bytes),
            "plan_seconds": time.perf_counter() - started,
        }

    return step, plan
