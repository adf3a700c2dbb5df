"""What jaxtune checks before a long run starts: `doctor` (a model computes on JAX what it
computes in PyTorch, and what training it holds in memory), `target_plan` (XLA's plan of the
steps on an accelerator this machine does not have) and `preflight` (the files a config names
exist and the mesh splits every batch).

May import: jaxtune.config, jaxtune.errors, jaxtune.data, jaxtune.gguf, jaxtune.rewards, jaxtune.runtime, jaxtune.tasks
"""
