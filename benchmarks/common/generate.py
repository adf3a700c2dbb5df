"""PyTorch's greedy decoding as both benchmarks time it: `model.generate` on left-padded prompts, every
answer run to its full length."""

from __future__ import annotations


def torch_generate(module, prompts: list[list[int]], n: int, pad: int) -> list[list[int]]:
    """model.generate(do_sample=False) on left-padded prompts (padded to the longest, as a tokenizer would), no eos stop."""
    import torch
    from transformers import GenerationConfig

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p) :] = torch.tensor(p)
        mask[r, longest - len(p) :] = 1
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=[], pad_token_id=pad)
    with torch.no_grad():
        out = module.generate(
            input_ids=ids.to(module.device), attention_mask=mask.to(module.device), generation_config=config
        )
    return out[:, longest:].tolist()
