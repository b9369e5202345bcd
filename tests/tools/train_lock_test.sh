#!/usr/bin/env bash
# Two train_moe jobs pointed at one checkpoint_dir: the second fails within seconds, before it reads
# or writes anything, with an error naming the first (the lock's holder), and the first job's
# checkpoints are untouched; once the first job is killed (SIGKILL), the next job takes the
# directory at once (no stale lock).
#   train_lock_test.sh TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
set -u
train=$1 work=$2 mpiexec=$3
shift 3
flags=("$@")
rm -rf "$work" && mkdir -p "$work"
ck=$work/ck
# The harness's threads rule: a set OMP_NUM_THREADS is the budget of the whole test (2 ranks).
if [ -n "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( OMP_NUM_THREADS / 2 > 0 ? OMP_NUM_THREADS / 2 : 1 ))
fi
common=(log_period=1 enable_checkpointing=true "checkpoint_dir=$ck" checkpoint_keep=1)
job() { "$mpiexec" -np 2 "${flags[@]}" "$train" "${common[@]}" "$@"; }
fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log; do echo "--- $f"; cat "$f"; done
  exit 1
}
snapshot() { (cd "$ck" && find . -type f ! -name LOCK -exec sha256sum {} + | sort); }

holder=""
stop_holder() {  # the holder's mpiexec and its ranks, by process id
  [ -n "$holder" ] || return 0
  local ranks
  ranks=$(pgrep -P "$holder" 2>/dev/null)
  kill -9 "$holder" $ranks 2>/dev/null
  wait "$holder" 2>/dev/null
  holder=""
}
trap stop_holder EXIT

# 1. A first job saves step 2, then goes on (resumed from step 2) with no save for a long time.
job steps=2 >"$work/first.log" 2>&1 || fail "the first job failed"
job steps=1000000 checkpoint_period=1000000 >"$work/holder.log" 2>&1 &
holder=$!
for _ in $(seq 1 600); do
  grep -q "^completed step: 2," "$work/holder.log" && break
  kill -0 "$holder" 2>/dev/null || fail "the holding job ended"
  sleep 0.1
done
grep -q "^completed step: 2," "$work/holder.log" || fail "the holding job did not start in 60 s"
holder_pid=$(sed -n 's/^pid=//p' "$ck/LOCK")
[ -n "$holder_pid" ] || fail "LOCK names no holder: $(cat "$ck/LOCK")"
before=$(snapshot)

# 2. A second job on the same directory (it would resume from step 2, save 3 and 4 and prune step
#    2): refused within seconds, naming the holder, on every rank; nothing in the directory changes.
t0=$(date +%s%N)
timeout 120 "$mpiexec" -np 2 "${flags[@]}" "$train" "${common[@]}" steps=4 checkpoint_period=1 \
  >"$work/second.log" 2>&1
rc=$?
seconds=$(( ($(date +%s%N) - t0) / 1000000000 ))
echo "second job: exit code $rc after ${seconds} s"
[ "$rc" -ne 0 ] || fail "the second job succeeded"
[ "$rc" -ne 124 ] || fail "the second job did not stop"
[ "$seconds" -lt 20 ] || fail "the second job took ${seconds} s to fail"
want="train_moe: error: checkpoint_dir '$ck' is in use by another job (hostname=$(uname -n), pid=$holder_pid, since="
[ "$(grep -cF -- "$want" "$work/second.log")" -eq 2 ] || fail "no error naming the holder on both ranks"
grep -qF "two jobs must not share a checkpoint directory" "$work/second.log" ||
  fail "the error does not say what to do"
! grep -Eq "^(resumed from checkpoint|completed step|saved checkpoint)" "$work/second.log" ||
  fail "the second job ran"
[ "$(snapshot)" = "$before" ] || fail "the checkpoints changed: $(snapshot)"
kill -0 "$holder" 2>/dev/null || fail "the holding job died"
[ "$(sed -n 's/^pid=//p' "$ck/LOCK")" = "$holder_pid" ] || fail "LOCK changed: $(cat "$ck/LOCK")"

# 3. The holder's rank 0 is killed with SIGKILL: the next job takes the directory and continues
#    from step 2.
kill -9 "$holder_pid"
for _ in $(seq 1 150); do
  kill -0 "$holder" 2>/dev/null || break
  sleep 0.1
done
stop_holder
job steps=4 checkpoint_period=1 >"$work/third.log" 2>&1 || fail "the job after the kill failed"
grep -q "^resumed from checkpoint: step 2 " "$work/third.log" || fail "the third job did not resume"
[ -d "$ck/step_00000004" ] && [ ! -e "$ck/step_00000002" ] || fail "unexpected checkpoints: $(ls "$ck")"
[ ! -s "$ck/LOCK" ] || fail "LOCK still names a holder after the job: $(cat "$ck/LOCK")"
echo "PASS"
