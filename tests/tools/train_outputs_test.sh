#!/usr/bin/env bash
# train_moe's metrics_file is safe (#32, part 4): a FIFO or a device is refused before anything
# runs (never blocked on, never replaced); a second job writing the same file is refused while
# the first holds it; a write that fails (EFBIG past rank 0's file-size limit, SIGXFSZ ignored)
# stops every rank with one line naming the file and the step, never silently.
#   train_outputs_test.sh RANKS TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
. "$(dirname "$0")/train_test_lib.sh"
run() {  # run LOG key=value... (a 60 s limit: a blocked open must not hang the suite)
  local log=$1
  shift
  timeout 60 "$mpiexec" -np "$np" "${flags[@]}" "$train" "$@" >"$log" 2>&1
}
expect() {  # expect LOG RC EXPECTED TEXT
  [ "$2" -eq "$3" ] || { cat "$1"; fail "$1: exit $2, expected $3"; }
  grep -qF -- "$4" "$1" || { cat "$1"; fail "$1: no '$4'"; }
}
mkfifo fifo
run fifo.log steps=2 metrics_file=fifo
expect fifo.log $? 2 "metrics_file 'fifo' is a FIFO; expected a regular file path"
[ -p fifo ] || fail "the FIFO was replaced"
run dev.log steps=2 metrics_file=/dev/null
expect dev.log $? 2 "metrics_file '/dev/null' is a device"
# A second job on the metrics_file of a running one.
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=100000 metrics_file="$work/m.jsonl" \
  checkpoint_dir="$work/first" >first.log 2>&1 &
first=$!
for _ in $(seq 600); do [ -s m.jsonl ] && break; sleep 0.1; done
[ -s m.jsonl ] || { kill -9 "$first"; cat first.log; fail "the first job wrote no metrics"; }
run second.log steps=2 metrics_file="$work/m.jsonl"
rc=$?
kill -9 "$first" 2>/dev/null; pkill -9 -f "checkpoint_dir=$work/first" 2>/dev/null; wait "$first" 2>/dev/null
expect second.log $rc 2 "is being written by another job"
# EFBIG: once the run is going, rank 0's file-size limit is lowered just past what it wrote
# (prlimit; a limit on the whole job would also stop Open MPI's own files).
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=100000 log_period=1 metrics_file=big.jsonl \
  checkpoint_dir="$work/big" >efbig.log 2>&1 &
job=$!
for _ in $(seq 600); do [ "$(cat big.jsonl 2>/dev/null | wc -l)" -ge 3 ] && break; sleep 0.1; done
rank0=
for pid in $(pgrep -f "^$train .*checkpoint_dir=$work/big"); do
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=0' && rank0=$pid
done
[ -n "$rank0" ] || { kill -9 "$job"; fail "rank 0 of the EFBIG job not found"; }
prlimit --pid "$rank0" --fsize=$(( $(stat -c %s big.jsonl) + 600 ))
for _ in $(seq 600); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
kill -0 "$job" 2>/dev/null && { kill -9 "$job"; fail "EFBIG: the job went on (or hung)"; }
wait "$job"
expect efbig.log $? 2 "metrics_file='big.jsonl': writing step "
grep -q "File too large" efbig.log || { cat efbig.log; fail "EFBIG not named"; }
[ "$(grep -c '^train_moe: error: metrics_file' efbig.log)" -eq "$np" ] || fail "not one line per rank"
# A checkpoint larger than rank 0's file-size limit: the save fails with EFBIG (no SIGXFSZ kill),
# every rank stops with one line, the checkpoint before it stays bitwise and no temporary file or
# directory is left in checkpoint_dir (#32: temporaries removed on every error path).
"$mpiexec" -np "$np" "${flags[@]}" "$train" steps=100000 enable_checkpointing=true checkpoint_period=300 \
  checkpoint_keep=2 checkpoint_dir="$work/ck" >ckfbig.log 2>&1 &
job=$!
for _ in $(seq 1200); do [ -d ck/step_00000300 ] && break; sleep 0.1; done
[ -d ck/step_00000300 ] || { kill -9 "$job"; cat ckfbig.log; fail "no first checkpoint"; }
before=$(cat ck/step_00000300/* | cksum)
rank0=
for pid in $(pgrep -f "^$train .*checkpoint_dir=$work/ck"); do
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=0' && rank0=$pid
done
[ -n "$rank0" ] || { kill -9 "$job"; fail "rank 0 of the checkpoint job not found"; }
model=$(stat -c %s ck/step_00000300/model.safetensors)
prlimit --pid "$rank0" --fsize=$((model / 2))
for _ in $(seq 1200); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
kill -0 "$job" 2>/dev/null && { kill -9 "$job"; fail "checkpoint EFBIG: the job went on (or hung)"; }
wait "$job"
expect ckfbig.log $? 2 "File too large"
[ "$(grep -c '^train_moe: error: ' ckfbig.log)" -eq "$np" ] || { cat ckfbig.log; fail "not one line per rank"; }
[ "$(ls -A ck | grep -v '^LOCK$' | tr '\n' ' ')" = "step_00000300 " ] ||
  { ls -la ck; fail "checkpoint EFBIG: checkpoint_dir holds more than the good checkpoint"; }
[ "$(cat ck/step_00000300/* | cksum)" = "$before" ] || fail "the good checkpoint changed"
echo "OK: $np rank(s)"
