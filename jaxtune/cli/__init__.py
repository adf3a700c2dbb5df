"""The `jaxtune` command: `main` reads the command line and runs the verb it names; `chat` and
`model_source` are `jaxtune chat` and `jaxtune generate`, and what they open. `python -m
jaxtune.cli` is the same command (`__main__`).

May import: jaxtune.config, jaxtune.errors, jaxtune.artifacts, jaxtune.checks, jaxtune.data, jaxtune.flows, \
jaxtune.host, jaxtune.runtime, jaxtune.tasks
"""
