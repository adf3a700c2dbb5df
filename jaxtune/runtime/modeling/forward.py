"""The model as a pure function of its tensors: logits, or per-token losses that never hold full logits.

Batches are dicts of (b, t) int arrays: `input_ids`, `attention_mask`, and for packed rows
`segment_ids` and `position_ids` (see `packing`). With `fused` (the default for training and
eval), attention runs `attention.fused_attention` and the loss is taken over chunks of tokens
from the last hidden states (`loss.linear_token_nll`), so neither (b, heads, t, t) scores nor
(b, t, vocab) logits outlive one layer or one chunk. Without it the module runs as PyTorch
eager would: transformers' eager attention and full logits (the parity and memory reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from jaxtune.data.tokenize import IGNORE_INDEX
from jaxtune.runtime.modeling import attention
from jaxtune.runtime.modeling.model import JaxModel

# Model types whose causal-LM forward is `logits = lm_head(hidden)`, soft-capped by
# `final_logit_softcapping` where set; the chunked loss reproduces exactly that. Others
# (logit scales, multipliers) keep the full-logits loss.
PLAIN_HEAD_FAMILIES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi",
        "phi3",
        "gpt2",
        "olmo",
        "olmo2",
        "starcoder2",
        "smollm3",
    }
)


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token NLL (b, t-1) from full logits, and which tokens are scored; -100 is not."""
    logits = logits[:, :-1].float()  # (b, t-1, v): fp32 log-softmax whatever the weights' dtype
    target = labels[:, 1:]  # (b, t-1)
    scored = target != IGNORE_INDEX
    logp = torch.log_softmax(logits, dim=-1)
    picked = torch.gather(logp, -1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * scored), scored


def model_kwargs(batch: dict, fused: bool) -> dict:
    """The keywords the model is called with: segment ids travel to every attention layer."""
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    if "position_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"]
    if fused:
        kwargs["segment_ids"] = batch.get("segment_ids", batch["attention_mask"])
    return kwargs


@contextlib.contextmanager
def tracing(model: JaxModel, training: bool, remat: str, fused: bool, weights: dict, buffers: dict):
    """Module state while a step is traced: train mode (dropout), keyed or remat layers, the attention used,
    and stacked layers run as a scan. Yields (the module, all its tensors in the dtypes it computes in,
    the tensors to call it with: those outside the stacks where the layers are stacked)."""
    from jaxtune.runtime.modeling.remat import keyed_layers
    from jaxtune.runtime.modeling.stacked import held

    module = model.module
    module.train(training)
    try:
        with (
            keyed_layers(module, remat) if training or remat != "none" else contextlib.nullcontext(),
            attention.fused(module, fused, model.placement.mesh),
        ):
            tensors = {**model.for_compute(weights), **buffers}
            with held(module, model.layout, tensors) as called_with:
                yield module, tensors, called_with
    finally:
        module.eval()


def forward_logits(model: JaxModel, training: bool = False, remat: str = "none", fused: bool = True) -> Callable:
    """(weights, buffers, batch) -> logits (b, t, vocab), the whole model as a torch function of its tensors."""
    fused = fused and attention.supported(model.module)

    def forward(weights, buffers, batch):
        with tracing(model, training, remat, fused, weights, buffers) as (module, _, called_with):
            return torch.func.functional_call(module, called_with, args=(), kwargs=model_kwargs(batch, fused)).logits

    return forward


def forward_token_nll(
    model: JaxModel,
    training: bool = False,
    remat: str = "none",
    fused: bool = True,
    chunk_tokens: int | None = None,
    temperature: float = 1.0,
) -> Callable:
    """(weights, buffers, batch, labels) -> (per-token NLL (b, t-1) float32, scored (b, t-1) bool), as a torch function.
    `chunk_tokens`: tokens per chunk of the loss (default `loss.chunk_tokens_on` the model's platform).
    `temperature`: of the distribution scored, softmax(logits / temperature) (GRPO scores the answers it
    sampled so); a plain head without bias or softcap takes the hidden states divided by it instead,
    the same logits without materialising them, others full logits."""
    fused = fused and attention.supported(model.module)
    parts = _Parts(model.module) if fused and _plain_head(model.module) else None
    if parts is not None and temperature != 1.0 and not parts.linear_in_hidden:
        parts = None
    if parts is None:
        logits = forward_logits(model, training, remat, fused)
        return lambda weights, buffers, batch, labels: token_nll(
            _tempered(logits(weights, buffers, batch), temperature), labels
        )

    def forward(weights, buffers, batch, labels):
        with tracing(model, training, remat, fused, weights, buffers) as (_, tensors, called_with):
            hidden = parts.hidden(called_with, model_kwargs(batch, fused))  # (b, t, d)
            hidden = _tempered(hidden, temperature)  # a linear head's logits / T
            nll = parts.nll(tensors, hidden, labels, model.placement.mesh.devices.flat[0].platform, chunk_tokens)
        return nll, labels[:, 1:] != IGNORE_INDEX

    return forward


def _tempered(values: torch.Tensor, temperature: float) -> torch.Tensor:
    return values if temperature == 1.0 else values / temperature


def _base(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _plain_head(module: torch.nn.Module) -> bool:
    config = _base(module).config
    return config.model_type in PLAIN_HEAD_FAMILIES and not getattr(config, "logit_scale", None)


class _Parts:
    """The decoder and the output head of a causal LM, each called on its own slice of the model's tensors."""

    def __init__(self, module: torch.nn.Module):
        base = _base(module)
        self.decoder, self.head = base.get_decoder(), base.get_output_embeddings()
        modules = {id(m): name for name, m in module.named_modules()}
        self.decoder_prefix, self.head_prefix = modules[id(self.decoder)] + ".", modules[id(self.head)] + "."
        self.softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
        params = {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}
        plain = type(self.head) is torch.nn.Linear
        self.weight = params[id(self.head.weight)] if plain else None  # tied heads name the embedding
        self.bias = params[id(self.head.bias)] if plain and self.head.bias is not None else None
        # Whether the logits are a linear map of the hidden states (no bias, no softcap): then
        # logits / T are the head applied to hidden / T.
        self.linear_in_hidden = plain and self.bias is None and self.softcap is None

    @staticmethod
    def _slice(tensors: dict, prefix: str) -> dict:
        return {name[len(prefix) :]: value for name, value in tensors.items() if name.startswith(prefix)}

    def hidden(self, tensors: dict, kwargs: dict) -> torch.Tensor:
        out = torch.func.functional_call(
            self.decoder, self._slice(tensors, self.decoder_prefix), args=(), kwargs=kwargs
        )
        return out.last_hidden_state

    def nll(
        self,
        tensors: dict,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        platform: str | None = None,
        chunk_tokens: int | None = None,
    ) -> torch.Tensor:
        from torchax import interop

        from jaxtune.runtime.modeling import loss

        vocab = self.head.out_features if hasattr(self.head, "out_features") else self.head.weight.shape[0]
        chunk = chunk_tokens or loss.chunk_tokens_on(platform, vocab)
        if self.weight is not None:
            bias = tensors[self.bias] if self.bias is not None else None
            return interop.call_jax(
                lambda h, w, y, b: loss.linear_token_nll(h, w, y, bias=b, softcap=self.softcap, chunk_tokens=chunk),
                hidden,
                tensors[self.weight],
                labels,
                bias,
            )
        own = self._slice(tensors, self.head_prefix)

        def head(h):  # a wrapped head (LoRA, modules_to_save): the module itself, on one chunk
            logits = torch.func.functional_call(self.head, own, (h,)).float()
            return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)

        return interop.call_jax(lambda h, y: loss.head_token_nll(h, interop.jax_view(head), y, chunk), hidden, labels)
