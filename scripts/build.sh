#!/usr/bin/env bash
# Configures and builds moe (Release, -j2) into ${MOE_BUILD_DIR:-build}. Used by the README commands.
# Extra arguments go to cmake's configure step. Prints one "[moe] ..." line per phase and a compact
# build progress line; cmake's and the compiler's output go to ${MOE_BUILD_DIR:-build}/moe-setup.log
# (MOE_VERBOSE=1 shows it too); MOE_BUILD_TARGETS="a b" builds only those targets. On failure: the log's last lines, its path, a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
moe_log_init
bash scripts/install-deps.sh
BUILD_DIR=${MOE_BUILD_DIR:-build}
moe_phase "configuring (cmake, Release) in $BUILD_DIR/" \
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@"
# MOE_BUILD_TARGETS (space-separated) builds only those targets: main.sh builds just train_moe.
if [ -n "${MOE_BUILD_TARGETS:-}" ]; then
  read -r -a targets <<<"$MOE_BUILD_TARGETS"
  moe_phase "building ${MOE_BUILD_TARGETS} (cmake --build $BUILD_DIR -j2; minutes the first time)" \
    --filter moe_filter_build cmake --build "$BUILD_DIR" -j2 --target "${targets[@]}"
else
  moe_phase "building tools, tests and benchmarks (cmake --build $BUILD_DIR -j2; minutes the first time)" \
    --filter moe_filter_build cmake --build "$BUILD_DIR" -j2
fi
