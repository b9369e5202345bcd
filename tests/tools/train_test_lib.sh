# Sourced by the train_moe tool tests that take `RANKS TRAIN_MOE WORKDIR MPIEXEC [flags...]`:
# sets np, train, work, mpiexec and flags, starts in a fresh WORKDIR, gives each rank its share
# of a set OMP_NUM_THREADS (the harness's budget for the whole test), and defines fail.
set -u
np=$1 train=$2 work=$3 mpiexec=$4
shift 4
flags=("$@")
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
if [ -n "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( OMP_NUM_THREADS / np > 0 ? OMP_NUM_THREADS / np : 1 ))
fi
# One rank: no other rank for mpirun to end after a non-zero exit (expected in several tests),
# so no grace period in its kill sequence (odls_base_sigkill_timeout, 1 s, otherwise paid twice).
[ "$np" -ne 1 ] || export OMPI_MCA_odls_base_sigkill_timeout=0
fail() { echo "FAIL: $*"; exit 1; }
