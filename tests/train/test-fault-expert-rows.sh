#!/usr/bin/env bash
# test-fault-expert-rows.sh - a failed growth of the rows a rank's experts receive, for real:
# `am-launch --nproc 2` trains the tiny Mixtral (sbatch-templates/recipes/tiny_moe.yaml: 4
# experts, top 2, ep 2 over the 2 data-parallel ranks, local batches of 4 sequences of 64) with
# AM_FAULT kind=expert-rows-oom at two (rank, step) places. The injected rank's first MoE layer
# (layer 0) grows its pool of saved expert rows as if the routing had sent it more than the pool
# holds, and the growth asks the device for 2^62 bytes, which fails (moe.h). Checked exactly:
#   - the rank's error line on stderr (am-train's, and am-launch's naming the rank that aborted
#     the job): layer 0, the rows it received (R, whatever the routing gave: 0 < R <= ep x 512),
#     the saved rows R (the layer is the micro-batch's first), the plan's 4 layers x 512 = 2048
#     rows and its 512 a layer (4 x 64 tokens x top 2), the bytes asked (2^62) and what to change;
#   - the job exits non-zero and the fault matrix's checks (fault-lib.sh): am-diag names the rank
#     as the first failure, cause "oom" in the forward of layer 0 having asked for 4.0 EiB, its ep
#     peer a victim, the ranks torn down together, no collective timed out;
#   - AM_FAULT kind=expert-rows-oom on a job without expert parallelism is refused with its rule.
set -uo pipefail
source "$(dirname "$0")/fault-lib.sh"

T=$(mktemp -d /tmp/am-fault-expert-rows.XXXXXX)
trap 'rm -rf "$T"' EXIT
HOST=$(hostname)
host_of() { echo "$HOST"; }
"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" "$AM_SRCDIR"/runtime/*/*.c >/dev/null ||
  { echo "FAIL: cannot build the corpus"; exit 1; }
sed -e "s|paths: .*|paths: $T/corpus|" -e 's/max_steps: .*/max_steps: 6/' \
  "$AM_SRCDIR/sbatch-templates/recipes/tiny_moe.yaml" >"$T/moe.yaml"

NPROC=2 PLAN_ROWS=2048 LAYER_ROWS=512 BYTES=$((1 << 62))
# the growth's error without its prefix, for R rows received by layer 0's experts
growth_error() {
  printf '%s' "step $2: model: layer 0: this rank's experts received $1 rows, making the saved expert rows of its "
  printf '%s' "micro-batch's MoE layers $1 rows where am-plan assumed $PLAN_ROWS at the balanced load (micro-batch "
  printf '%s' "tokens x num_experts_per_tok = $LAYER_ROWS rows a MoE layer); growing them to $BYTES bytes failed: the "
  printf '%s' "device is out of memory (balance the routing: router_aux_loss_coef, gate_bias_update_factor; or give "
  printf '%s' "each rank fewer tokens: a smaller local_batch_size or pp_microbatch_size, or more GPUs)"
}

# run RANK STEP: one job; sets RC, WALL, DIR and checks it
run() {
  local rank=$1 step=$2 name=rows-$1-$2 start rows want ok=1
  local logs=$T/$name/logs
  mkdir -p "$T/$name"
  start=$(date +%s.%N)
  (cd "$T" && exec env AM_FAULT="rank=$rank,step=$step,kind=expert-rows-oom" AM_WATCHDOG_S=$WATCHDOG_S \
    timeout 60 "$LAUNCH" --nproc $NPROC --log-dir "$logs" "$T/moe.yaml") >"$T/$name/out" 2>"$T/$name/err"
  RC=$?
  finish_case "standalone AM_EP=2" "$name" expert-rows-oom "$rank" "$step" $NPROC "$start" "$logs"
  rows=$(sed -nE "s/^am-train: rank $rank: error: step $step: model: layer 0: this rank's experts received ([0-9]+) rows, .*/\\1/p" \
    "$T/$name/err" | head -n 1)
  if [[ -z $rows ]] || ((rows < 1 || rows > 2 * LAYER_ROWS)); then
    fail "expert-rows-oom at rank $rank, step $step: no error line of rank $rank naming layer 0 and its rows (1 to $((2 * LAYER_ROWS)))"
    sed 's/^/    stderr: /' "$T/$name/err" | head -n 20
    return
  fi
  want="am-train: rank $rank: error: $(growth_error "$rows" "$step")"
  grep -qxF "$want" "$T/$name/err" || { fail "expert-rows-oom at rank $rank, step $step: no line: $want"; ok=0; }
  want="am-launch: rank $rank aborted the job (status 1): $(growth_error "$rows" "$step")"
  grep -qxF "$want" "$T/$name/err" || { fail "expert-rows-oom at rank $rank, step $step: no line: $want"; ok=0; }
  if [[ $(grep -c '^am-train: rank [0-9]*: error:' "$T/$name/err") != 1 ]]; then
    fail "expert-rows-oom at rank $rank, step $step: not one error line (the victim's teardown is no error)"; ok=0
  fi
  if [[ $ok == 1 ]]; then
    pass "expert-rows-oom at rank $rank, step $step: exit $RC; the growth's error names layer 0, its $rows rows, the plan's $PLAN_ROWS ($LAYER_ROWS a layer) and the 2^62 bytes asked"
  else
    sed 's/^/    stderr: /' "$T/$name/err" | head -n 20
  fi
}

run 1 2
run 0 4

# without expert parallelism (ep_size 1): refused before training, with the rule
sed 's/ep_size: 2 .*/ep_size: 1/' "$T/moe.yaml" >"$T/moe-ep1.yaml"
(cd "$T" && exec env AM_FAULT="rank=1,step=2,kind=expert-rows-oom" timeout 60 "$LAUNCH" --nproc $NPROC \
  --log-dir "$T/ep1/logs" "$T/moe-ep1.yaml") >/dev/null 2>"$T/ep1-err"
rc=$?
want="AM_FAULT=rank=1,step=2,kind=expert-rows-oom: kind=expert-rows-oom fails the growth of the rows this rank's "
want+="experts receive from their ep group, and this job has none (ep 1): run a mixture-of-experts model with ep_size 2 "
want+="or more, or use kind=device-oom"
if [[ $rc != 0 ]] && grep -qF "$want" "$T/ep1-err"; then
  pass "expert-rows-oom at ep 1: refused (exit $rc) with the rule"
else
  fail "expert-rows-oom at ep 1: exit $rc, want non-zero and: $want"
  sed 's/^/    stderr: /' "$T/ep1-err" | head -n 10
fi
finish
