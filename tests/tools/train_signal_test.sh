#!/usr/bin/env bash
# Preemption (#32): a save_on_signal signal to one rank of a running train_moe stops every rank
# after the same step with a checkpoint of it, one line, exit code 75; the same command resumes
# it and continues exactly the uninterrupted run (float64 losses bitwise); a second signal ends
# the job at once; SIGUSR1 to mpirun itself is forwarded and stops the job the same way.
#   train_signal_test.sh RANKS TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
. "$(dirname "$0")/train_test_lib.sh"
common=(dtype=float64 log_period=1 enable_checkpointing=true checkpoint_period=100000
        learning_rate_schedule_steps=100000)
# Starts a long run in the background (pid in $job) and waits until it has logged 3 steps.
start() {  # start DIR [key=value...]
  local dir=$1
  shift
  # checkpoint_dir is absolute: rank_pid must find this test's ranks, not a concurrent test's.
  "$mpiexec" -np "$np" "${flags[@]}" "$train" steps=100000 "${common[@]}" "checkpoint_dir=$work/$dir" \
    "metrics_file=$dir.jsonl" "$@" >"$dir.log" 2>&1 &
  job=$!
  for _ in $(seq 600); do
    [ "$(cat "$dir.jsonl" 2>/dev/null | wc -l)" -ge 3 ] && return 0
    kill -0 "$job" 2>/dev/null || { cat "$dir.log"; fail "$dir: the run ended early"; }
    sleep 0.1
  done
  fail "$dir: no steps after 60 s"
}
# Waits up to 60 s for the background run; sets $rc.
finish() {
  for _ in $(seq 600); do
    kill -0 "$job" 2>/dev/null || { wait "$job"; rc=$?; return 0; }
    sleep 0.1
  done
  kill -9 "$job"; fail "the job did not end within 60 s of the signal (a hang)"
}
rank_pid() { pgrep -f "^$train .*checkpoint_dir=$work/$1( |$)" | head -n 1; }

# 1. SIGTERM to one rank only.
start ck
kill -TERM "$(rank_pid ck)"
finish
[ "$rc" -eq 75 ] || { cat ck.log; fail "SIGTERM: exit $rc, expected 75"; }
line=$(grep '^train_moe: stopped by SIGTERM after step' ck.log)
[[ $line =~ after\ step\ ([0-9]+):\ saved\ checkpoint\ step\ ([0-9]+)\ in\ $work/ck ]] ||
  { cat ck.log; fail "no 'stopped by SIGTERM ... saved checkpoint' line"; }
last=${BASH_REMATCH[1]} saved=${BASH_REMATCH[2]}
[ "$saved" -eq $((last + 1)) ] || fail "stopped after step $last but saved step $saved"
[ -d "ck/$(printf 'step_%08d' "$saved")" ] || fail "no checkpoint directory for step $saved: $(ls ck)"
[ "$(tail -n 1 ck.jsonl | grep -o '"step": [0-9]*' | grep -o '[0-9]*$')" = "$last" ] ||
  fail "the metrics do not end at step $last"
ls -A ck | grep -q '^\.tmp' && fail "a temporary directory was left: $(ls -A ck)"

# 2. The same command resumes it; the losses continue the uninterrupted run bitwise.
end=$((saved + 2))
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=$end "${common[@]}" checkpoint_dir=$work/ck \
  metrics_file=resumed.jsonl >resumed.log 2>&1 || { cat resumed.log; fail "the resume failed"; }
grep -q "^resumed from checkpoint: step $saved in $work/ck" resumed.log || fail "did not resume at $saved"
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=$end "${common[@]}" checkpoint_dir=ref \
  metrics_file=ref.jsonl >ref.log 2>&1 || { cat ref.log; fail "the reference run failed"; }
losses() { grep -o '"step": [0-9]*, "loss": [-0-9.e+]*' "$1"; }
diff <(losses ref.jsonl | tail -n 2) <(losses resumed.jsonl | tail -n 2) ||
  fail "the resumed steps differ from the uninterrupted run"

# 3. A second signal ends the job at once, inside the step the first one let finish (steps of
#    ~0.5 s here; two signals sent back to back would merge while pending).
start twice base_emb_dim=256 base_moe_mlp_dim=1024 max_target_length=128
pid=$(rank_pid twice)
kill -TERM "$pid"; sleep 0.05; kill -TERM "$pid"
finish
[ "$rc" -ne 0 ] && [ "$rc" -ne 75 ] || { cat twice.log; fail "two signals: exit $rc"; }
grep -q 'stopping at once on a signal' twice.log || { cat twice.log; fail "no 'stopping at once' line"; }

# 4. SIGUSR1 to mpirun is forwarded to the ranks.
start usr1
kill -USR1 "$job"
finish
[ "$rc" -eq 75 ] || { cat usr1.log; fail "SIGUSR1 to mpirun: exit $rc, expected 75"; }
grep -q '^train_moe: stopped by SIGUSR1 after step' usr1.log || { cat usr1.log; fail "no SIGUSR1 stop line"; }
echo "OK: $np rank(s): stopped after step $last, saved $saved, resumed bitwise"
