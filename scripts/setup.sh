#!/usr/bin/env bash
# Installs everything Strata needs on Debian 12. Idempotent: safe to run again.
#   scripts/setup.sh            install the package list (apt-get update first)
#   STRATA_SKIP_APT=1 ...       only report what is there (no installs)
set -euo pipefail

# The project's one package list. DEVELOPERS.md names the same list; keep them equal.
PACKAGES=(
  build-essential cmake ninja-build ccache
  libtorch-dev python3-torch python3-pytest python3-venv
  pybind11-dev python3-pybind11
  liburing-dev libnuma-dev libhwloc-dev libtbb-dev
  libboost-program-options-dev libgtest-dev libbenchmark-dev
  nlohmann-json3-dev libgloo-dev libisal-dev fio
)

say() { printf 'setup: %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    say "need root to run: $* (run this script as root or install sudo)" >&2
    exit 1
  fi
}

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ "${STRATA_SKIP_APT:-0}" = 1 ]; then
  say "STRATA_SKIP_APT=1: not installing; missing packages: ${missing[*]:-none}"
else
  say "apt-get update"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${#missing[@]} package(s): ${missing[*]}"
  else
    say "all ${#PACKAGES[@]} packages already installed; checking for upgrades of the list"
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
  say "package list installed (${#PACKAGES[@]} packages)"
fi

# The CUDA toolkit is optional: found on PATH or in its default prefix.
nvcc_path=$(command -v nvcc 2>/dev/null || true)
if [ -z "$nvcc_path" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc_path=/usr/local/cuda/bin/nvcc
fi
if [ -n "$nvcc_path" ]; then
  say "CUDA toolkit found: $nvcc_path ($("$nvcc_path" --version | tail -n 1))"
  say "  the torch-free CUDA targets will be built (STRATA_CUDA=AUTO)"
else
  say "CUDA toolkit not found (no nvcc on PATH or in /usr/local/cuda/bin): CPU-only build"
fi

py=/usr/bin/python3
if [ -x "$py" ] && "$py" -c 'import torch' >/dev/null 2>&1; then
  say "Python with torch: $py (torch $("$py" -c 'import torch; print(torch.__version__)'))"
else
  say "warning: $py cannot import torch; the Python bindings will not be built" >&2
fi
