#!/usr/bin/env bash
# train_moe for a few steps with oneDNN capped to one ISA tier (ONEDNN_MAX_CPU_ISA=TIER), on 2
# ranks: it must run at that tier, end with a finite loss, and report that no oneDNN reference
# implementation ran (its "summary: gemm kernels" line; no warning). A tier above this CPU's skips
# with a message (ctest's SKIP_REGULAR_EXPRESSION).
#   train_isa_test.sh TIER TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
set -u
tier=$1 train=$2 work=$3 mpiexec=$4
shift 4
flags=("$@")
rm -rf "$work" && mkdir -p "$work"
# The harness's threads rule: a set OMP_NUM_THREADS is the budget of the whole test (2 ranks).
if [ -n "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( OMP_NUM_THREADS / 2 > 0 ? OMP_NUM_THREADS / 2 : 1 ))
fi
log=$work/train.log
fail() {
  echo "FAIL: $*"
  cat "$log"
  exit 1
}
want=$(echo "$tier" | tr '[:upper:]' '[:lower:]')
ONEDNN_MAX_CPU_ISA=$tier timeout 300 "$mpiexec" -np 2 "${flags[@]}" "$train" steps=20 log_period=10 \
  >"$log" 2>&1
rc=$?
runs=$(sed -n 's/^gemm: oneDNN [0-9.]* \([a-z0-9_]*\),.*/\1/p' "$log" | head -n 1)
if [ -n "$runs" ] && [ "$runs" != "$want" ]; then
  echo "moe: ISA tier $want skipped: above this CPU, whose oneDNN runs $runs"
  exit 0
fi
[ "$rc" -eq 0 ] || fail "train_moe exited with $rc"
[ -n "$runs" ] || fail "no 'gemm: oneDNN ...' line"
kernels=$(grep '^summary: gemm kernels (rank 0) ' "$log") || fail "no gemm kernels summary"
echo "$kernels"
case $kernels in
  *"(rank 0) $want: "*) ;;
  *) fail "the kernels summary is not at tier $want" ;;
esac
case $kernels in
  *", 0 reference runs") ;;
  *) fail "a oneDNN reference implementation ran on rank 0" ;;
esac
! grep -q "reference implementation" "$log" || fail "a reference implementation ran (warning)"
grep -Eq '^summary: final loss [0-9]+\.[0-9]+ ' "$log" || fail "no finite final loss"
grep '^summary: final loss' "$log"
echo "ok: train_moe at $want"
