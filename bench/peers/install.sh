#!/usr/bin/env bash
# bench/peers/install.sh: installs the peers Strata is measured against (DeepSpeed, every
# version pinned in bench/peers/requirements.txt) into the project's virtual environment,
# on demand. Not part of scripts/setup.sh or of the tests. Idempotent: a second run checks
# and installs nothing.
#
# DeepSpeed ships as a source distribution that imports torch while it builds, so it is
# built without build isolation against the venv's torch; the project's own pins
# (requirements.txt) constrain the resolution, so installing a peer never changes torch.
# Its C++ ops (DeepSpeedCPUAdam, the async I/O handle) are built just in time on first use;
# the async I/O one needs Debian's libaio-dev, which this script installs when missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${STRATA_VENV:-$root/.venv}
die() {
  echo "bench/peers/install.sh: $*" >&2
  exit 1
}
[ -x "$venv/bin/python" ] || die "no virtual environment at $venv: run scripts/setup.sh first"
# DeepSpeed's async I/O op (bench/peers/io_peers.py) builds against libaio.
if ! dpkg -s libaio-dev >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "bench/peers/install.sh: installing Debian's libaio-dev (DeepSpeed's async I/O op)"
  $sudo apt-get install -y -q libaio-dev >/dev/null || die "apt-get install libaio-dev failed"
fi
if "$venv/bin/pip" install --disable-pip-version-check --dry-run --no-build-isolation \
  -r "$here/requirements.txt" -c "$root/requirements.txt" 2>/dev/null | grep -q "Would install"; then
  echo "bench/peers/install.sh: installing the peers into $venv"
  DS_BUILD_OPS=0 "$venv/bin/pip" install --disable-pip-version-check --no-build-isolation -q \
    -r "$here/requirements.txt" -c "$root/requirements.txt"
fi
"$venv/bin/python" - <<'PY'
import deepspeed, torch
print(f"peers: deepspeed {deepspeed.__version__} on torch {torch.__version__}")
PY
