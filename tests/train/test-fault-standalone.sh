#!/usr/bin/env bash
# test-fault-standalone.sh - the fault matrix on one machine: `am-launch --nproc 4` with
# AM_FAULT, every kind at two (rank, step) places (dp 4), and three kinds in a pipeline (pp 2
# x dp 2), with expert parallelism a kill in the all-to-all, a slow rank and a NaN in an
# experts' gradient (fp32 gradient shards, and bf16 ones); checks in tests/train/fault-lib.sh. The oom
# kind runs in a fresh memory cgroup with a 1 GiB limit (skipped, with a message, where
# none can be made: every other kind still runs).
set -uo pipefail
source "$(dirname "$0")/fault-lib.sh"

T=$(mktemp -d /tmp/am-fault-standalone.XXXXXX)
CG=""
cleanup() {
  [[ -n $CG && -d $CG ]] && rmdir "$CG" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
HOST=$(hostname)
host_of() { echo "$HOST"; }
make_recipe "$T" || { echo "FAIL: cannot build the corpus"; exit 1; }

NPROC=4
# run NAME KIND RANK STEP [CGROUP]: one job (with the overrides in $LAYOUT, e.g. AM_PP=2);
# sets RC, WALL, DIR
LAYOUT="" RECIPE=tiny.yaml
run() {
  local name=$1 kind=$2 rank=$3 step=$4 cg=${5:-}
  local logs=$T/$name/logs start
  mkdir -p "$T/$name"
  start=$(date +%s.%N)
  (
    [[ -n $cg ]] && echo $BASHPID >"$cg/cgroup.procs"
    cd "$T" && exec env $LAYOUT AM_FAULT="rank=$rank,step=$step,kind=$kind" AM_WATCHDOG_S=$WATCHDOG_S \
      timeout 60 "$LAUNCH" --nproc $NPROC --log-dir "$logs" "$T/$RECIPE"
  ) >"$T/$name/out" 2>"$T/$name/err"
  RC=$?
  finish_case "standalone${LAYOUT:+ $LAYOUT}" "$name" "$kind" "$rank" "$step" $NPROC "$start" "$logs"
}

for place in "1 2" "3 4"; do
  set -- $place
  for kind in segv abort exit:3 nan device-oom kill hang hang-in-collective slow:2.5; do
    run "${kind%%:*}-$1-$2" "$kind" "$1" "$2"
  done
done

# a pipeline (pp 2 x dp 2): the last stage's rank 3 fails; rank 1 (first stage) waits for
# its gradients in a recv on pp_grad, rank 2 for rank 3 in a data-parallel collective (an
# all-gather of fsdp2), rank 0 for rank 2's gradients: the chain leads to rank 3
LAYOUT=AM_PP=2
for kind in segv hang kill; do
  run "pp-$kind-3-2" "$kind" 3 2
done
LAYOUT=""

# expert parallelism (ep 2 x dp 4, a mixture of experts): rank 1 dies inside the all-to-all
# that dispatches its tokens to rank 0; rank 0, its ep peer, is a victim waiting for it there
sed 's/model_type: llama/model_type: mixtral\n  num_local_experts: 4\n  num_experts_per_tok: 2/' "$T/tiny.yaml" >"$T/moe.yaml"
LAYOUT=AM_EP=2 RECIPE=moe.yaml
run "ep-kill-in-alltoall-1-2" kill-in-alltoall 1 2
diag_text=$("$DIAG" "$DIR") # exits 1: a failure found
if grep -qE "^  rank 0 on .*: victim: waited in alltoallv #[0-9]+ of group ep for .* \(waiting for rank 1\)" <<<"$diag_text"; then
  pass "ep kill-in-alltoall: am-diag has rank 0 waiting for rank 1 in an alltoallv of group ep"
else
  fail "ep kill-in-alltoall: rank 0 is not waiting for rank 1 in an alltoallv of group ep:"
  grep "^  rank" <<<"$diag_text" | sed "s/^/    /"
fi
# a slow rank under expert parallelism: its step records carry ep_tokens_in, and am-diag
# weighs the straggler's expert load at its slow step against the median rank's; the
# routing did not overload it (the sleep did), so the report says it is no routing imbalance
run "ep-slow-1-2" slow:2.5 1 2
diag_text=$("$DIAG" "$DIR")
want="^  rank 1 on .*: straggler: finished cleanly, but held the others back: at step 2 it spent [0-9.]+ s longer "
want+="outside collectives than the median rank, while the others waited for it; its experts received [0-9.]+x the "
want+="median rank's expert tokens at step 2 \([0-9]+ against [0-9]+\): not overloaded by the routing \(a slow node or device\)$"
if grep -qE "$want" <<<"$diag_text" &&
  [[ $("$DIAG" "$DIR" --json) == *'"expert_load":{"step":2,"tokens_in":'*',"overloaded":false}'* ]]; then
  pass "ep slow: am-diag weighs rank 1's expert load at step 2 and finds no routing imbalance (a slow node)"
else
  fail "ep slow: am-diag does not weigh rank 1's expert load (want /$want/):"
  grep "^  rank" <<<"$diag_text" | sed "s/^/    /"
fi
# a NaN in an experts' gradient at ep 2 = dp 2 (ep_shard 1: the experts' gradients accumulate
# in their shard without a buffer, train/grad_sync.h, checked after the step's last backward):
# the rank it came from stops as its origin and names the tensor (one layer: the middle
# parameter is one of its experts')
sed 's/num_hidden_layers: 4/num_hidden_layers: 1/' "$T/moe.yaml" >"$T/moe1.yaml"
mkdir -p "$T/ep-nan"
(cd "$T" && env AM_EP=2 AM_FAULT="rank=1,step=2,kind=nan" timeout 60 "$LAUNCH" --nproc 2 --log-dir "$T/ep-nan/logs" \
  "$T/moe1.yaml") >"$T/ep-nan/out" 2>&1
cause=$(grep -h '"type":"cause"' "$T/ep-nan/logs"/*/rank-1.jsonl 2>/dev/null)
if [[ $cause == *'"cause":"nonfinite","step":2,"tensor":"model.layers.0.block_sparse_moe.experts.'*'"origin":"local"'* ]]; then
  pass "ep 2 nan in an experts' gradient (ep_shard 1, no buffer): rank 1 stops as its origin and names it"
else
  fail "ep 2 nan in an experts' gradient: rank 1's cause is not a local nonfinite naming an experts tensor: ${cause:-none}"
  sed 's/^/    /' "$T/ep-nan/out"
fi
# the same with bf16 parameters reduced in fp32: the experts' gradient shards are bf16, their
# fp32 gradients staged and checked after each backward (train/grad_sync.h)
sed -e 's/torch_dtype: float32/torch_dtype: bfloat16/' \
  -e 's/param_dtype: float32.*/param_dtype: bfloat16\n    reduce_dtype: float32/' "$T/moe1.yaml" >"$T/moe1-bf16.yaml"
mkdir -p "$T/ep-nan-bf16"
(cd "$T" && env AM_EP=2 AM_FAULT="rank=1,step=2,kind=nan" timeout 60 "$LAUNCH" --nproc 2 --log-dir "$T/ep-nan-bf16/logs" \
  "$T/moe1-bf16.yaml") >"$T/ep-nan-bf16/out" 2>&1
cause=$(grep -h '"type":"cause"' "$T/ep-nan-bf16/logs"/*/rank-1.jsonl 2>/dev/null)
if grep -q '^    reduce_dtype: float32' "$T/moe1-bf16.yaml" && grep -q 'torch_dtype: bfloat16' "$T/moe1-bf16.yaml" &&
  [[ $cause == *'"cause":"nonfinite","step":2,"tensor":"model.layers.0.block_sparse_moe.experts.'*'"origin":"local"'* ]]; then
  pass "ep 2 nan in an experts' gradient (ep_shard 1, bf16 shards, staged): rank 1 stops as its origin and names it"
else
  fail "ep 2 nan in an experts' gradient, bf16 shards: rank 1's cause is not a local nonfinite naming an experts tensor: ${cause:-none}"
  sed 's/^/    /' "$T/ep-nan-bf16/out"
fi
LAYOUT="" RECIPE=tiny.yaml

# am-diag's input: a log root holding one job is read like the job's directory; unusable
# input exits 2 with a message
"$DIAG" "$T/segv-1-2/logs" >/dev/null 2>&1
rc=$?
[[ $rc == 1 ]] && pass "am-diag reads a log root holding one job" || fail "am-diag on a log root with one job exited $rc, want 1"
"$DIAG" "$T/nonexistent" >/dev/null 2>"$T/diag-err"
rc=$?
if [[ $rc == 2 ]] && grep -qxF "am-diag: $T/nonexistent: No such file or directory (give the job's log directory: <log dir>/<job id>, holding rank-<R>.jsonl)" "$T/diag-err"; then
  pass "am-diag: no such directory: exit 2 with a message"
else
  fail "am-diag: no such directory: exit $rc, $(cat "$T/diag-err")"
fi
mkdir -p "$T/two" && cp -r "$T/segv-1-2/logs/"* "$T/abort-1-2/logs/"* "$T/two/"
"$DIAG" "$T/two" --json >/dev/null 2>"$T/diag-err"
rc=$?
if [[ $rc == 2 ]] && grep -q "^am-diag: $T/two holds the logs of 2 jobs (" "$T/diag-err"; then
  pass "am-diag: two jobs in one directory: exit 2 with a message"
else
  fail "am-diag: two jobs: exit $rc, $(cat "$T/diag-err")"
fi

if out=$(memory_cgroup am-fault-oom-$$ $((1 << 30))); then
  CG=${out% *}
  for place in "1 2" "3 4"; do
    set -- $place
    run "oom-$1-$2" oom "$1" "$2" "$CG"
  done
else
  echo "SKIP: oom: cannot create a memory cgroup with a limit here (not root, or no writable memory controller); every other kind ran"
fi
finish
