#!/usr/bin/env bash
# Installs everything Strata needs on Debian 12. Idempotent: a second run takes seconds
# and downloads nothing.
#   scripts/setup.sh            the Debian package list (apt-get update first), then the
#                               project's virtual environment .venv (requirements.txt)
#   STRATA_SKIP_APT=1 ...       only report missing Debian packages (no apt-get)
#   STRATA_VENV=DIR             the virtual environment (default: <repo>/.venv)
#
# Debian gives the system libraries and the compilers; PyPI gives PyTorch 2.x (a CUDA 13
# build) and every other Python package, each pinned in requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${STRATA_VENV:-$root/.venv}

# The project's one Debian package list. python3-venv and python3-dev: the virtual
# environment is made from Debian's /usr/bin/python3, and the extension needs its headers.
# clang and libclang-rt-14-dev (libFuzzer, the sanitizers' runtimes): tests/fuzz.
PACKAGES=(
  build-essential cmake ninja-build ccache
  python3-venv python3-dev
  liburing-dev libnuma-dev libhwloc-dev libtbb-dev
  libboost-program-options-dev libgtest-dev libbenchmark-dev
  nlohmann-json3-dev libisal-dev fio
  clang libclang-rt-14-dev
)

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    die "need root to run: $* (run this script as root or install sudo)"
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
elif [ "${#missing[@]}" -eq 0 ]; then
  say "all ${#PACKAGES[@]} Debian packages already installed"
else
  say "apt-get update"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  say "installing ${#missing[@]} Debian package(s): ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
  say "Debian package list installed (${#PACKAGES[@]} packages)"
fi

# The CUDA toolkit is optional: found on PATH or in its default prefix.
nvcc_path=$(command -v nvcc 2>/dev/null || true)
if [ -z "$nvcc_path" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc_path=/usr/local/cuda/bin/nvcc
fi
if [ -n "$nvcc_path" ]; then
  say "CUDA toolkit found: $nvcc_path ($("$nvcc_path" --version | tail -n 1))"
  say "  every CUDA target will be built (STRATA_CUDA=AUTO)"
else
  say "CUDA toolkit not found (no nvcc on PATH or in /usr/local/cuda/bin): CPU-only build"
fi

# ---- the virtual environment -----------------------------------------------------------
py=/usr/bin/python3
[ -x "$py" ] || die "$py is missing (Debian's python3 makes the virtual environment)"
req=$root/requirements.txt
[ -f "$req" ] || die "$req is missing"
stamp=$venv/.strata-requirements
want=$(sha256sum "$req" | cut -d' ' -f1)

venv_ok=0
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import sys' 2>/dev/null; then
  venv_ok=1
fi
if [ "$venv_ok" = 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "virtual environment $venv matches requirements.txt (nothing to install)"
else
  # Before downloading: the CUDA wheels are about 3 GB and unpack to about 7 GB.
  need_kib=$((10 * 1024 * 1024))
  if [ "$venv_ok" = 1 ] && "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    need_kib=$((1 * 1024 * 1024))  # torch is there already: only smaller packages change
  fi
  mkdir -p "$(dirname "$venv")"
  free_kib=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')
  if [ "$free_kib" -lt "$need_kib" ]; then
    die "not enough free disk space for the virtual environment: $((free_kib / 1024)) MiB free on $(df -P "$(dirname "$venv")" | awk 'NR == 2 {print $6}'), $((need_kib / 1024)) MiB needed (torch's CUDA wheels download about 3 GB and unpack to about 7 GB); free some space or set STRATA_VENV to a larger disk"
  fi
  if [ "$venv_ok" != 1 ]; then
    say "creating the virtual environment $venv from $py ($("$py" --version 2>&1))"
    rm -rf "$venv"
    "$py" -m venv "$venv" || die "$py -m venv failed (is python3-venv installed?)"
  fi
  say "installing requirements.txt into $venv (torch's CUDA wheels: about 3 GB on a cold pip cache)"
  start=$(date +%s)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input -r "$req" ||
    die "pip install -r requirements.txt failed"
  echo "$want" >"$stamp"
  say "requirements installed in $(($(date +%s) - start)) s"
fi

"$venv/bin/python" - <<'EOF' || die "the virtual environment's torch does not import"
import torch
print(f"setup: torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}) "
      f"at {torch.__path__[0]}")
EOF
