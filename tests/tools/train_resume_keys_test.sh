#!/usr/bin/env bash
# A resume compares every model key and the dataset's content with the checkpoint (#32): a key
# that keeps every tensor's shape (num_experts_per_tok, use_random_routing) or a text dataset
# whose bytes changed is refused, naming each key with both values, unless resume_allow_changed
# names it; dataset_path without dataset_type=text is an error naming dataset_type.
#   train_resume_keys_test.sh RANKS TRAIN_MOE WORKDIR MPIEXEC [MPIEXEC flags...]
. "$(dirname "$0")/train_test_lib.sh"
run() {  # run LOG key=value...
  local log=$1
  shift
  "$mpiexec" -np "$np" "${flags[@]}" "$train" enable_checkpointing=true "$@" >"$log" 2>&1
}
expect() {  # expect LOG RC TEXT
  [ "$2" -eq "$3" ] || { cat "$1"; fail "$1: exit $2, expected $3"; }
  grep -qF -- "$4" "$1" || { cat "$1"; fail "$1: no '$4'"; }
}
run good.log steps=2 checkpoint_dir=ck || { cat good.log; fail "the first run failed"; }
run keys.log steps=4 checkpoint_dir=ck num_experts_per_tok=3 use_random_routing=true
expect keys.log $? 2 "num_experts_per_tok=2 (this run: 3) use_random_routing=false (this run: true)"
grep -q "resume_allow_changed" keys.log || fail "the refusal does not name resume_allow_changed"
[ "$(ls ck)" = "$(printf 'LOCK\nstep_00000002')" ] || fail "the refused resume wrote: $(ls ck)"
run allowed.log steps=4 checkpoint_dir=ck num_experts_per_tok=3 resume_allow_changed=num_experts_per_tok
expect allowed.log $? 0 "note: resume_allow_changed: num_experts_per_tok=2 (this run: 3)"
head -c 3000 /dev/urandom >data.bin
run text.log steps=2 checkpoint_dir=ck_text dataset_type=text dataset_path=data.bin ||
  { cat text.log; fail "the text run failed"; }
head -c 3000 /dev/urandom >data.bin  # same size, other bytes
run text2.log steps=4 checkpoint_dir=ck_text dataset_type=text dataset_path=data.bin
expect text2.log $? 2 "dataset_hash=3000 bytes, hash "
run text3.log steps=4 checkpoint_dir=ck_text dataset_type=text dataset_path=data.bin \
  resume_allow_changed=dataset_hash
expect text3.log $? 0 "note: resume_allow_changed: dataset_hash=3000 bytes"
run path.log steps=2 checkpoint_dir=ck_path dataset_path=data.bin
expect path.log $? 2 "dataset_path"
grep -q "dataset_type=text" path.log || fail "the dataset_path error does not name dataset_type=text"
echo "OK: $np rank(s)"
