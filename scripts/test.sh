#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds everything, runs ctest.
# Shows the build's whole output (MOE_VERBOSE=1 unless set; MOE_VERBOSE=0 gives main.sh's compact
# progress) besides the "[moe] ..." phase lines; the log is ${MOE_BUILD_DIR:-build}/moe-setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
export MOE_VERBOSE=${MOE_VERBOSE:-1}
# -Og (about a third of the build time of -O3; the suite checks results, not speed) and no plotting
# packages: the whole command stays well under CI's 20 minutes on 2 cores.
export MOE_QUICK_BUILD=${MOE_QUICK_BUILD:-ON} MOE_PLOTTING=${MOE_PLOTTING:-0}
moe_log_init
bash scripts/build.sh "$@"  # extra arguments go to cmake, e.g. -DMOE_ENABLE_ONEDNN=OFF
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
moe_say "built after $(moe_elapsed); testing (ctest -j2)"
start=$(moe_now_us)
rc=0
ctest --test-dir "${MOE_BUILD_DIR:-build}" --output-on-failure -j2 --timeout 900 || rc=$?
if [ "$rc" -eq 0 ]; then
  moe_say "tests passed in $(moe_span $(($(moe_now_us) - start)))"
else
  moe_say "ctest failed (exit $rc) after $(moe_span $(($(moe_now_us) - start)))" >&2
fi
exit "$rc"
