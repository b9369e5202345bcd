#!/usr/bin/env bash
# The collective watchdog (#32): a rank that waits in one MPI call longer than
# collective_timeout_s ends the job with one line naming the call, the wait and the step, exit
# code 124, instead of hanging for ever behind a stopped rank, and names the rank that did not
# answer (the stopped one). A healthy run with a short limit
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
stopped_rank=$(tr '\0' '\n' <"/proc/$stopped/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
[ -n "$stopped_rank" ] || fail "the stopped process has no OMPI_COMM_WORLD_RANK"
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
grep -Eq "^train_moe: rank [0-9]+: waited [0-9.]+ s in MPI_[A-Za-z]+ \(step [0-9]+\), longer than collective_timeout_s=3: (rank [0-9]+ [^;]+); ending the job \(exit code 124\)$" stuck.log ||
  { cat stuck.log; fail "no watchdog line naming the call, the step and the limit"; }
# The watchdog lines of the other ranks name the stopped rank as the one that gave no answer,
# and no other rank (a rank that got past the call where the others wait may be named as waiting
# elsewhere). Only some line needs to: the first rank to fire ends the job, and mpirun, ending the
# others, sends SIGCONT before SIGTERM, so a rank whose limit runs out just after may see the
# stopped rank answer (seen in CI). The stopped rank's own line is left out for the same reason.
lines=$(grep "waited .* longer than collective_timeout_s" stuck.log |
  grep -v "^train_moe: rank $stopped_rank: " || true)
[ -n "$lines" ] || { cat stuck.log; fail "no watchdog line from a rank that was not stopped"; }
no_answer="gave no answer (stopped, gone or stuck outside MPI)"
if ! grep -q -F "rank $stopped_rank $no_answer" <<<"$lines" ||
  grep -o "rank [0-9]* $no_answer" <<<"$lines" | grep -v -q -F "rank $stopped_rank "; then
  cat stuck.log
  fail "the watchdog lines do not name rank $stopped_rank (stopped) as the only one not answering"
fi
[ "$waited" -le 30 ] || fail "the job took $waited s to end after the stop (limit 3 s)"
# mpirun ends the stopped rank too (a zombie left to the reaper counts as ended).
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null); [ -n "$st" ] && [ "${st:0:1}" != Z ]; }
for _ in $(seq 100); do alive "$stopped" || break; sleep 0.1; done
alive "$stopped" && { kill -9 "$stopped"; fail "the stopped rank outlived the job by 10 s"; }
echo "watchdog ended the job after ${waited} s: $(grep -m1 'waited' stuck.log)"

# 3. The last rank stuck in its own code at step 5 (MOE_TRAIN_TEST_STALL): it answers, and every
# other rank names it as not in an MPI call at that step.
last=$((np - 1))
rc=0
MOE_TRAIN_TEST_STALL=$last:5 timeout 120 "$mpiexec" -np "$np" "${flags[@]}" -x MOE_TRAIN_TEST_STALL \
  "$train" steps=20 "${common[@]}" collective_timeout_s=3 >stall.log 2>&1 || rc=$?
[ "$rc" -eq 124 ] && grep -q "waited" stall.log || { cat stall.log; fail "exit code $rc, expected 124 from the watchdog"; }
n=$(grep -c "longer than collective_timeout_s=3: rank $last is not in an MPI call (step 5); ending the job" stall.log || true)
[ "$n" -ge 1 ] || { cat stall.log; fail "no watchdog line names rank $last as not in an MPI call at step 5"; }
if grep "waited" stall.log | grep -v -q "rank $last is not in an MPI call (step 5)"; then
  cat stall.log
  fail "a watchdog line names another rank than the stalled one"
fi
echo "a stalled rank: $(grep -m1 'waited' stall.log)"
