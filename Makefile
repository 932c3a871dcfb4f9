# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch==2.13.0: on a machine without a GPU this resolves to a CPU wheel where one is provided
# locally; elsewhere pip takes PyPI's build. Override: make run TORCH_SPEC='torch>=2.6'
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test setup clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

setup: $(BIN)/.installed

run: $(BIN)/.installed
	-$(BIN)/torchplace doctor
	$(BIN)/python examples/train.py --quick

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
