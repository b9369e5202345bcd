#!/usr/bin/env bash
# Configures and builds moe (Release, -j2) into ${MOE_BUILD_DIR:-build}. Used by the README commands.
# Extra arguments go to cmake's configure step. Prints one "[moe] ..." line per phase and a compact
# build progress line; cmake's and the compiler's output go to ${MOE_BUILD_DIR:-build}/moe-setup.log
# (MOE_VERBOSE=1 shows it too); MOE_BUILD_TARGETS="a b" builds only those targets; MOE_QUICK_BUILD=ON
# compiles the project's tests and tools at -Og, benchmarks at -O0 (CMake option MOE_QUICK_BUILD). On
# failure: the log's last lines, its path, a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
moe_log_init
bash scripts/install-deps.sh
BUILD_DIR=${MOE_BUILD_DIR:-build}
# MOE_QUICK_BUILD=ON (the test command's default) compiles the project's own binaries at -Og;
# passed every time, so a build directory shared by the two commands never keeps the other's.
QUICK=${MOE_QUICK_BUILD:-OFF}
# Ninja for a new build directory: it keeps both cores busy across targets where make leaves one
# idle at target boundaries (a clean build of everything: about 10 % sooner). An existing build
# directory keeps the generator it was made with.
GENERATOR=()
[ -f "$BUILD_DIR/CMakeCache.txt" ] || ! command -v ninja >/dev/null || GENERATOR=(-G Ninja)
moe_phase "configuring (cmake, Release$([ "$QUICK" = ON ] && echo ", quick: -Og")) in $BUILD_DIR/" \
  cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DMOE_QUICK_BUILD="$QUICK" "$@"
# MOE_BUILD_TARGETS (space-separated) builds only those targets: main.sh builds just train_moe.
if [ -n "${MOE_BUILD_TARGETS:-}" ]; then
  read -r -a targets <<<"$MOE_BUILD_TARGETS"
  moe_phase "building ${MOE_BUILD_TARGETS} (cmake --build $BUILD_DIR -j2; minutes the first time)" \
    --filter moe_filter_build cmake --build "$BUILD_DIR" -j2 --target "${targets[@]}"
else
  moe_phase "building tools, tests and benchmarks (cmake --build $BUILD_DIR -j2; minutes the first time)" \
    --filter moe_filter_build cmake --build "$BUILD_DIR" -j2
fi
