#!/usr/bin/env bash
# The collective watchdog (#32): a rank that waits in one MPI call longer than
# collective_timeout_s ends the job with one line naming the call, the wait and the step, exit
# code 124, instead of hanging for ever behind a stopped rank. A healthy run with a short limit
# is not disturbed; on one rank there is nothing to wait for (no watchdog).
#   train_watchdog_test.sh RANKS TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
. "$(dirname "$0")/train_test_lib.sh"
common=(dtype=float32 log_period=1)

# 1. A healthy run under a short limit completes.
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=30 "${common[@]}" collective_timeout_s=5 \
  >healthy.log 2>&1 || { cat healthy.log; fail "a healthy run with collective_timeout_s=5 failed"; }
grep -q "waited" healthy.log && { cat healthy.log; fail "the watchdog fired on a healthy run"; }
[ "$np" -ge 2 ] || exit 0

# 2. One rank stopped (SIGSTOP): the others end the job within the limit plus a little.
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=1000000 "${common[@]}" collective_timeout_s=3 \
  "metrics_file=$work/stuck.jsonl" >stuck.log 2>&1 &
job=$!
for _ in $(seq 600); do
  [ "$(cat stuck.jsonl 2>/dev/null | wc -l)" -ge 3 ] && break
  kill -0 "$job" 2>/dev/null || { cat stuck.log; fail "the run ended early"; }
  sleep 0.1
done
stopped=$(pgrep -f "^$train .*metrics_file=$work/stuck.jsonl" | tail -n 1)
[ -n "$stopped" ] || fail "no rank of the run found"
kill -STOP "$stopped"
t0=$(date +%s)
rc=
for _ in $(seq 600); do
  kill -0 "$job" 2>/dev/null || { wait "$job"; rc=$?; break; }
  sleep 0.1
done
kill -CONT "$stopped" 2>/dev/null
if [ -z "$rc" ]; then
  kill -9 "$job" "$stopped" 2>/dev/null
  cat stuck.log
  fail "the job still waits 60 s after a rank was stopped (collective_timeout_s=3)"
fi
waited=$(( $(date +%s) - t0 ))
[ "$rc" -eq 124 ] || { cat stuck.log; fail "exit code $rc, expected 124"; }
grep -Eq "^train_moe: rank [0-9]+: waited [0-9.]+ s in MPI_[A-Za-z]+ \(step [0-9]+\), longer than collective_timeout_s=3: another rank is stopped, gone or stuck; ending the job \(exit code 124\)" stuck.log ||
  { cat stuck.log; fail "no watchdog line naming the call, the step and the limit"; }
[ "$waited" -le 30 ] || fail "the job took $waited s to end after the stop (limit 3 s)"
# mpirun ends the stopped rank too (a zombie left to the reaper counts as ended).
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null); [ -n "$st" ] && [ "${st:0:1}" != Z ]; }
for _ in $(seq 100); do alive "$stopped" || break; sleep 0.1; done
alive "$stopped" && { kill -9 "$stopped"; fail "the stopped rank outlived the job by 10 s"; }
echo "watchdog ended the job after ${waited} s: $(grep -m1 'waited' stuck.log)"
