"""jaxtune's benchmarks and the tools around them, each run from the repository's root as a module:

- `benchmarks.cpu`: the comparisons of `make bench` (`python -m benchmarks.cpu.bench`), and the tokenize
  and train stages at scale;
- `benchmarks.accelerator`: one accelerator's benchmark against PyTorch and Tunix (`make bench-accelerator`,
  `python -m benchmarks.accelerator.bench`), and the set-up of its sides;
- `benchmarks.tpu`: the TPU check (`make tpu-check`, `python -m benchmarks.tpu.tpu_check`) and the scripts
  that set up and run a TPU machine;
- `benchmarks.analysis`: reading compiled programs, profiles and plans;
- `benchmarks.common`: what the CPU and accelerator benchmarks share.

`configs/` holds the accelerator benchmark's model shapes, `results/` the committed measurements."""
