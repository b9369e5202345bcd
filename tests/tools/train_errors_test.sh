#!/usr/bin/env bash
# train_moe's bad inputs (tests/README.md lists them): exit code 2 on every rank within the time
# limit, the same one-line error naming the key or path on every rank, and no metrics file or
# checkpoint written or changed. At 1 and 2 ranks, and with the bad input on one rank only.
#   train_errors_test.sh TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
set -uo pipefail
train=$1 work=$2
shift 2
MPI=("$@")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
LIMIT=60
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

mkdir -p cfgdir ck
echo "steps: 3" >ok.yml
printf 'steps: 3\nnum_experts: 4\nsteps: 4\n' >dup.yml
echo "keep me" >ck/marker
touch -d '2000-01-01' ck/marker
before=$(ls -l --time-style=+%s ck | md5sum)

# check LOG RC NP PATTERN WHAT
check() {
  local log=$1 rc=$2 np=$3 pattern=$4 what=$5 lines
  lines=$(grep '^train_moe: error: ' "$log")
  if [[ $rc -eq 124 ]]; then
    fail "$what: timed out (hang)"
  elif [[ $rc -ne 2 ]]; then
    cat "$log"
    fail "$what: exit code $rc, expected 2"
  elif [[ $(grep -c . <<<"$lines") -ne $np ]]; then
    cat "$log"
    fail "$what: expected one error line per rank ($np)"
  elif [[ $(sort -u <<<"$lines" | wc -l) -ne 1 ]]; then
    cat "$log"
    fail "$what: the ranks report different errors"
  elif ! grep -q -- "$pattern" <<<"$lines"; then
    cat "$log"
    fail "$what: the error does not mention '$pattern'"
  elif [[ -e metrics.jsonl ]]; then
    fail "$what: a metrics file was written"
  elif [[ $(ls -l --time-style=+%s ck | md5sum) != "$before" ]]; then
    fail "$what: the checkpoint directory changed"
  else
    echo "ok   $what: $(head -n1 <<<"$lines")"
  fi
}

# expect NP PATTERN args...: the same arguments on every rank.
expect() {
  local np=$1 pattern=$2
  shift 2
  rm -f metrics.jsonl
  # One rank: no other rank to end, so no grace period in mpirun's kill sequence after the
  # expected non-zero exit (odls_base_sigkill_timeout, 1 s, otherwise paid twice per case).
  local quick=()
  [ "$np" -eq 1 ] && quick=(OMPI_MCA_odls_base_sigkill_timeout=0)
  env "${quick[@]}" timeout "$LIMIT" "${MPI[@]}" -np "$np" "$train" metrics_file=metrics.jsonl \
    "$@" >err.log 2>&1
  check err.log $? "$np" "$pattern" "np=$np $*"
}

# expect_mpmd PATTERN "rank 0 args" "rank 1 args": two ranks given different arguments.
expect_mpmd() {
  local pattern=$1
  rm -f metrics.jsonl
  # shellcheck disable=SC2086  # each rank's arguments are separate words
  timeout "$LIMIT" "${MPI[@]}" -np 1 "$train" metrics_file=metrics.jsonl $2 : \
    -np 1 "$train" metrics_file=metrics.jsonl $3 >err.log 2>&1
  check err.log $? 2 "$pattern" "MPMD [$2] [$3]"
}

ck=(enable_checkpointing=true checkpoint_dir=ck)
for np in 1 2; do
  expect "$np" "config file 'cfgdir' is a directory" cfgdir
  expect "$np" "config file 'missing.yml' does not exist" missing.yml
  expect "$np" "sets key 'steps' twice (lines 1 and 3)" dup.yml
  expect "$np" "the command line sets key 'steps' twice" steps=3 steps=4
  expect "$np" "did you mean 'steps'" stepz=3
  expect "$np" "at most one ici_\*_parallelism degree may be -1" ici_fsdp_parallelism=-1 \
    ici_data_parallelism=-1
  expect "$np" "dataset_path 'cfgdir' is a directory" dataset_type=text dataset_path=cfgdir
  expect "$np" "dataset_path 'none.txt' does not exist" dataset_type=text dataset_path=none.txt
  expect "$np" "checkpoint_dir 'ok.yml' is a file" enable_checkpointing=true checkpoint_dir=ok.yml
  # Refused before any allocation: past the kernels' 32-bit row limit, and past the memory.
  expect "$np" "rows on this rank exceed the 2147483647 rows" per_device_batch_size=65536 \
    max_target_length=65536
  # A batch whose token count does not fit 64 bits: refused by the plan's checked extents, not
  # wrapped into a "negative factor" (#32).
  expect "$np" "tokens on this rank = 1000000000000000000 x 64 does not fit a 64-bit integer" \
    per_device_batch_size=1e18
  expect "$np" "train_moe needs about .* GiB per rank .* available" num_experts=64 \
    base_emb_dim=4096 base_moe_mlp_dim=16384
done
rm -f metrics.jsonl
timeout "$LIMIT" "${MPI[@]}" -np 2 "$train" ok.yml metrics_file=ok.yml >err.log 2>&1
rc=$?
if [[ $rc -ne 2 ]] || ! grep -q "metrics_file 'ok.yml' is the same file as the config file" err.log ||
  [[ $(cat ok.yml) != "steps: 3" ]]; then
  cat err.log
  fail "metrics_file = the config file: exit $rc, expected 2 and the config unchanged"
else
  echo "ok   np=2 metrics_file = config file refused, config unchanged"
fi
# One rank's bad input, ranks that disagree: every rank reports, nobody hangs.
expect_mpmd "did you mean 'steps'" "steps=3 ${ck[*]}" "stepz=3 ${ck[*]}"
expect_mpmd "dataset_path 'none.txt' does not exist" "steps=3 dataset_type=text dataset_path=ok.yml" \
  "steps=3 dataset_type=text dataset_path=none.txt"
expect_mpmd "rank 1 has \"steps=4\" but rank 0 has \"steps=3\"" "steps=3 ${ck[*]}" \
  "steps=4 ${ck[*]}"
expect_mpmd "rank 1 has \"dtype=float64\"" "steps=3 ${ck[*]}" "steps=3 dtype=float64 ${ck[*]}"
# Same dataset_path, different bytes (each rank starts in its own directory).
mkdir -p ra rb
head -c 4000 /dev/urandom >ra/text.bin
head -c 4000 /dev/urandom >rb/text.bin
timeout "$LIMIT" "${MPI[@]}" -np 1 --wdir ra "$train" steps=3 dataset_type=text \
  dataset_path=text.bin : -np 1 --wdir rb "$train" steps=3 dataset_type=text \
  dataset_path=text.bin >err.log 2>&1
check err.log $? 2 "dataset_path file (its size and content hash) differs across ranks" \
  "MPMD same dataset_path, different bytes"

if [[ $failures -gt 0 ]]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
