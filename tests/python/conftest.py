"""pytest set-up: finds the built package (STRATA_BUILD_DIR, default <repo>/build)."""

import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("STRATA_BUILD_DIR", REPO / "build")).resolve()

python_dir = BUILD / "python"
if python_dir.is_dir() and str(python_dir) not in sys.path:
    sys.path.insert(0, str(python_dir))
