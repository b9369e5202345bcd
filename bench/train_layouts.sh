#!/usr/bin/env bash
# train_moe's default model in every layout of the README table: 20 steps from the same seed at
# 4 ranks (global batch 32 x 64; the 1-rank row uses per_device_batch_size=32 for the same global
# batch), float64, float32 and bfloat16 (MaxText's scheme: bf16 MoE layers, fp32 weights). Writes
# bench/results/train_layouts.md (raw logs next to it).
#   bash bench/train_layouts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${MOE_BUILD_DIR:-build}
bash scripts/build.sh >/dev/null
source bench/train_common.sh
OUT=bench/results/train_layouts.md
LOGS=bench/results/train_layouts.log
: >"$LOGS"
modes=(
  "1 rank|1|per_device_batch_size=32"
  "sparse GMM + ring of experts, EP=4|4|ici_expert_parallelism=-1 use_ring_of_experts=true"
  "sparse GMM + ragged all-to-all, EP=4|4|ici_expert_parallelism=-1"
  "sparse GMM + FSDP=4|4|ici_expert_parallelism=1 ici_fsdp_parallelism=-1"
  "dense + FSDP=4|4|ici_expert_parallelism=1 ici_fsdp_parallelism=-1 sparse_matmul=false"
  "dense + EP=4|4|ici_expert_parallelism=-1 sparse_matmul=false"
  "DP=4|4|ici_expert_parallelism=1 ici_data_parallelism=-1"
  "EP=2 × FSDP=2|4|ici_expert_parallelism=2 ici_fsdp_parallelism=2"
  "shard-exp-on-fsdp, FSDP=4|4|ici_expert_parallelism=1 custom_mesh_and_rule=shard-exp-on-fsdp ici_fsdp_parallelism=-1"
  "ep-tp, EP=4|4|custom_mesh_and_rule=ep-tp ici_expert_parallelism=-1"
)
{
  echo "| mode | final loss f64 / f32 / bf16 | tokens/s/device f64 / f32 / bf16 | step time (f64): GEMMs / comm / rest |"
  echo "|---|---|---|---|"
} >"$OUT"
for m in "${modes[@]}"; do
  IFS='|' read -r name np args <<<"$m"
  declare -A L T
  for dt in float64 float32 bfloat16; do
    # shellcheck disable=SC2086
    log=$(mpirun -np "$np" --oversubscribe --bind-to none "$B/examples/train_moe" steps=20 \
      log_period=100 dtype=$dt $args 2>&1)
    printf '== %s %s\n%s\n' "$name" "$dt" "$log" >>"$LOGS"
    parse_summary "$log"
    L[$dt]=$loss T[$dt]=${tps%.*}
    [ "$dt" = float64 ] && s64=$split
  done
  echo "| $name | ${L[float64]} / ${L[float32]} / ${L[bfloat16]} | ${T[float64]} / ${T[float32]} / ${T[bfloat16]} | $s64 |" >>"$OUT"
done
cat "$OUT"
