#!/usr/bin/env bash
# train_moe of today resumes from a checkpoint written by the code before the format moved into
# include/moe/io/ (tests/data/checkpoint_v1, step 2 of a 4-step run; its README says how it was
# made) and continues that run: the losses of steps 2 and 3 are the ones the writing run printed
# (to 1e-6: another machine or layout may round differently), on 1 rank and on 2 ranks (the
# experts split, so the loaded tensors are cut into other blocks). The checked-in files are
# copied first and never written.
#   train_resume_v1_test.sh TRAIN_MOE CHECKPOINT_V1_DIR WORKDIR MPIEXEC [MPIEXEC flags...]
set -u
train=$1 data=$2 work=$3 mpiexec=$4
shift 4
flags=("$@")
rm -rf "$work" && mkdir -p "$work"
# The harness's threads rule: a set OMP_NUM_THREADS is the budget of the whole test (2 ranks).
if [ -n "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( OMP_NUM_THREADS / 2 > 0 ? OMP_NUM_THREADS / 2 : 1 ))
fi
# The configuration of the run that wrote the checkpoint (README.md), global batch 2.
config=(steps=4 max_target_length=8 base_num_decoder_layers=1 base_emb_dim=8 base_moe_mlp_dim=8
        num_experts=4 num_experts_per_tok=2 enable_checkpointing=true checkpoint_period=2
        checkpoint_keep=2 log_period=1)
# Its losses at steps 2 and 3.
expected=("2 3.2460888300463555" "3 3.2346244530379771")
before=$(cd "$data" && find . -type f -exec sha256sum {} + | sort)
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log; do echo "--- $f"; cat "$f"; done
  exit 1
}

for np in 1 2; do
  ck=$work/ck_np$np
  cp -r "$data" "$ck"
  "$mpiexec" -np "$np" "${flags[@]}" "$train" "${config[@]}" per_device_batch_size=$((2 / np)) \
    "checkpoint_dir=$ck" "metrics_file=$work/np$np.jsonl" >"$work/np$np.log" 2>&1 ||
    fail "train_moe on $np rank(s) failed"
  grep -q "^resumed from checkpoint: step 2 in $ck (written on 1 rank)$" "$work/np$np.log" ||
    fail "$np rank(s): no 'resumed from checkpoint: step 2' line"
  ! grep -q "skipping\|note: this run differs" "$work/np$np.log" ||
    fail "$np rank(s): the checkpoint was skipped or the run differs from the writing one"
  [ "$(head -1 "$work/np$np.jsonl" | grep -o '"step": *[0-9]*')" = '"step": 2' ] ||
    fail "$np rank(s): the run did not start at step 2"
  for e in "${expected[@]}"; do
    set -- $e
    got=$(grep -o "\"step\": *$1, *\"loss\": *[-0-9.e+]*" "$work/np$np.jsonl" | grep -o '[-0-9.e+]*$')
    [ -n "$got" ] || fail "$np rank(s): no loss for step $1"
    awk -v g="$got" -v w="$2" 'BEGIN { d = g - w; if (d < 0) d = -d; exit !(d <= 1e-6 * w) }' ||
      fail "$np rank(s): loss of step $1 is $got, the writing run had $2"
    echo "$np rank(s): step $1 loss $got (writing run: $2)"
  done
done
after=$(cd "$data" && find . -type f -exec sha256sum {} + | sort)
[ "$before" = "$after" ] || fail "the checked-in checkpoint changed"
echo "PASS"
