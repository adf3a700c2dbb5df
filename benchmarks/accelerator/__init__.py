"""The accelerator benchmark (`make bench-accelerator`, `python -m benchmarks.accelerator.bench`): jaxtune's
train step, decoding and GRPO step against PyTorch eager, torch.compile and Tunix, each side in a child process
of its own (jaxtune_side.py, which runs grpo.py's step, both opening the model as jaxtune_model.py does;
torch_side.py; tunix_side.py), on what shared.py builds; report.py writes the report. tunix_wheels.sh and
tunix_requirements.txt set up Tunix's site folder, gpu_wheels.sh the wheels a GPU image lacks."""
