#!/usr/bin/env bash
# The wheels the accelerator benchmark (benchmarks/accelerator/bench.py) needs on a GPU image that has torch,
# jax with its CUDA plugin, transformers, peft, optax, safetensors and numpy but not jaxtune's other imports:
# torchax, pydantic (jaxtune.config) and rich (benchmarks/common/harness.py), with their own dependencies the
# image lacks.
# Versions: those `make test` runs with (pyproject.toml's bounds). Into .wheels/ (git-ignored), for
# Python 3.12 on x86-64 Linux, whatever this machine runs; prints the total size.
#
#   benchmarks/accelerator/gpu_wheels.sh             # then, on the GPU machine (see benchmarks/README.md):
#   pip install --no-index --no-deps --target /tmp/site .wheels/*.whl
#   PYTHONPATH=/tmp/site:. python -m benchmarks.accelerator.bench
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    torchax==0.0.13
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
)
rm -rf .wheels
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .wheels "${WHEELS[@]}"
ls -1 .wheels
du -ch .wheels/*.whl | tail -1
