#!/usr/bin/env bash
# moe-layer-run under mpirun (DESIGN.md §7, §8), registered with ctest by tests/tools/CMakeLists.txt.
#
#   layer_run_test.sh MODE LAYER_RUN CASE_TOOL WORKDIR MPIEXEC [MPIEXEC_FLAGS...]
#
# MODE f64 | f32 | bf16: writes a CASE with dy, runs it on 1 rank (the reference), then on 2 and 4
#   ranks in several layouts, and compares every RESULT tensor with the 1-rank RESULT (f64: rel
#   1e-10, f32: rel 1e-4, bf16 (dtype=bfloat16, y and dx BF16): rel 2e-2; expert_ids exactly).
# MODE errors: bad inputs give exit code 2 and the same one-line error on every rank, no hang,
#   and no RESULT file.
# MODE example: --example on 1 and 2 ranks prints the same routing summary; --keys lists the keys.
set -uo pipefail

MODE=$1 RUN=$2 CASE_TOOL=$3 WORK=$4
shift 4
MPI=("$@")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1
LIMIT=120  # seconds per mpirun: a hang fails the test instead of blocking ctest

rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# run NP LOG args...: runs moe-layer-run on NP ranks, stdout+stderr to LOG; returns its status.
run() {
  local np=$1 log=$2
  shift 2
  # The harness's threads rule: a set OMP_NUM_THREADS is the budget of the whole run.
  local threads=()
  if [ -n "${OMP_NUM_THREADS:-}" ]; then
    threads=("OMP_NUM_THREADS=$(( OMP_NUM_THREADS / np > 0 ? OMP_NUM_THREADS / np : 1 ))")
  fi
  # One rank: no other rank to end, so no grace period in mpirun's kill sequence after a
  # non-zero exit (odls_base_sigkill_timeout, 1 s, otherwise paid twice per expected error).
  [ "$np" -eq 1 ] && threads+=(OMPI_MCA_odls_base_sigkill_timeout=0)
  env "${threads[@]}" timeout "$LIMIT" "${MPI[@]}" -np "$np" "$RUN" "$@" >"$log" 2>&1
}

layouts() {
  local dtype=$1 rtol=$2
  if [[ $dtype == bf16 ]]; then
    # A BF16 CASE: the layer computes in bf16 (docs/precision.md); y and dx come back BF16.
    "$CASE_TOOL" write case.safetensors --dtype bf16 --shared 1 --seed 5 || exit 1
    printf 'num_experts_per_tok: 2\nload_balance_loss_weight: 0.05\n' >cfg.yml
  elif [[ $dtype == f64 ]]; then
    "$CASE_TOOL" write case.safetensors --dtype f64 --shared 1 --bias --seed 11 || exit 1
    cat >cfg.yml <<'EOF'
# DeepSeek routing: sigmoid scores, gate bias, group-limited top-k, loss-free bias update.
num_experts_per_tok: 2
decoder_block: deepseek
routed_score_func: sigmoid
n_routing_groups: 4
topk_routing_group: 2
routed_scaling_factor: 2.0
routed_bias_update_rate: 0.01
load_balance_loss_weight: 0.05
mlp_activations: [silu, linear]
EOF
  else
    "$CASE_TOOL" write case.safetensors --dtype f32 --shared 1 --seed 5 || exit 1
    cat >cfg.yml <<'EOF'
# Mixtral routing with capacity dropping and the load-balance loss.
num_experts_per_tok: 2
capacity_factor: 1.5
load_balance_loss_weight: 0.05
norm_topk_prob: true
EOF
  fi
  run 1 ref.log --config cfg.yml --in case.safetensors --out ref.safetensors ||
    { cat ref.log; fail "1-rank reference run"; return; }
  cat ref.log
  if [[ $dtype == bf16 ]] && ! grep -q 'dtype=BF16' ref.log; then
    fail "a BF16 CASE does not run as BF16"
  fi
  # The comparison must be able to fail: a slightly different layer must not match.
  if [[ $dtype == f64 ]]; then
    run 1 perturbed.log --config cfg.yml --in case.safetensors --out perturbed.safetensors \
      routed_scaling_factor=2.000001 || { cat perturbed.log; fail "perturbed run"; }
    if "$CASE_TOOL" compare ref.safetensors perturbed.safetensors "$rtol" >perturbed.cmp 2>&1; then
      cat perturbed.cmp
      fail "the comparison accepts a RESULT of a different layer"
    else
      echo "ok   a perturbed layer (routed_scaling_factor 2 -> 2.000001) is told apart"
    fi
  fi
  local cases=(
    "2|ep|ici_expert_parallelism=-1"
    "2|ring|ici_expert_parallelism=-1 use_ring_of_experts=true"
    "2|fsdp|ici_fsdp_parallelism=-1"
    "2|tp|ici_tensor_parallelism=-1"
    "2|dp|ici_data_parallelism=-1"
    "2|shard_exp_on_fsdp|custom_mesh_and_rule=shard-exp-on-fsdp ici_fsdp_parallelism=-1"
    "2|ep_tiled|--gmm tiled ici_expert_parallelism=-1"
    "2|ep_dense|--gmm dense ici_expert_parallelism=-1"
    "4|ep|ici_expert_parallelism=-1"
    "4|ring|ici_expert_parallelism=-1 use_ring_of_experts=true"
    "4|fsdp|ici_fsdp_parallelism=-1"
    "4|tp|ici_tensor_parallelism=-1"
    "4|dp2_ep2|ici_data_parallelism=2 ici_expert_parallelism=2"
    "4|shard_exp_on_fsdp|custom_mesh_and_rule=shard-exp-on-fsdp ici_fsdp_parallelism=-1"
  )
  local c np name keys out
  for c in "${cases[@]}"; do
    IFS='|' read -r np name keys <<<"$c"
    out="np${np}_${name}"
    # shellcheck disable=SC2086  # keys are separate words
    if ! run "$np" "$out.log" --config cfg.yml --in case.safetensors --out "$out.safetensors" $keys; then
      cat "$out.log"
      fail "$dtype np=$np $name: moe-layer-run failed"
      continue
    fi
    if "$CASE_TOOL" compare ref.safetensors "$out.safetensors" "$rtol" >"$out.cmp" 2>&1; then
      echo "ok   $dtype np=$np $name ($keys): $(grep -c 'rel error' "$out.cmp") float tensors within $rtol"
    else
      cat "$out.cmp"
      fail "$dtype np=$np $name: RESULT differs from the 1-rank RESULT"
    fi
  done
}

# expect_error NP PATTERN args...: exit code 2, the same one-line error (containing PATTERN) on
# every one of the NP ranks, and no RESULT file.
expect_error() {
  local np=$1 pattern=$2
  shift 2
  rm -f out.safetensors
  run "$np" err.log "$@"
  check_error_log $? "$np" "$pattern" "$*"
}

# expect_error_mpmd PATTERN "args of rank 0" "args of rank 1": as expect_error on 2 ranks that
# were given different arguments (one rank's bad input, or ranks that disagree).
expect_error_mpmd() {
  local pattern=$1
  rm -f out.safetensors
  # shellcheck disable=SC2086  # each rank's arguments are separate words
  timeout "$LIMIT" "${MPI[@]}" -np 1 "$RUN" $2 : -np 1 "$RUN" $3 >err.log 2>&1
  check_error_log $? 2 "$pattern" "MPMD [$2] [$3]"
}

check_error_log() {
  local rc=$1 np=$2 pattern=$3
  set -- "$4"
  local lines
  lines=$(grep '^moe-layer-run: error: ' err.log)
  if [[ $rc -eq 124 ]]; then
    fail "np=$np $*: timed out (hang)"
  elif [[ $rc -ne 2 ]]; then
    cat err.log
    fail "np=$np $*: exit code $rc, expected 2"
  elif [[ $(grep -c . <<<"$lines") -ne $np ]]; then
    cat err.log
    fail "np=$np $*: expected one error line per rank ($np)"
  elif [[ $(sort -u <<<"$lines" | wc -l) -ne 1 ]]; then
    cat err.log
    fail "np=$np $*: the ranks report different errors"
  elif ! grep -q -- "$pattern" <<<"$lines"; then
    cat err.log
    fail "np=$np $*: the error does not mention '$pattern'"
  elif [[ -e out.safetensors ]]; then
    fail "np=$np $*: a RESULT file was written"
  else
    echo "ok   np=$np exit 2: $(head -n1 <<<"$lines")"
  fi
}

errors() {
  "$CASE_TOOL" write case.safetensors --dtype f64 --seed 3 || exit 1
  echo "num_experts_per_tok: 2" >cfg.yml
  printf 'num_experts_per_tok: 2\nici_expert_parallelism: 3\n' >mesh3.yml
  head -c 300 case.safetensors >truncated.safetensors
  "$CASE_TOOL" mix-dtype case.safetensors mixed.safetensors || exit 1
  "$CASE_TOOL" poison case.safetensors nan.safetensors x 511 nan || exit 1
  "$CASE_TOOL" poison case.safetensors nan_gate.safetensors gate 5 nan || exit 1
  "$CASE_TOOL" poison case.safetensors inf_wo.safetensors wo 7 inf || exit 1
  "$CASE_TOOL" rename case.safetensors dY.safetensors dy dY || exit 1
  "$CASE_TOOL" transpose case.safetensors gate_t.safetensors gate || exit 1
  "$CASE_TOOL" write case32.safetensors --dtype f32 --seed 3 || exit 1
  printf 'num_experts_per_tok: 2\ncapacity_factor: 1.5\nnum_experts_per_tok: 1\n' >dup.yml
  mkdir -p cfgdir
  local io=(--config cfg.yml --out out.safetensors)
  expect_error 1 "truncated.safetensors" "${io[@]}" --in truncated.safetensors
  expect_error 2 "truncated.safetensors" "${io[@]}" --in truncated.safetensors ici_data_parallelism=-1
  expect_error 2 "all tensors share one dtype" "${io[@]}" --in mixed.safetensors ici_data_parallelism=-1
  expect_error 2 "does not equal the communicator size 2" --config mesh3.yml --in case.safetensors \
    --out out.safetensors
  expect_error 2 "communicator size 2" "${io[@]}" --in case.safetensors
  expect_error 4 "bogus_key" "${io[@]}" --in case.safetensors ici_data_parallelism=-1 bogus_key=1
  expect_error 3 "num_experts=8 is not divisible" "${io[@]}" --in case.safetensors \
    ici_expert_parallelism=-1
  expect_error 2 "NaN" "${io[@]}" --in nan.safetensors ici_data_parallelism=-1
  expect_error 2 "no-such-case.safetensors" "${io[@]}" --in no-such-case.safetensors \
    ici_data_parallelism=-1
  expect_error 2 "no-such-dir" --config cfg.yml --in case.safetensors \
    --out no-such-dir/out.safetensors ici_data_parallelism=-1
  # Every tensor is validated before use: finiteness (with the index), names, shapes.
  expect_error 1 "tensor gate holds NaN at \[0,5\]" "${io[@]}" --in nan_gate.safetensors
  expect_error 2 "tensor gate holds NaN at \[0,5\]" "${io[@]}" --in nan_gate.safetensors \
    ici_fsdp_parallelism=-1
  expect_error 2 "tensor wo holds Inf at \[0,0,7\]" "${io[@]}" --in inf_wo.safetensors \
    ici_expert_parallelism=-1
  expect_error 2 "unknown tensor 'dY' (did you mean 'dy'?)" "${io[@]}" --in dY.safetensors \
    ici_data_parallelism=-1
  expect_error 1 "tensor gate has shape \[8, 16\] but must be \[D,E\] = \[16, 8\]" "${io[@]}" \
    --in gate_t.safetensors
  # Config: duplicate keys, two fill degrees, a misspelt key (as train_moe rejects them).
  expect_error 2 "sets key 'num_experts_per_tok' twice (lines 1 and 3)" --config dup.yml \
    --in case.safetensors --out out.safetensors ici_data_parallelism=-1
  expect_error 2 "sets key 'capacity_factor' twice" "${io[@]}" --in case.safetensors \
    ici_data_parallelism=-1 capacity_factor=1 capacity_factor=2
  expect_error 2 "at most one ici_\*_parallelism degree may be -1" "${io[@]}" --in case.safetensors \
    ici_fsdp_parallelism=-1 ici_data_parallelism=-1
  expect_error 1 "did you mean 'num_experts_per_tok'" "${io[@]}" --in case.safetensors \
    num_experts_per_tk=2
  # Paths: a directory as the config, the result onto the input (also through a link).
  expect_error 2 "\-\-config 'cfgdir' is a directory" --config cfgdir --in case.safetensors \
    --out out.safetensors ici_data_parallelism=-1
  cp case.safetensors keep.safetensors
  ln -sf case.safetensors link.safetensors
  local before
  before=$(cksum <case.safetensors)
  for target in case.safetensors link.safetensors; do
    run 2 err.log --config cfg.yml --in case.safetensors --out "$target" ici_data_parallelism=-1
    local rc=$?
    if [[ $rc -ne 2 ]] || ! grep -q "is the same file as --in 'case.safetensors'" err.log; then
      cat err.log
      fail "--out $target = --in: exit $rc, expected 2 and a message naming both"
    elif [[ $(cksum <case.safetensors) != "$before" ]]; then
      fail "--out $target = --in: the input was changed"
    else
      echo "ok   np=2 --out $target = --in refused, input unchanged"
    fi
  done
  # --out a FIFO or a device: refused before anything runs, never opened or replaced (#32).
  mkfifo out.fifo
  expect_error 2 "\-\-out 'out.fifo' is a FIFO; expected a regular file path" --config cfg.yml \
    --in case.safetensors --out out.fifo ici_data_parallelism=-1
  [[ -p out.fifo ]] || fail "--out a FIFO: the FIFO was replaced"
  # A device node of its own (a copy of /dev/null's), so that a regression replaces nothing of the
  # machine's; where mknod is not allowed, the case is skipped.
  if mknod nulldev c 1 3 2>/dev/null; then
    expect_error 1 "\-\-out 'nulldev' is a device" --config cfg.yml --in case.safetensors \
      --out nulldev
    [[ -c nulldev ]] || fail "--out a device: the device node was replaced"
  else
    echo "skip --out a device: mknod is not allowed here"
  fi
  # --out a symbolic link (into another directory): written through, the link kept (#32).
  mkdir -p results && echo old >results/r.safetensors && ln -sf results/r.safetensors rlink
  if run 2 link.log --config cfg.yml --in case.safetensors --out rlink ici_data_parallelism=-1 &&
    [[ -L rlink ]] && [[ $(head -c 3 results/r.safetensors) != old ]] &&
    "$CASE_TOOL" compare results/r.safetensors results/r.safetensors 0 >/dev/null 2>&1; then
    echo "ok   np=2 --out a symbolic link: the file it names was written, the link kept"
  else
    cat link.log
    ls -l rlink results
    fail "--out a symbolic link: expected the file it names written and the link kept"
  fi
  # One rank's bad input, and ranks that read CASEs of different dtypes: every rank reports.
  local base="--config cfg.yml --out out.safetensors ici_data_parallelism=-1"
  expect_error_mpmd "CASE 'nan_gate.safetensors': tensor gate holds NaN" \
    "$base --in case.safetensors" "$base --in nan_gate.safetensors"
  expect_error_mpmd "\-\-in 'no-such-case.safetensors' does not exist" "$base --in case.safetensors" \
    "$base --in no-such-case.safetensors"
  expect_error_mpmd "differs across ranks: rank 1 has \"dy=F32" "$base --in case.safetensors" \
    "$base --in case32.safetensors"
  expect_error_mpmd "differs across ranks: rank 1 has \"cf=1.5" "$base --in case.safetensors" \
    "$base --in case.safetensors capacity_factor=1.5"
}

example() {
  run 1 ex1.log --example || { cat ex1.log; fail "--example on 1 rank"; return; }
  run 2 ex2.log --example || { cat ex2.log; fail "--example on 2 ranks"; return; }
  cat ex1.log ex2.log
  grep -q 'ranks=2 mesh data=2' ex2.log || fail "--example on 2 ranks does not split the batch"
  if [[ $(grep 'tokens per expert' ex1.log) != $(grep 'tokens per expert' ex2.log) ]]; then
    fail "--example routes differently on 1 and 2 ranks"
  fi
  # --keys: every key from the config tables, with its type, default and meaning.
  run 1 keys.log --keys || { cat keys.log; fail "--keys"; return; }
  grep -q '^num_experts: int, default 8 -- ' keys.log || fail "--keys does not list num_experts"
  grep -q '^ici_expert_parallelism: int, default 1 -- ' keys.log ||
    fail "--keys does not list ici_expert_parallelism"
}

case $MODE in
  f64) layouts f64 1e-10 ;;
  f32) layouts f32 1e-4 ;;
  bf16) layouts bf16 2e-2 ;;
  errors) errors ;;
  example) example ;;
  *)
    echo "unknown mode $MODE"
    exit 2
    ;;
esac
if [[ $failures -gt 0 ]]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
