"""jaxtune's benchmarks and the tools around them, each run from the repository's root as a module:

- `benchmarks.tpu`: the TPU check (`make tpu-check`, `python -m benchmarks.tpu.tpu_check`) and the scripts
  that set up and run a TPU machine.

`configs/` holds the accelerator benchmark's model shapes, `results/` the committed measurements."""
