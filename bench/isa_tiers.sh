#!/usr/bin/env bash
# The oneDNN backend at each ISA tier of this CPU, compared in one run of this script:
#   bash bench/isa_tiers.sh [ROUNDS] [TIER...]      (defaults: 2 rounds; native and avx2)
# 1. moe_bench --isa=<tier> for the OneDnn gmm/ and layer_fwd/ rows at T=4096 and the decode rows
#    (2 threads, float32, D=1024, F=2816), tiers alternating within each round so that the
#    host's drift falls on every tier alike; each process measures the FMA peak at its own tier.
# 2. The decode rows (T=64, K=2, E=64) at every tier the CPU has, and the gmm/ T=4096 rows (with
#    two layer_fwd/ rows) at the native tier with OMP_NUM_THREADS=1, 8 and 32 (for ref_runs: 8
#    and 32 oversubscribe this machine).
# 3. train_moe's default run (2 ranks) at each tier, alternating, ROUNDS times.
# Writes bench/results/isa_tiers.md (bench/isa_table.py) and the raw JSON and logs under
# bench/results/isa_tiers/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
shift || true
TIERS=("$@")
[ ${#TIERS[@]} -gt 0 ] || TIERS=(native avx2)
B=${MOE_BUILD_DIR:-build}
MOE_BUILD_TARGETS="moe_bench train_moe" bash scripts/build.sh >/dev/null
OUT=bench/results/isa_tiers
rm -rf "$OUT" && mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=passive
FILTER='^(gmm|layer_fwd)/OneDnn/E=(8|64)/(balanced|zipf)/T=(4096|64)/'
for r in $(seq 1 "$ROUNDS"); do
  for t in "${TIERS[@]}"; do
    echo "[isa_tiers] round $r: moe_bench --isa=$t"
    OMP_NUM_THREADS=2 "$B/bench/moe_bench" "--isa=$t" "--benchmark_filter=$FILTER" \
      "--benchmark_out=$OUT/bench_${t}_r$r.json" --benchmark_out_format=json \
      >"$OUT/bench_${t}_r$r.log" 2>&1
  done
done
ALL_TIERS=(sse41 avx avx2 avx512_core avx512_core_vnni avx512_core_bf16 avx512_core_amx)
for t in "${ALL_TIERS[@]}"; do
  echo "[isa_tiers] decode rows at $t"
  OMP_NUM_THREADS=2 "$B/bench/moe_bench" "--isa=$t" '--benchmark_filter=^(gmm|layer_fwd)/OneDnn/E=64/(balanced|zipf)/T=64/' \
    "--benchmark_out=$OUT/decode_$t.json" --benchmark_out_format=json >"$OUT/decode_$t.log" 2>&1 ||
    { echo "[isa_tiers]   $(tail -n 1 "$OUT/decode_$t.log")"; rm -f "$OUT/decode_$t.json"; }
done
for threads in 1 8 32; do
  echo "[isa_tiers] gmm/ and layer_fwd/ rows at $threads threads"
  OMP_NUM_THREADS=$threads "$B/bench/moe_bench" --isa=native \
    '--benchmark_filter=^(gmm/OneDnn/E=(8|64)/(balanced|zipf)|layer_fwd/OneDnn/E=(8/balanced|64/zipf))/T=4096/' \
    "--benchmark_out=$OUT/threads_$threads.json" --benchmark_out_format=json \
    >"$OUT/threads_$threads.log" 2>&1
done
for r in $(seq 1 "$ROUNDS"); do
  for t in "${TIERS[@]}"; do
    echo "[isa_tiers] round $r: train_moe at $t"
    cap=()
    [ "$t" = native ] || cap=("ONEDNN_MAX_CPU_ISA=${t^^}")
    t0=$(date +%s.%N)
    env "${cap[@]}" mpirun -np 2 --oversubscribe --bind-to none "$B/examples/train_moe" \
      >"$OUT/train_${t}_r$r.log" 2>&1
    awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "wall_seconds: %.1f\n", b - a }' \
      >>"$OUT/train_${t}_r$r.log"
  done
done
PY=python3; [ -x /usr/bin/python3 ] && PY=/usr/bin/python3
"$PY" bench/isa_table.py "$OUT" "${TIERS[@]}" >bench/results/isa_tiers.md
cat bench/results/isa_tiers.md
