"""Typed, frozen configuration: one YAML file maps to one `JaxtuneConfig`.

Unknown keys and bad values raise errors that name the key. Each section is what one
stage's cache key hashes, so a setting lives in the section of the stage it changes.

May import: jaxtune.errors
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jaxtune.errors import ConfigError, first_line

OFFLINE = "offline"
MESH_AXES = ("data", "fsdp", "tensor")  # outermost first: tensor neighbours talk most
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "offline.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


FORMATS = ("dolly", "alpaca", "prompt_completion", "messages", "preference", "prompt_answer")
PREFERENCE_FORMAT = "preference"  # pairs of a chosen and a rejected answer, for train.objective dpo or simpo
PROMPT_ANSWER_FORMAT = "prompt_answer"  # prompts with the answer a reward checks, for train.objective grpo
_SOURCE_KEYS = ("source", "hub_split", "revision", "format", "columns")  # what one source of a mixture sets


class SourceConfig(Section):
    """One source of a mixture (`data.sources`): where its rows are, how they read, and its share."""

    source: str = Field(
        description="'offline', a hub dataset id, a local .jsonl/.json/.parquet/.csv file, or a "
        "folder written by datasets' save_to_disk"
    )
    hub_split: str = Field("train", description="split to read from a hub dataset or a saved DatasetDict")
    revision: str = Field("main", description="hub dataset revision (part of the cache key)")
    format: Literal[FORMATS] = Field(
        "dolly",
        description="row schema: dolly (instruction, context, response, category), alpaca (instruction, "
        "input, output), prompt_completion (prompt, completion), messages (chat turns), preference (prompt or "
        "messages, chosen, rejected: for train.objective dpo or simpo), or prompt_answer (prompt, or messages ending "
        "before the assistant's turn, and the answer a reward checks: for train.objective grpo)",
    )
    columns: dict[str, str] = Field(default_factory=dict, description="rename source columns to the format's names")
    weight: float = Field(
        1.0,
        gt=0.0,
        description="how often each of this source's train rows is seen per epoch on average: 0.5 keeps a "
        "seeded half of them, 2 repeats each twice, 1.5 repeats a seeded half. Eval rows are never weighted",
    )
    max_rows: int | None = Field(None, gt=0, description="read only the first max_rows rows of this source (null: all)")
    name: str | None = Field(
        None, description="its name in stats.json and the report (default: the file name or hub id)"
    )

    @property
    def label(self) -> str:
        """`name`, else a local file's or folder's name (not its path: keys follow content), else the hub id."""
        if self.name:
            return self.name
        path = Path(self.source).expanduser()
        return path.name if self.source != OFFLINE and path.exists() else self.source


class DataConfig(Section):
    """Where rows come from and how they become token sequences."""

    source: str = Field(
        OFFLINE,
        description="'offline' (bundled data), a hub dataset id, a local "
        ".jsonl/.json/.parquet/.csv file, or a folder written by datasets' save_to_disk",
    )
    hub_split: str = Field(
        "train", description="split to read from a hub dataset (also picks one split of a saved DatasetDict)"
    )
    revision: str = Field("main", description="hub dataset revision (part of the cache key)")
    format: Literal[FORMATS] = Field(
        "dolly",
        description="row schema: dolly (instruction, context, response, category), alpaca (instruction, "
        "input, output), prompt_completion (prompt, completion), messages (chat turns), preference (prompt or "
        "messages, chosen, rejected: for train.objective dpo or simpo), or prompt_answer (prompt, or messages ending "
        "before the assistant's turn, and the answer a reward checks: for train.objective grpo)",
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="rename source columns to the format's names, e.g. {instruction: question}"
    )
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of rows held out for eval, split with data.seed"
    )
    max_train_rows: int | None = Field(
        None, gt=0, description="keep at most this many training rows, after the split (null: all)"
    )
    max_eval_rows: int | None = Field(
        None, gt=0, description="keep at most this many eval rows, after the split (null: all)"
    )
    max_length: int = Field(512, ge=8, description="longest row in tokens; what happens to longer ones is `too_long`")
    too_long: Literal["drop", "truncate"] = Field(
        "drop",
        description="rows longer than max_length: drop them, or truncate them to max_length (the answer is cut, "
        "the prompt kept; a row whose prompt alone reaches "
        "max_length is still dropped). Both are counted in stats.json",
    )
    loss_on: Literal["all_assistant", "last_assistant", "all"] = Field(
        "all_assistant",
        description="which tokens the loss covers: every assistant turn of a conversation (all_assistant), only its "
        "final answer (last_assistant), or every token, prompts included (all)",
    )
    packing: bool = Field(
        True,
        description="pack several rows into each training sequence (kept apart by segment ids, positions restarting "
        "per row): one compiled shape and almost no padding. Models whose attention cannot isolate rows train on "
        "padded batches whatever this says. Changes batches, not tokens: only the train stage's key hashes it",
    )
    seed: int = Field(0, description="seed of the train/eval split and of the mixture's sampling")
    sources: tuple[SourceConfig, ...] = Field(
        (),
        description="a mixture: a list of sources, each with source, format, columns, hub_split, revision, weight, "
        "max_rows and name. Rows of every source are deduplicated and split together. Replaces data.source and its "
        "settings, which must then be left unset",
    )
    num_proc: int | None = Field(
        None,
        gt=0,
        description="processes that normalize and tokenize rows (null: one per core, and one per 10,000 "
        "rows at most). Changes how fast, not what: no cache key hashes it",
    )

    @model_validator(mode="after")
    def _one_way_to_name_sources(self) -> DataConfig:
        both = [
            key
            for key in _SOURCE_KEYS
            if getattr(self, key) != type(self).model_fields[key].get_default(call_default_factory=True)
        ]
        if self.sources and both:
            raise ValueError(
                f"data.sources replaces data.{', data.'.join(both)}: set each source's "
                f"{', '.join(both)} inside data.sources"
            )
        return self

    def mixture(self) -> tuple[SourceConfig, ...]:
        """The sources rows are read from: `sources`, or the one that `source` and its settings name."""
        if self.sources:
            return self.sources
        return (SourceConfig(**{key: getattr(self, key) for key in _SOURCE_KEYS}),)


# Families of `jaxtune.offline.architectures`, written out here so reading a config needs no transformers import.
ARCHITECTURES = ("gemma3", "gemma2", "llama", "qwen3", "mistral", "phi3", "gpt2")


class TinyModelConfig(Section):
    """Family and shape of the random model the offline default builds."""

    architecture: Literal[ARCHITECTURES] = Field("gemma3", description=f"model family: {', '.join(ARCHITECTURES)}")
    hidden_size: int = Field(128, description="width of the hidden states")
    intermediate_size: int = Field(512, description="width of each MLP's inner layer")
    num_hidden_layers: int = Field(4, description="decoder layers")
    num_attention_heads: int = Field(4, description="query heads per attention layer")
    num_key_value_heads: int = Field(
        2, description="key/value heads per attention layer (grouped-query attention when fewer than the query heads)"
    )
    head_dim: int = Field(32, description="width of each attention head")
    sliding_window: int = Field(
        64, description="tokens a sliding-window attention layer sees, in the families that have such layers"
    )
    vocab_size: int = Field(1024, description="size of the BPE tokenizer trained on the bundled data")
    tie_word_embeddings: bool = Field(
        False, description="untied, so LoRA's modules_to_save can train input and output embeddings apart"
    )
    seed: int = Field(0, description="seed of the random initial weights")


RECIPE_SUFFIXES = (".yaml", ".yml")


def names_recipe(name: str) -> bool:
    """model.name is an earlier run's recipe: this run starts from what that one exported."""
    return name.lower().endswith(RECIPE_SUFFIXES)


class ModelConfig(Section):
    """The base model: a hub id, a local HF model dir, a LoRA adapter dir, a local .gguf file, an earlier
    run's recipe, or 'offline'."""

    name: str = Field(
        OFFLINE,
        description="'offline', a hub id such as google/gemma-3-1b-it, a local model directory (an earlier run's "
        "export/<key>/merged folder too), a PEFT LoRA adapter directory (an earlier run's export/<key> folder too: "
        "merged once into the base its adapter_config.json names), a local .gguf file (imported once into the "
        "store as an HF folder), or an "
        "earlier run's recipe file (.yaml): that run goes first, up to its export (cached when done), and this one "
        "starts from the model it exported (LoRA merged: the earlier recipe needs export.merge: true)",
    )
    revision: str = Field("main", description="hub revision (part of the cache key)")
    trust_remote_code: bool = Field(False, description="run model code shipped with the checkpoint")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="compute dtype of the weights; 'auto' is bfloat16 for hub and local models, float32 for the "
        "offline model. Trained weights and optimizer state stay float32 either way",
    )
    scan_layers: bool | Literal["auto"] = Field(
        "auto",
        description="hold the decoder layers' tensors stacked, one array per weight and run of alike layers in the "
        "layers' repeating group (one layer for Llama or Qwen, five sliding and one global for Gemma 3), and trace "
        "the group once, as a scan: train and eval steps compile one group, not every layer; the same loss and "
        "gradients up to float32 summation order. Decoding runs each layer on its row of the stacks. Files "
        "(checkpoints, adapters, exports) keep per-layer names. 'auto': stacked over a quantized base "
        "(model.base_quantization), where the unrolled step of an 8B or 12B model never reached a step on a v5e; "
        "unrolled otherwise, a few percent faster a step on a 1B model, slower to compile (docs/training.md)",
    )

    @property
    def layers_stacked(self) -> bool:
        """Whether the decoder layers are held stacked: `scan_layers`, with 'auto' resolved."""
        return self.base_quantization != "none" if self.scan_layers == "auto" else bool(self.scan_layers)

    chat_template: str | None = Field(
        None,
        description="the chat template to format rows and prompts with: 'gemma' (Gemma's own, for base checkpoints "
        "that ship none), a Jinja template string, or null for the tokenizer's own",
    )
    base_quantization: Literal["none", "int8", "int4", "nf4", "gguf"] = Field(
        "none",
        description="LoRA only: hold the frozen base's linear layers (all but the output head) on the device as "
        "int8, int4 or nf4 (QLoRA's NormalFloat4) codes with one bfloat16 scale per block of 64 inputs, dequantized "
        "inside each layer's forward: 0.52x (int8) or 0.27x (int4, nf4) "
        "of a bfloat16 base's bytes; gguf (model.name a .gguf file): "
        "as the file's own Q8_0, Q4_0, Q4_1 and Q5_0 blocks, byte for byte (layers of other types as float weights)",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="family and shape of the offline model")

    @property
    def compute_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.name == OFFLINE else "bfloat16"


class LoraConfig(Section):
    """PEFT LoRA settings, used when train.method is 'lora'."""

    r: int = Field(8, gt=0, description="rank of each adapter: the inner width of its A and B matrices")
    alpha: int = Field(16, gt=0, description="scale of the adapters: each one's update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on each adapter's input while training")
    target_modules: tuple[str, ...] | Literal["all-linear"] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        description="module names to adapt, or 'all-linear' (every linear layer but the output head; needed for "
        "GPT-2's fused c_attn)",
    )
    modules_to_save: tuple[str, ...] = Field(
        (), description="modules trained in full and saved in the adapter, e.g. [embed_tokens, lm_head]"
    )


OBJECTIVES = ("sft", "dpo", "simpo", "grpo")
REMAT_POLICIES = ("none", "matmuls", "layer")  # what a step is compiled with, least recomputation first
REMAT_SETTINGS = ("auto", *REMAT_POLICIES)  # train.remat: a policy, or auto (the runtime chooses one)


class TrainConfig(Section):
    """Optimisation: what is trained, by which optax optimizer and schedule, on how many rows per step."""

    method: Literal["lora", "full"] = Field("lora", description="LoRA adapters (see `lora`), or every weight")
    objective: Literal[OBJECTIVES] = Field(
        "sft",
        description="sft: next-token cross-entropy on the answers; dpo: Direct Preference Optimization against "
        "the reference stage's log-probabilities (data.format: preference, settings in `preference`); simpo: SimPO, "
        "reference-free (no reference stage), on the answers' mean token log-probabilities; grpo: Group Relative "
        "Policy Optimization, sampling answers and scoring them "
        "with rewards (data.format: prompt_answer, settings in `rl`)",
    )
    optimizer: Literal["adamw", "adafactor", "sgd"] = Field(
        "adamw",
        description="adamw; adafactor (factored second moments, no "
        "first moment: far less state); sgd with momentum 0.9",
    )
    learning_rate: float = Field(1e-4, gt=0.0, description="peak learning rate, reached after warmup")
    lr_schedule: Literal["warmup_cosine", "linear", "constant"] = Field(
        "warmup_cosine", description="after linear warmup: cosine decay to 10%, linear decay to 0, or constant"
    )
    warmup_steps: int = Field(10, ge=0, description="steps of linear warmup from 0 to learning_rate")
    weight_decay: float = Field(0.01, ge=0.0, description="decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0.0, description="global-norm gradient clipping")
    max_steps: int | None = Field(100, gt=0, description="optimizer steps; null to train for `epochs` instead")
    epochs: int | None = Field(None, gt=0, description="passes over the training rows (needs max_steps: null)")
    batch_size: int = Field(8, gt=0, description="rows per micro-batch; a multiple of mesh.data x mesh.fsdp")
    grad_accumulation: int = Field(
        1, gt=0, description="micro-batches per optimizer step, summed inside one compiled step"
    )
    remat: Literal[REMAT_SETTINGS] = Field(
        "auto",
        description="what each decoder layer keeps for the backward pass: none (keep every activation); matmuls "
        "(keep the matmul outputs, recompute the elementwise ops between them: a fraction of the memory for little "
        "compute); layer (keep only the layer's input and recompute the whole layer: least memory, one more forward); "
        "auto: the first of none, matmuls, layer whose step XLA compiles to fit the devices' memory, with the loss's "
        "largest chunk that fits, and batch_size split into more micro-batches (grad_accumulation) where even layer "
        "does not fit; matmuls where the devices report no memory (the CPU). A fixed policy that does not fit is "
        "refused before the first step",
    )
    eval_every: int | None = Field(
        None, gt=0, description="steps between eval-loss measurements during training (null: none)"
    )
    checkpoint_every: int = Field(100, gt=0, description="steps between checkpoints a crashed run resumes from")
    checkpoint_minutes: float | None = Field(
        15.0,
        gt=0.0,
        description="minutes of training after which a checkpoint is also written, whatever the step: "
        "the most a hard kill loses (null: by steps alone)",
    )
    seed: int = Field(0, description="data order and dropout")
    log_every: int = Field(10, gt=0, description="steps between host syncs: log lines, progress, the NaN check")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError(
                "set exactly one of train.max_steps and train.epochs "
                "(e.g. --set train.max_steps=null --set train.epochs=2)"
            )
        return self


class PreferenceConfig(Section):
    """The preference objectives' settings (train.objective dpo or simpo); TRL's names and meanings."""

    beta: float = Field(
        0.1,
        gt=0.0,
        description="dpo: how far the policy may move from the reference (the implicit reward is "
        "beta * log(policy / reference)); ipo: its regularisation "
        "tau; simpo: the reward scale (the paper uses 2 to 10)",
    )
    loss_type: Literal["sigmoid", "robust", "ipo"] = Field(
        "sigmoid",
        description="dpo only: sigmoid (the DPO paper's loss), robust (sigmoid with label_smoothing, for "
        "noisy labels: rDPO), or ipo (squared, on the answers' mean token log-ratios)",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="the assumed share of pairs whose labels are flipped: dpo with loss_type robust, or simpo",
    )
    simpo_gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin gamma")
    sft_weight: float = Field(
        0.0,
        ge=0.0,
        description="dpo or simpo: add this times the chosen answer's mean token NLL to each pair's "
        "loss (RPO; TRL's loss_type [sigmoid, sft] with loss_weights [1, w]), so the policy keeps the chosen "
        "answers likely while it separates them from the rejected ones; for dpo less the reference's NLL, a "
        "constant, so the loss still starts at ln 2; 0 turns it off",
    )


RL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


class RLConfig(Section):
    """GRPO's settings (train.objective grpo): TRL's GRPOConfig names, meanings and defaults.

    Each optimizer step samples `num_generations` answers to each of its prompts, scores them with
    `rewards`, and moves the policy toward the answers that beat their group's mean. train.batch_size
    counts answers, as TRL's does: a step's batch_size x grad_accumulation answers are that many over
    num_generations prompts."""

    num_generations: int = Field(
        8, ge=2, description="answers sampled per prompt, the group whose mean reward is each answer's baseline"
    )
    max_completion_length: int = Field(256, gt=0, description="most tokens sampled per answer")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="sample from the most likely tokens whose probabilities reach top_p together (1: all)",
    )
    top_k: int = Field(0, ge=0, description="sample from the top_k most likely tokens (0: all)")
    beta: float = Field(
        0.0,
        ge=0.0,
        description="weight of the KL divergence to the reference policy (the base with "
        "LoRA's adapters off, or a full fine-tune's starting weights); 0 computes no reference",
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="multiply each token's KL term by its policy ratio, which makes its gradient the unbiased "
        "reverse-KL gradient (DeepSeek-V3.2); it changes the gradient even where the ratio is 1",
    )
    epsilon: float = Field(
        0.2, gt=0.0, lt=1.0, description="the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]"
    )
    epsilon_high: float | None = Field(None, gt=0.0, description="the clip's upper side (null: epsilon)")
    num_iterations: int = Field(
        1,
        ge=1,
        description="optimizer steps taken on each sampled batch (mu); above 1 the "
        "policy ratio to the sampling policy and its clip take effect",
    )
    loss_type: Literal[RL_LOSS_TYPES] = Field(
        "dapo",
        description="how token losses are averaged: grpo (per answer, then over answers), bnpo (over the "
        "micro-batch's answer tokens), dr_grpo (over answers x max_completion_length: Dr. GRPO), dapo (over the "
        "step's answer tokens)",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="divide each advantage by the standard deviation of its group's rewards (group), of "
        "the step's rewards (batch), or not at all (none: Dr. GRPO)",
    )
    rewards: tuple[str, ...] = Field(
        ("exact_answer",),
        min_length=1,
        description="reward functions, summed (weighted by reward_weights): exact_answer (1 when the answer's last "
        "number, or its text, equals the row's answer), exact_answer:MARKER (the text after the last MARKER), "
        "format:REGEX (1 when the whole answer matches REGEX), or package.module:function, called with the "
        "prompts, completions and rows of a batch and returning one float each",
    )
    reward_weights: tuple[float, ...] | None = Field(None, description="one weight per reward (null: all 1)")
    mask_truncated_completions: bool = Field(
        False, description="leave answers cut off at max_completion_length out of the loss"
    )

    @model_validator(mode="after")
    def _one_weight_per_reward(self) -> RLConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"rl.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} "
                f"rewards ({', '.join(self.rewards)}): give one each, or null for all 1"
            )
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class EvalConfig(Section):
    """Loss and perplexity on the held-out rows, before and after training."""

    batch_size: int = Field(
        16,
        gt=0,
        description="rows per eval batch; every batch pads to the longest eval row's length bucket, so an "
        "eval compiles one program",
    )


class GenerateConfig(Section):
    """Greedy decoding on held-out prompts, scored by exact match against the reference."""

    num_prompts: int = Field(64, gt=0, description="held-out prompts decoded greedily before and after training")
    max_new_tokens: int = Field(32, gt=0, description="most tokens decoded per answer")
    batch_size: int = Field(
        16,
        gt=0,
        description="prompts decoded together, left-padded to the longest prompt's length bucket (one "
        "decode program per model)",
    )


# The GGUF types jaxtune writes: what the gguf package's numpy quantizers implement (no K-quants).
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


class ExportConfig(Section):
    """How the trained weights leave the store: in which dtype, and for LoRA whether also merged into a full model."""

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the exported tensors")
    merge: bool = Field(
        False,
        description="LoRA only: also write merged/, the adapter (and modules_to_save) folded into the base weights "
        "as a plain HF model for serving (vLLM, llama.cpp converters). A full fine-tune's export already is a "
        "full model, so for it this writes nothing more",
    )
    gguf: list[Literal[GGUF_TYPES]] = Field(
        default_factory=list,
        description="also write the model (LoRA merged in) as GGUF files for llama.cpp and Ollama, one per type "
        f"listed ({', '.join(GGUF_TYPES)}): gguf/<architecture>-<type>.gguf, each with an Ollama Modelfile; "
        "Llama models without RoPE scaling (SmolLM2) and Gemma 3 text models with five sliding-window layers to "
        "one global, checked before training starts",
    )


class MeshConfig(Section):
    """Device mesh: `data` and `fsdp` split the batch; `fsdp` and `tensor` split the parameters.

    None of it is in a cache key: a run computes the same numbers on any mesh.
    """

    data: int = Field(
        -1, description="devices on the data axis, each holding whole parameters (-1: the remaining devices)"
    )
    fsdp: int = Field(
        1,
        description="devices on the fsdp axis: parameters, gradients and optimizer state are split "
        "over it (ZeRO-3), and so is the batch (-1: the remaining devices)",
    )
    tensor: int = Field(
        1,
        description="devices on the tensor axis: each layer's matrices are split over it "
        "(column-parallel q/k/v/gate/up, row-parallel o/down) (-1: the remaining devices)",
    )
    shardings: dict[str, list[str | None]] = Field(
        default_factory=dict,
        description="regex on a parameter's name -> its PartitionSpec, one entry per dimension (an axis name or null), "
        "e.g. {'lm_head\\\\.weight$': [tensor, null]}; the first pattern that matches wins over the built-in rules",
    )
    coordinator: str | None = Field(
        None,
        description="multi-host: host:port of process 0 for jax.distributed (else $JAX_COORDINATOR_ADDRESS, "
        "or found by JAX on a Cloud TPU pod, SLURM, Open MPI or Kubernetes)",
    )
    num_processes: int | None = Field(
        None, ge=1, description="multi-host: processes in the job (else $JAX_NUM_PROCESSES, or found by JAX)"
    )
    process_id: int | None = Field(
        None, ge=0, description="multi-host: this process's index (else $JAX_PROCESS_ID, or found by JAX)"
    )
    distributed: bool = Field(
        False,
        description="call jax.distributed.initialize even with none of the three settings above (a Cloud TPU "
        "pod slice, where JAX finds them itself)",
    )

    @model_validator(mode="before")
    @classmethod
    def _data_takes_what_is_left(cls, values: Any) -> Any:
        """`data` defaults to the remaining devices, unless another axis asks for them (fsdp=-1)."""
        if isinstance(values, dict) and "data" not in values and -1 in (values.get("fsdp"), values.get("tensor")):
            return {**values, "data": 1}
        return values

    @model_validator(mode="after")
    def _size(self) -> MeshConfig:
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if size == 0 or size < -1:
                raise ValueError(f"mesh.{axis} must be a number of devices (1 or more), or -1 for the remaining ones")
        if sum(getattr(self, axis) == -1 for axis in MESH_AXES) > 1:
            raise ValueError("at most one of mesh.data, mesh.fsdp, mesh.tensor can be -1 (the remaining devices)")
        for pattern, spec in self.shardings.items():
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"mesh.shardings: {pattern!r} is not a regular expression ({error})") from None
            bad = [axis for axis in spec if axis is not None and axis not in MESH_AXES]
            if bad:
                raise ValueError(
                    f"mesh.shardings[{pattern!r}]: unknown axis {bad[0]!r}; the axes are "
                    f"{', '.join(MESH_AXES)} (or null for a dimension that is not split)"
                )
        return self

    def sizes(self, devices: int) -> dict[str, int]:
        """{axis: size} on `devices` devices, -1 resolved; ValueError when the axes cannot fit them."""
        fixed = math.prod(getattr(self, axis) for axis in MESH_AXES if getattr(self, axis) != -1)
        named = ", ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)
        if fixed > devices or (-1 in (self.data, self.fsdp, self.tensor) and devices % fixed):
            raise ValueError(
                f"mesh {named} does not fit {devices} device{'s' * (devices != 1)}: the fixed axes "
                f"take {fixed}{', which does not divide them' if fixed <= devices else ''}"
            )
        return {axis: devices // fixed if getattr(self, axis) == -1 else getattr(self, axis) for axis in MESH_AXES}


class StoreConfig(Section):
    """Where artifacts and compiled programs live; none of it is in a cache key."""

    root: str = Field(".jaxtune/store", description="artifact store folder; not part of any cache key")
    compile_cache: bool = Field(
        True,
        description="keep XLA's compiled programs in <root>/xla-cache (or in $JAXTUNE_COMPILE_CACHE, one folder "
        "for every store), so a later run with the same shapes skips compiling; not part of any cache key",
    )


class PlanConfig(Section):
    """The accelerator a config is written for; none of it is in a cache key."""

    target: str | None = Field(
        None,
        description="the chip this config is meant to train on (v5e-1, v5e-8, v6e-1, v5p-8, v4-8, a topology "
        "such as v5e:2x4, or h100, h200, a100): `jaxtune doctor MODEL --config FILE --target` then compiles its train, "
        "eval and decode steps for it, here, without the chips, and says whether they fit (`--target NAME` plans for "
        "another); the plan flow does the same before it queues a run on the chips",
    )


CREDENTIALS_IN_URI = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@", re.IGNORECASE)


def without_credentials(text: str) -> str:
    """`text` with the user and password of every URI in it (`http://user:secret@host`) replaced by ***."""
    return CREDENTIALS_IN_URI.sub(r"\g<scheme>***@", text)


class TrackingConfig(Section):
    """Where a run's curves and numbers also go while and after it trains; none of it is in a cache key."""

    tensorboard: bool = Field(
        False,
        description="write TensorBoard event files (every train scalar, the config, the final figures) into "
        "the train stage's artifact, under tensorboard/",
    )
    mlflow_uri: str | None = Field(
        None,
        description="an MLflow tracking server to log the run to (params, metrics per step, the report and "
        "adapter, the stage keys); unset: $MLFLOW_TRACKING_URI if set, else no MLflow. Credentials belong in "
        "$MLFLOW_TRACKING_URI or $MLFLOW_TRACKING_USERNAME and $MLFLOW_TRACKING_PASSWORD, not here",
    )
    mlflow_experiment: str = Field("jaxtune", min_length=1, description="the MLflow experiment the runs go to")

    @model_validator(mode="after")
    def _no_credentials(self) -> TrackingConfig:
        # The config is a flow parameter, which Prefect records and shows: a password there would leak.
        if self.mlflow_uri and without_credentials(self.mlflow_uri) != self.mlflow_uri:
            raise ValueError(
                "tracking.mlflow_uri holds a user or password, which the run's recorded parameters would "
                "show: give the URI with them in $MLFLOW_TRACKING_URI, or set $MLFLOW_TRACKING_USERNAME "
                "and $MLFLOW_TRACKING_PASSWORD"
            )
        return self

    def mlflow_target(self) -> str | None:
        """The MLflow tracking URI this run logs to, or None for no MLflow."""
        return self.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


class JaxtuneConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    rl: RLConfig = Field(default_factory=RLConfig)

    @model_validator(mode="after")
    def _objective_fits_data(self) -> JaxtuneConfig:
        formats = {src.format for src in self.data.mixture()}
        for special in (PREFERENCE_FORMAT, PROMPT_ANSWER_FORMAT):
            if special in formats and len(formats) > 1:
                raise ValueError(
                    f"data: a mixture cannot mix {special} rows with other formats (got {', '.join(sorted(formats))})"
                )
        pairs, prompts = PREFERENCE_FORMAT in formats, PROMPT_ANSWER_FORMAT in formats
        objective = self.train.objective
        if objective in ("dpo", "simpo") and not pairs:
            raise ValueError(
                f"train.objective={objective} trains on pairs of a chosen and a rejected answer: "
                "set data.format=preference (rows of prompt, chosen, rejected)"
            )
        if objective == "grpo" and not prompts:
            raise ValueError(
                "train.objective=grpo samples answers to prompts and scores them: set "
                "data.format=prompt_answer (rows of prompt and answer)"
            )
        if pairs and objective not in ("dpo", "simpo"):
            raise ValueError(
                "data.format=preference holds pairs for preference tuning: set train.objective=dpo (or simpo)"
            )
        if prompts and objective != "grpo":
            raise ValueError(
                "data.format=prompt_answer holds prompts for reinforcement learning: set train.objective=grpo"
            )
        if objective == "grpo":
            if self.train.max_steps is None:
                raise ValueError(
                    "train.objective=grpo trains for train.max_steps steps, each on answers it samples: "
                    "set train.max_steps (train.epochs counts passes over fixed rows)"
                )
            if self.rl.beta and self.train.method == "lora" and self.lora.modules_to_save:
                raise ValueError(
                    "rl.beta > 0 with LoRA takes the base with the adapters off as the reference, which "
                    "lora.modules_to_save would change: leave modules_to_save empty, or set rl.beta=0"
                )
            answers = self.train.batch_size * self.train.grad_accumulation
            if answers % self.rl.num_generations:
                raise ValueError(
                    f"train.batch_size x train.grad_accumulation ({answers}) counts a step's answers: it "
                    f"must be a multiple of rl.num_generations ({self.rl.num_generations})"
                )
        if self.model.base_quantization != "none" and self.train.method == "full":
            raise ValueError(
                f"model.base_quantization={self.model.base_quantization} needs train.method=lora: a full "
                "fine-tune trains the base weights, which a quantized base holds frozen"
            )
        if self.model.base_quantization == "gguf" and not self.model.name.lower().endswith(".gguf"):
            raise ValueError(
                f"model.base_quantization=gguf keeps a GGUF file's own blocks: model.name must be a .gguf "
                f"file (got {self.model.name!r}); int8, int4 or nf4 quantize any model"
            )
        if self.preference.label_smoothing and self.train.objective == "dpo" and self.preference.loss_type != "robust":
            raise ValueError(
                f"preference.label_smoothing applies to preference.loss_type=robust (got "
                f"{self.preference.loss_type}); set loss_type=robust or label_smoothing=0"
            )
        return self


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> JaxtuneConfig:
    """Read YAML and apply `section.key=value` overrides.

    With no `path`, the bundled offline demo's YAML is the base only while the model stays the
    offline one: its settings (LoRA r=64 on every layer, embeddings trained, lr 3e-3) suit a random
    toy model and would wreck a pretrained one, so `--set model.name=...` alone gets the built-in
    defaults instead: the published recipe's LoRA r=8, alpha 16 on q/k/v/o, AdamW 1e-4.
    """
    if path is None:
        bare = config_from_dict({}, overrides, where="--set")
        if bare.model.name != OFFLINE:
            return bare
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return config_from_dict(raw, overrides, where=str(path))


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line for the parser's several: where it stopped (1-based, as editors count) and why."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return first_line(e)


def config_from_dict(raw: dict[str, Any], overrides: list[str] = (), where: str = "config") -> JaxtuneConfig:
    """Validate `raw` (built-in defaults for every key it leaves out) after applying `overrides`."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        _apply_override(raw, item)
    try:
        return JaxtuneConfig.model_validate(raw)
    except ValidationError as e:
        # One line per bad setting, each naming the file and the key, so whichever comes last is enough.
        problems: dict[str, list[str]] = {}
        for err in e.errors():
            key, problem = _explain(err)
            problems.setdefault(key, []).append(problem)
        lines = [f"{where}: {key + ': ' if key else ''}{' or '.join(p)}" for key, p in problems.items()]
        raise ConfigError("\n".join(lines)) from None


def _explain(err: dict) -> tuple[str, str]:
    """(section.key, what is wrong), with a did-you-mean for a misspelt key and the value given for a bad one."""
    # A union's members add their type to the location (tuple[str, ...]); the user named only the key.
    loc = [str(p) for p in err["loc"] if not any(c in str(p) for c in "[('")]
    key = ".".join(loc)
    if key in RENAMED:
        return key, f"renamed; use {RENAMED[key]}"
    if err["type"] == "extra_forbidden":
        known = _keys_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = (
            f"did you mean {'.'.join([*loc[:-1], close[0]])}?"
            if close
            else f"{'.'.join(loc[:-1]) or 'the top level'} has {', '.join(known)}"
        )
        return key, f"unknown key; {hint}"
    message = err["msg"].removeprefix("Value error, ")
    if "input" in err and err["type"] not in ("missing", "value_error"):
        message += f" (got {err['input']!r})"
    return key, message


RENAMED = {"data.train_on_prompt": "data.loss_on=all (true) or data.loss_on=all_assistant (false)"}


def _keys_at(path: list[str]) -> list[str]:
    """The keys of the config section at `path` (e.g. ["model", "tiny"])."""
    model: type[BaseModel] = JaxtuneConfig
    for part in path:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    try:
        node[leaf] = yaml.safe_load(value)  # YAML typing: 3 -> int, true -> bool, [a, b] -> list
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not YAML ({_yaml_problem(e)})") from None


def section_dict(section: BaseModel) -> dict[str, Any]:
    """The canonical JSON form of a section, as hashed into cache keys."""
    return section.model_dump(mode="json")
