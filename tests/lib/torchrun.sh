# Sourced by the shell tests that start ranks through torchrun (POSIX sh). Sets
#   torchrun  the command: torchrun on PATH, else /usr/bin/python3 -m torch.distributed.run
#   port      a free loopback port for the agent's store (parallel runs do not collide)
# and exits 77 (ctest's SKIP_RETURN_CODE) with "SKIPPED: <reason>" when there is no torchrun.
# Debian's torchrun 1.13 on Python 3.11 needs --redirects 1 --tee 1 to start at all.
if command -v torchrun >/dev/null 2>&1; then
  torchrun=torchrun
elif /usr/bin/python3 -c 'import torch.distributed.run' >/dev/null 2>&1; then
  torchrun="/usr/bin/python3 -m torch.distributed.run"
else
  echo "SKIPPED: torchrun is not installed (neither torchrun on PATH nor python3 -m torch.distributed.run)"
  exit 77
fi
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
