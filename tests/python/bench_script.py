"""Runs a program of bench/ as its smoke tests do: this interpreter with the tests' import
path (strata and torch as the test sees them), in the test's directory, output captured."""

import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def run(script, args, cwd, timeout=300, omp_threads=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)
