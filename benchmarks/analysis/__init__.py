"""Reading what XLA compiles and what a profile records, without running a benchmark: a train step's optimized
HLO by kernel (step_hlo.py), a jax.profiler trace by category (profile_breakdown.py, which the accelerator
benchmark's --profile uses), every recipe's plan on rented chips (recipe_plans.py, docs/planning.md's table),
and splash attention's memory plan on a v5e (splash_plan.py). Each runs as `python -m benchmarks.analysis.NAME`."""
