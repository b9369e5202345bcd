#!/usr/bin/env bash
# A diverging train_moe run never writes a checkpoint of its divergence and never rotates a good
# one away (#32): a good run saves step 4 (checkpoint_keep=1), a resume at learning_rate=1e15
# diverges. With check_finite=false (the per-step guard) and true (the layers' checks), the run
# exits 2 with one line naming the step and the learning rate, step 4 stays bitwise as it was,
# no other step directory or temporary is left, and the metrics stop before the diverged step.
#   train_diverge_test.sh RANKS TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
. "$(dirname "$0")/train_test_lib.sh"
common=(enable_checkpointing=true checkpoint_period=2 checkpoint_keep=1 checkpoint_dir=ck)
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=4 "${common[@]}" >good.log 2>&1 ||
  { cat good.log; fail "the good run failed"; }
[ -d ck/step_00000004 ] || fail "no step 4 checkpoint: $(ls ck)"
(cd ck && find step_00000004 -type f -exec sha256sum {} + | sort) >sums
for cf in false true; do
  "$mpiexec" -np "$np" "${flags[@]}" "$train" steps=12 learning_rate=1e15 check_finite=$cf \
    metrics_file=m_$cf.jsonl "${common[@]}" >bad_$cf.log 2>&1
  rc=$?
  [ $rc -eq 2 ] || { cat bad_$cf.log; fail "check_finite=$cf: exit $rc, expected 2"; }
  line=$(grep -m1 '^train_moe: error: ' bad_$cf.log)
  [[ $line =~ step\ ([0-9]+)\ \(learning_rate\ [0-9.e+]+\)\ diverged:\ .*not\ applied.*resume ]] ||
    { cat bad_$cf.log; fail "check_finite=$cf: no divergence line naming the step and rate"; }
  step=${BASH_REMATCH[1]}
  [ "$(grep -c '^train_moe: error: ' bad_$cf.log)" -eq "$np" ] ||
    fail "check_finite=$cf: expected one error line per rank"
  [ "$(ls -A ck | sort | tr '\n' ' ')" = "LOCK step_00000004 " ] ||
    fail "check_finite=$cf: checkpoint_dir holds $(ls -A ck | tr '\n' ' ')"
  diff sums <(cd ck && find step_00000004 -type f -exec sha256sum {} + | sort) >/dev/null ||
    fail "check_finite=$cf: the step 4 checkpoint changed"
  last=$(tail -n 1 m_$cf.jsonl | grep -o '"step": [0-9]*' | grep -o '[0-9]*$')
  [ "$last" = $((step - 1)) ] || fail "check_finite=$cf: metrics end at step $last, diverged at $step"
  if grep -q '"loss": null' m_$cf.jsonl; then fail "check_finite=$cf: a non-finite loss was logged"; fi
done
echo "OK: ${np} rank(s): divergence stopped at step $step, step 4 intact"
