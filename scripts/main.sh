#!/usr/bin/env bash
# The main job: installs dependencies, builds moe and trains the example MoE language model
# (train_moe, built-in default config and dataset) under mpirun -np 2. Extra arguments go to
# train_moe: an optional CFG.yml, then key=value overrides (e.g. steps=100 ici_fsdp_parallelism=-1).
# Before the training lines it prints one "[moe] ..." line per phase (packages, configure, build)
# with its time; the phases' full output is in ${MOE_BUILD_DIR:-build}/moe-setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
moe_log_init
# The main job builds only what it runs (the test command builds everything).
MOE_BUILD_TARGETS=${MOE_BUILD_TARGETS:-train_moe} bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}  # one BLAS thread per rank
# A rank waiting in MPI yields its core instead of spinning: on a busy machine 10x faster steps.
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
cmd=(mpirun -np 2 --oversubscribe --bind-to none "${MOE_BUILD_DIR:-build}/examples/train_moe" "$@")
moe_say "ready after $(moe_elapsed); running: $(moe_quote "${cmd[@]}")"
exec "${cmd[@]}"
