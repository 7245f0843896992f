# Sourced by the shell tests that start ranks through torchrun (POSIX sh). Sets
#   py        the project's Python: $STRATA_PYTHON (ctest sets it to STRATA_PYTHON_EXECUTABLE),
#             else <repo>/.venv/bin/python (scripts/setup.sh makes it)
#   torchrun  that interpreter's torchrun ($py -m torch.distributed.run)
#   port      a free loopback port for the agent's store (parallel runs do not collide)
# A missing interpreter or torch is an error of the set-up (exit 1), never a skip.
py=${STRATA_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
if ! "$py" -c 'import torch.distributed.run' >/dev/null 2>&1; then
  echo "FAILED: $py cannot import torch.distributed.run (run scripts/setup.sh, or set STRATA_PYTHON)"
  exit 1
fi
torchrun="$py -m torch.distributed.run"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
