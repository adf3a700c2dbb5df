"""The TPU check (`python -m benchmarks.tpu.tpu_check`, `make tpu-check`) and the scripts that set up and run
a TPU machine without network: tpu_wheels.sh, tpu_install.sh, v5e_session.sh."""
