"""The devices a run computes on: the mesh and where each array goes on it (`mesh`, `sharding`),
a multi-host job's processes (`distributed`), compile-only devices of an accelerator this
machine lacks (`targets`), and compiled programs kept on disk (`compile_cache`, JAX's cache asked with a lowered
program; `executables`, whole executables asked before any tracing).

May import: jaxtune.config, jaxtune.errors, jaxtune.host
"""
