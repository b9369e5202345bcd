#!/usr/bin/env bash
# Configures and builds moe (Release, -j2) into ${MOE_BUILD_DIR:-build}. Used by the README commands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${MOE_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$BUILD_DIR" -j2
