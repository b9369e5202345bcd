#!/usr/bin/env bash
# Step time of train_moe per partition mode against its yardstick: the expert GEMMs of one rank's
# share of a step run alone (train_moe measures both; see "summary: step ..." in its output).
#   bash bench/train_perf.sh [NP] [CFG.yml]      (defaults: 2 ranks, examples/train_moe/perf.yml)
# Writes bench/results/train_perf_np<NP>.md (and the raw logs next to it). One BLAS thread per rank.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-2}
CFG=${2:-examples/train_moe/perf.yml}
B=${MOE_BUILD_DIR:-build}
bash scripts/build.sh >/dev/null
source bench/train_common.sh
OUT=bench/results/train_perf_np$NP.md
LOGS=bench/results/train_perf_np$NP.log
: >"$LOGS"
modes=(
  "sparse GMM + ring of experts, EP=$NP|ici_expert_parallelism=-1 use_ring_of_experts=true"
  "sparse GMM + ragged all-to-all, EP=$NP|ici_expert_parallelism=-1"
  "sparse GMM + FSDP=$NP|ici_expert_parallelism=1 ici_fsdp_parallelism=-1"
  "dense + FSDP=$NP|ici_expert_parallelism=1 ici_fsdp_parallelism=-1 sparse_matmul=false"
  "dense + EP=$NP|ici_expert_parallelism=-1 sparse_matmul=false"
  "DP=$NP|ici_expert_parallelism=1 ici_data_parallelism=-1"
)
{
  echo "train_moe, $CFG, $NP ranks on $(nproc) cores, one BLAS thread per rank ($(date -u +%F))."
  echo "ratio = step time / yardstick; yardstick = the expert GEMMs (3 forward + 6 backward per"
  echo "layer) of one rank's share of the step (tokens per rank x top-k rows over all experts),"
  echo "run alone at the end of the same run."
  echo
  echo "| mode | tokens/s/device | step (ms) | yardstick (ms) | ratio | GEMMs / comm / rest |"
  echo "|---|---:|---:|---:|---:|---|"
} >"$OUT"
for m in "${modes[@]}"; do
  name=${m%%|*}
  args=${m#*|}
  # shellcheck disable=SC2086
  log=$(mpirun -np "$NP" --oversubscribe --bind-to none "$B/examples/train_moe" "$CFG" $args 2>&1)
  printf '== %s\n%s\n' "$name" "$log" >>"$LOGS"
  parse_summary "$log"
  echo "| $name | $tps | $step | $yard | $ratio | $split |" >>"$OUT"
done
cat "$OUT"
