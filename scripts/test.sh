#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds everything, runs ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"  # extra arguments go to cmake, e.g. -DMOE_ENABLE_ONEDNN=OFF
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "${MOE_BUILD_DIR:-build}" --output-on-failure -j2 --timeout 900
