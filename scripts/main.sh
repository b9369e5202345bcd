#!/usr/bin/env bash
# The main job: builds moe and runs moe-layer-run on its built-in example case under mpirun.
# Extra arguments are passed to moe-layer-run as key=value overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun -np 1 --oversubscribe "${MOE_BUILD_DIR:-build}/examples/moe-layer-run" --example "$@"
