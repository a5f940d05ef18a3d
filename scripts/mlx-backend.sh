#!/usr/bin/env bash
# Which MLX backend this machine runs, as kvd's pyproject extra names it (mlx's own extras):
#   metal  - macOS (mlx brings Metal by itself; no extra)
#   cuda13 - an NVIDIA GPU that nvidia-smi lists, with a driver >= 580 (what CUDA 13 needs)
#   cuda12 - an NVIDIA GPU with an older driver (mlx[cuda12] needs >= 550.54.14)
#   cpu    - anything else
# The Makefile asks this once per `make`; `make serve MLX=cpu` overrides it.
set -u
if [ "$(uname -s)" = Darwin ]; then echo metal; exit 0; fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)
  major=${driver%%.*}
  if [ -n "$major" ] && [ "$major" -ge 580 ] 2>/dev/null; then echo cuda13; else echo cuda12; fi
  exit 0
fi
echo cpu
