# `make demo`: create .venv, install, run the whole pipeline on the bundled offline default.
# `make test`: create .venv, install with test extras, run the suite (one worker per core, a
# test module per worker: the suite is mostly single-threaded compiling).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: demo test install clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/jaxtune run

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n auto --dist loadscope

clean:
	rm -rf $(VENV) .jaxtune
