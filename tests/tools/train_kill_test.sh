#!/usr/bin/env bash
# train_moe killed with SIGKILL mid-run (possibly mid-checkpoint) resumes from the last complete
# checkpoint and ends with exactly the losses of an uninterrupted run.
#   train_kill_test.sh TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
set -u
train=$1 work=$2 mpiexec=$3
shift 3
rm -rf "$work" && mkdir -p "$work"
common=(steps=120 log_period=1 dtype=float64 enable_checkpointing=true checkpoint_period=5
        checkpoint_keep=2)
flags=("$@")
# The harness's threads rule: a set OMP_NUM_THREADS is the budget of the whole test (2 ranks).
if [ -n "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( OMP_NUM_THREADS / 2 > 0 ? OMP_NUM_THREADS / 2 : 1 ))
fi
extra=("checkpoint_dir=$work/ref" "metrics_file=$work/ref.jsonl")
"$mpiexec" -np 2 "${flags[@]}" "$train" "${common[@]}" "${extra[@]}" >"$work/ref.log" 2>&1 ||
  { echo "uninterrupted run failed"; cat "$work/ref.log"; exit 1; }
# The summary compares the step time with the expert GEMMs alone (both measured, both > 0).
grep -Eq "^summary: step [0-9.]+ ms; the expert GEMMs of one rank's share alone [0-9.]*[1-9][0-9.]* ms; ratio [0-9.]+$" "$work/ref.log" ||
  { echo "FAIL: no step-time / expert-GEMM summary line"; cat "$work/ref.log"; exit 1; }
# And the memory estimate beside the largest peak resident set (all measured, all > 0).
grep -Eq "^summary: memory per rank: estimate [0-9]+\.[0-9]*[1-9][0-9]* GiB; peak resident set [0-9]+\.[0-9]*[1-9][0-9]* GiB, [0-9]+\.[0-9]*[1-9][0-9]* GiB above the start" "$work/ref.log" ||
  { echo "FAIL: no memory summary line"; cat "$work/ref.log"; exit 1; }
extra=("checkpoint_dir=$work/ck" "metrics_file=$work/killed.jsonl")
for delay in 0.7 1.3 2.1; do
  "$mpiexec" -np 2 "${flags[@]}" "$train" "${common[@]}" "${extra[@]}" >>"$work/killed.log" 2>&1 &
  pid=$!
  sleep "$delay"
  pkill -9 -f "train_moe.*checkpoint_dir=$work/ck" 2>/dev/null
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
done
extra=("checkpoint_dir=$work/ck" "metrics_file=$work/resumed.jsonl")
"$mpiexec" -np 2 "${flags[@]}" "$train" "${common[@]}" "${extra[@]}" >"$work/resumed.log" 2>&1 ||
  { echo "resumed run failed"; cat "$work/resumed.log"; exit 1; }
# Losses of the resumed run's steps must equal the uninterrupted run's, bitwise (same layout).
last_ref=$(grep -o '"step": *[0-9]*, *"loss": *[-0-9.e+]*' "$work/ref.jsonl" | tail -1)
last_res=$(grep -o '"step": *[0-9]*, *"loss": *[-0-9.e+]*' "$work/resumed.jsonl" | tail -1)
echo "uninterrupted: $last_ref"
echo "resumed:       $last_res"
first_res=$(head -1 "$work/resumed.jsonl" | grep -o '"step": *[0-9]*')
echo "resumed run started at $first_res"
[ -n "$last_ref" ] && [ "$last_ref" = "$last_res" ] || { echo "FAIL: losses differ"; exit 1; }
while read -r line; do
  grep -qF -- "$line" "$work/ref.jsonl" || { echo "FAIL: resumed step differs: $line"; exit 1; }
done < <(grep -o '"step": *[0-9]*, *"loss": *[-0-9.e+]*' "$work/resumed.jsonl")
echo "PASS"
