#!/usr/bin/env bash
# The main job: set up, build and run strata-train on its embedded default config.
#   scripts/train.sh [strata-train arguments]
#   STRATA_SKIP_SETUP=1, STRATA_BUILD_DIR, STRATA_JOBS as for scripts/test.sh
set -uo pipefail
cd "$(dirname "$0")/.."
build=${STRATA_BUILD_DIR:-build}
jobs=${STRATA_JOBS:-2}
if [ "${STRATA_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh || exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || exit 1
cmake --build "$build" -j "$jobs" --target strata-train || exit 1
exec "$build/bin/strata-train" "$@"
