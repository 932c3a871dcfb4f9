# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch==2.13.0: on a machine without a GPU this resolves to a CPU wheel where one is provided
# locally; elsewhere pip takes PyPI's build. Override: make run TORCH_SPEC='torch>=2.6'
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test lint docs setup clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

setup: $(BIN)/.installed

run: $(BIN)/.installed
	-$(BIN)/torchplace doctor
	$(BIN)/python examples/train.py --quick

# pytest-xdist: one worker a core (PYTEST_WORKERS=0 runs in this process); --dist loadgroup keeps the tests
# that share a module-wide fixture in one worker (tests/conftest.py), so it is built once
PYTEST_WORKERS ?= auto

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup
	$(MAKE) --no-print-directory lint

# static checks (part of `make test`): ruff on the code, mypy on the library (settings in pyproject.toml)
lint: $(BIN)/.installed
	$(BIN)/ruff check src tests examples tools
	$(BIN)/mypy

# the docs site (mkdocs.yml) into build/site; --strict fails on a broken link, anchor or docstring.
# CI (.ci/run) runs it after `make test`; `$(BIN)/mkdocs serve` previews it while editing
docs: $(BIN)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

$(BIN)/.docs-installed: $(BIN)/.installed
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[docs]"
	touch $@

clean:
	rm -rf $(VENV)
