#!/usr/bin/env bash
# System packages kvd uses on Linux: libopenblas0-pthread (an OpenBLAS built
# with DYNAMIC_ARCH, which picks its kernels for the CPU it runs on: the BLAS
# kvd puts under MLX's CPU backend, daemon/service/blas.py), libgfortran5 (for
# the cmeel-openblas wheel, kvd's fallback on CPUs its build fits) and tmux
# (the kvchat terminal tests).
# Installs only what is missing, and only where apt-get is the package manager.
set -euo pipefail
[ "$(uname -s)" = Linux ] || exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
missing=()
dpkg -s libopenblas0-pthread >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
dpkg -s libgfortran5 >/dev/null 2>&1 || missing+=(libgfortran5)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing system packages: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
