# tests/train/fault-lib.sh - the fault matrix's helpers (sourced by test-fault-standalone.sh,
# test-fault-slurm.sh, test-early-failure.sh and test-fault-expert-rows.sh).
#
# A case injects one AM_FAULT into a short training job (the tiny recipe, 6 steps), waits
# for the job to end (bounded by `timeout`), and checks exactly:
#   - the job ended non-zero (slow:S: zero), within its bound (no hang);
#   - the other ranks were torn down within seconds of the first failure: their exit
#     records lie within TEARDOWN_S of the first one, and no rank gave up in a collective
#     by timeout (except in the hang kinds, where the watchdog is what ends the job);
#   - a hang is caught by the watchdog: some rank's cause is a watchdog timeout;
#   - `am-diag --json` exits 1 (slow: 0) and names the injected rank, its host, cause,
#     signal and step as the first failure (device-oom, expert-rows-oom: the "oom" cause
#     record's phase, layer and bytes in its detail), and every other rank as a victim (slow: the
#     injected rank a straggler, the others clean).

: "${AM_SRCDIR:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN AM_FAULT AM_WATCHDOG_S AM_FLIGHT_RECORDER_SIZE \
  AM_TOPOLOGY_FILE PMIX_NAMESPACE PMIX_RANK SLURM_STEP_ID SLURM_PROCID 2>/dev/null || true
ulimit -c 0
LAUNCH=$AM_BUILDDIR/am-launch
DIAG=$AM_BUILDDIR/am-diag
WATCHDOG_S=4      # the collective watchdog's timeout in these jobs (AM_WATCHDOG_S)
TEARDOWN_S=3      # the other ranks end within this of the first one
FAILED=0 CASES=0
TEST_NAME=${0##*/}

pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILED=1; }

# make_recipe DIR: a corpus and the tiny recipe cut to 6 steps of 2-sample local batches
# (global batch 16: dp 2, 4 and 8 divide it)
make_recipe() {
  "$AM_BUILDDIR/am-data" build --bytes --out "$1/corpus" "$AM_SRCDIR"/runtime/*/*.c >/dev/null || return 1
  sed -e "s|paths: .*|paths: $1/corpus|" -e 's/max_steps: .*/max_steps: 6/' -e 's/local_batch_size: .*/local_batch_size: 2/' \
    "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$1/tiny.yaml"
}

# the expected start of first_failure for KIND at RANK/STEP on HOST
expected_first() {
  local kind=$1 rank=$2 step=$3 host=$4 head
  head="\"first_failure\":{\"rank\":$rank,\"host\":\"$host\""
  case $kind in
    segv) echo "$head,\"cause\":\"signal\",\"signal\":\"SIGSEGV\",\"step\":$step,\"status\":139," ;;
    abort) echo "$head,\"cause\":\"signal\",\"signal\":\"SIGABRT\",\"step\":$step,\"status\":134," ;;
    exit:*) echo "$head,\"cause\":\"exit\",\"signal\":null,\"step\":$step,\"status\":${kind#exit:}," ;;
    nan) echo "$head,\"cause\":\"nonfinite\",\"signal\":null,\"step\":$step,\"status\":1," ;;
    hang | hang-in-collective) echo "$head,\"cause\":\"hang\",\"signal\":null,\"step\":$step," ;;
    kill | kill-in-alltoall) echo "$head,\"cause\":\"killed\",\"signal\":\"SIGKILL\",\"step\":$step,\"status\":137," ;;
    oom) echo "$head,\"cause\":\"oom\",\"signal\":\"SIGKILL\",\"step\":$step,\"status\":137," ;;
    device-oom | expert-rows-oom) echo "$head,\"cause\":\"oom\",\"signal\":null,\"step\":$step,\"status\":1," ;;
  esac
}

# check_case NAME KIND RANK STEP WORLD JOBDIR RC WALL HOSTFN
#   JOBDIR: the job's log directory; RC: the job's exit status; WALL: seconds it took;
#   HOSTFN: a function printing rank R's host
check_case() {
  local name=$1 kind=$2 rank=$3 step=$4 world=$5 dir=$6 rc=$7 wall=$8 hostfn=$9
  local json drc want r ok=1 bound=20 verdict
  CASES=$((CASES + 1))
  case $kind in hang | hang-in-collective) bound=$((WATCHDOG_S + 10)) ;; esac
  if [[ $rc == 124 || $rc == 137 && $kind != kill && $kind != kill-in-alltoall && $kind != oom ]]; then
    fail "$name: the job did not end (killed by timeout, status $rc)"; return
  fi
  if [[ $kind == slow:* ]]; then
    [[ $rc == 0 ]] || { fail "$name: the job exited $rc, want 0 (a slow rank is no failure)"; ok=0; }
  else
    [[ $rc != 0 ]] || { fail "$name: the job exited 0 despite the fault"; ok=0; }
  fi
  awk -v w="$wall" -v b="$bound" 'BEGIN { exit !(w <= b) }' || { fail "$name: took ${wall}s, more than ${bound}s"; ok=0; }
  json=$("$DIAG" "$dir" --json)
  drc=$?
  if [[ $kind == slow:* ]]; then
    [[ $drc == 0 ]] || { fail "$name: am-diag exited $drc, want 0 (clean)"; ok=0; }
    [[ $json == *'"status":"clean","first_failure":null'* ]] || { fail "$name: am-diag did not call the job clean"; ok=0; }
    want="{\"rank\":$rank,\"host\":\"$($hostfn "$rank")\",\"verdict\":\"straggler\""
    [[ $json == *"$want"* ]] || { fail "$name: rank $rank is not a straggler: no $want"; ok=0; }
    verdict=clean
  else
    [[ $drc == 1 ]] || { fail "$name: am-diag exited $drc, want 1 (a failure found)"; ok=0; }
    want=$(expected_first "$kind" "$rank" "$step" "$($hostfn "$rank")")
    [[ $json == *"$want"* ]] || { fail "$name: am-diag's first failure is not $want"; ok=0; }
    if [[ $kind == device-oom ]]; then # the middle parameter's group: layer 2's (as nan's)
      want="\"detail\":\"rank $rank ran out of host (CPU device) memory in the backward of layer 2: "
      [[ $json == *"$want"*"(asked for 4.0 EiB; the allocator holds "* ]] ||
        { fail "$name: am-diag's detail does not start with $want... (asked for 4.0 EiB; ...)"; ok=0; }
    fi
    if [[ $kind == expert-rows-oom ]]; then # the first MoE layer's forward: layer 0's
      want="\"detail\":\"rank $rank ran out of host (CPU device) memory in the forward of layer 0: "
      [[ $json == *"$want"*"(asked for 4.0 EiB; the allocator holds "* ]] ||
        { fail "$name: am-diag's detail does not start with $want... (asked for 4.0 EiB; ...)"; ok=0; }
    fi
    if [[ $kind == nan ]]; then
      [[ $json == *'"tensor":"model.layers.2.input_layernorm.weight"'* ]] ||
        { fail "$name: am-diag does not name the poisoned tensor"; ok=0; }
    fi
    want="{\"rank\":$rank,\"host\":\"$($hostfn "$rank")\",\"verdict\":\"first_failure\""
    [[ $json == *"$want"* ]] || { fail "$name: no $want"; ok=0; }
    verdict=victim
  fi
  for ((r = 0; r < world; r++)); do
    [[ $r == "$rank" ]] && continue
    want="{\"rank\":$r,\"host\":\"$($hostfn "$r")\",\"verdict\":\"$verdict\""
    [[ $json == *"$want"* ]] || { fail "$name: rank $r is not a $verdict: no $want"; ok=0; }
  done
  [[ $json == *'"missing_ranks":[],"mismatches":[]'* ]] || { fail "$name: missing ranks or mismatches reported"; ok=0; }
  # teardown: the exit records within TEARDOWN_S of each other; no collective timeout but in a hang
  local spread
  spread=$(grep -h '"type":"exit"' "$dir"/rank-*.jsonl | sed -E 's/.*"time":([0-9.]+)\}$/\1/' |
    awk 'NR == 1 || $1 < lo { lo = $1 } NR == 1 || $1 > hi { hi = $1 } END { printf "%.3f", hi - lo }')
  awk -v s="$spread" -v b="$TEARDOWN_S" 'BEGIN { exit !(s <= b) }' ||
    { fail "$name: the ranks ended ${spread}s apart, more than ${TEARDOWN_S}s"; ok=0; }
  case $kind in
    hang | hang-in-collective)
      grep -qh '"cause":"timeout","by":"watchdog"' "$dir"/rank-*.jsonl ||
        { fail "$name: no rank's watchdog caught the hang"; ok=0; } ;;
    *)
      if grep -qh '"cause":"timeout"' "$dir"/rank-*.jsonl; then
        fail "$name: a rank waited until its collective timed out"; ok=0
      fi ;;
  esac
  if [[ $ok == 1 ]]; then
    pass "$name: ended with $rc in ${wall}s (ranks ended within ${spread}s); am-diag: $(printf '%s' "$json" |
      grep -o '"first_failure":{"rank":[^,]*,"host":[^,]*,"cause":[^,]*,"signal":[^,]*' || echo clean)"
  else
    printf '  ---- am-diag %s\n' "$dir"
    "$DIAG" "$dir" | sed 's/^/    /' | head -n 40
  fi
}

# memory_cgroup NAME LIMIT_BYTES: creates a child of this shell's memory cgroup with a limit
# and prints its path with the name of its limit file ("PATH FILE"); fails where none can be
# made (not root, no memory controller, read-only cgroupfs).
# finish_case MODE NAME KIND RANK STEP WORLD START LOGS: after a job, with RC its status: sets
# WALL and DIR (the job's log directory) and checks the case; shows stderr on failure.
finish_case() {
  local mode=$1 name=$2 kind=$3 rank=$4 step=$5 world=$6 start=$7 logs=$8
  WALL=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  DIR=$(find "$logs" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  check_case "$mode $kind at rank $rank, step $step" "$kind" "$rank" "$step" "$world" "$DIR" "$RC" "$WALL" host_of
  [[ $FAILED == 0 ]] || sed 's/^/    stderr: /' "$T/$name/err" | head -n 20
}

memory_cgroup() {
  local cg limit v1 v2
  v1=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
  if [[ -n $v1 && -d /sys/fs/cgroup/memory ]]; then
    cg=/sys/fs/cgroup/memory${v1%/}/$1
    limit=memory.limit_in_bytes
  elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    v2=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
    cg=/sys/fs/cgroup${v2%/}/$1
    limit=memory.max
  else
    return 1
  fi
  mkdir "$cg" 2>/dev/null || return 1
  if ! echo "$2" >"$cg/$limit" 2>/dev/null; then
    rmdir "$cg"
    return 1
  fi
  echo "$cg $limit"
}

finish() {
  if [[ $FAILED -eq 0 ]]; then
    printf '%s: all %d cases passed\n' "$TEST_NAME" "$CASES"
    exit 0
  fi
  printf '%s: some checks FAILED\n' "$TEST_NAME"
  exit 1
}
