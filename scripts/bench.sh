#!/usr/bin/env bash
# Runs the benchmark suites and plots them: bench/results/moe_bench.json (+ .png, .md) and, under
# mpirun -np 2, bench/results/moe_bench_mpi_np2.json. Extra args go to moe_bench (e.g. a filter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
B=${MOE_BUILD_DIR:-build}
mkdir -p bench/results
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
"$B/bench/moe_bench" --benchmark_out=bench/results/moe_bench.json --benchmark_out_format=json "$@"
PY=python3; [ -x /usr/bin/python3 ] && PY=/usr/bin/python3  # Debian's, which has python3-matplotlib
"$PY" bench/plot_bench.py bench/results/moe_bench.json -o bench/results/moe_bench.png \
  --table bench/results/moe_bench.md >/dev/null
if [ -x "$B/bench/moe_bench_mpi" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OPENBLAS_NUM_THREADS=1 mpirun -np 2 --oversubscribe --bind-to none "$B/bench/moe_bench_mpi" \
    --benchmark_out=bench/results/moe_bench_mpi_np2.json --benchmark_out_format=json >/dev/null
fi
echo "results in bench/results/"
