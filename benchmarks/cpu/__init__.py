"""The CPU comparisons of `make bench` (`python -m benchmarks.cpu.bench`: jaxtune against PyTorch eager and the
torchax recipe, one module per comparison), and the tokenize and train stages at scale
(`python -m benchmarks.cpu.tokenize_scale`, `python -m benchmarks.cpu.train_memory`)."""
