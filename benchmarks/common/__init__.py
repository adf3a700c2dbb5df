"""What the CPU comparisons (benchmarks.cpu) and the accelerator benchmark (benchmarks.accelerator) share: the
harness (settings, logging, timing, result entries, the machine record), the train-step adapter and both sides'
trainers, and PyTorch's greedy decoding."""
