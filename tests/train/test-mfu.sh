#!/usr/bin/env bash
# test-mfu.sh - the step's MFU (train/records.c): with AM_PEAK_TFLOPS set, every step record holds
# flops (this rank's share of am-plan's flops_per_step), peak_flops and mfu, and mfu equals
# flops / step_s / peak_flops of the same record; rank 0's step line shows it; without a peak
# (the CPU) there is no mfu field and no MFU in the line; a bad AM_PEAK_TFLOPS is refused
# with its message.
set -uo pipefail
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_FAULT AM_LOG_DIR AM_PEAK_TFLOPS 2>/dev/null || true
T=$(mktemp -d /tmp/am-mfu.XXXXXX)
trap 'rm -rf "$T"' EXIT
FAILED=0
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILED=1; }

"$AM_BUILDDIR/am-data" build --bytes --out "$T/corpus" "$AM_SRCDIR"/runtime/*/*.c >/dev/null || { echo "FAIL: corpus"; exit 1; }
sed -e "s|paths: .*|paths: $T/corpus|" -e 's/max_steps: .*/max_steps: 3/' -e 's/local_batch_size: .*/local_batch_size: 2/' \
  "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$T/tiny.yaml"
plan_flops=$("$AM_BUILDDIR/am-plan" "$T/tiny.yaml" --nodes 1 --gpus-per-node 2 --json |
  grep -o '"flops_per_step": *[0-9.e+]*' | sed 's/.*: *//')
[[ -n $plan_flops ]] || { echo "FAIL: am-plan printed no flops_per_step"; exit 1; }

# run NAME [VAR=VALUE...]: a 2-rank job; sets RC, LOG (rank 0's log), OUT
run() {
  local name=$1
  shift
  (cd "$T" && env "$@" timeout 60 "$AM_BUILDDIR/am-launch" --nproc 2 --log-dir "$T/$name" "$T/tiny.yaml") \
    >"$T/$name.out" 2>"$T/$name.err"
  RC=$?
  LOG=$(ls "$T/$name"/*/rank-0.jsonl 2>/dev/null | head -n 1)
  OUT=$T/$name.out
}

run peak AM_PEAK_TFLOPS=0.05
if [[ $RC != 0 || -z $LOG ]]; then
  fail "AM_PEAK_TFLOPS=0.05: the job exited $RC"; sed 's/^/  /' "$T/peak.err" | head
else
  # every step record: mfu == flops / step_s / peak_flops; flops * world == am-plan's
  check=$(awk -v plan="$plan_flops" '
    /"type":"step"/ {
      n++
      match($0, /"flops":[0-9.e+-]+/); f = substr($0, RSTART + 8, RLENGTH - 8)
      match($0, /"peak_flops":[0-9.e+-]+/); p = substr($0, RSTART + 13, RLENGTH - 13)
      match($0, /"mfu":[0-9.e+-]+/); m = substr($0, RSTART + 6, RLENGTH - 6)
      match($0, /"step_s":[0-9.e+-]+/); s = substr($0, RSTART + 9, RLENGTH - 9)
      if (f == "" || p == "" || m == "" || s == "") { print "step " n ": a field is missing: " $0; bad = 1; next }
      want = f / s / p
      if ((m - want) > 1e-12 * want || (want - m) > 1e-12 * want) { print "step " n ": mfu " m " != " want; bad = 1 }
      if (p + 0 != 5e10) { print "step " n ": peak_flops " p " != 5e10"; bad = 1 }
      if ((f * 2 - plan) > 1e-9 * plan || (plan - f * 2) > 1e-9 * plan) { print "step " n ": flops*2 " f * 2 " != am-plan " plan; bad = 1 }
    }
    END { if (n != 3) { print "found " n " step records, want 3"; bad = 1 } if (!bad) print "ok" }' "$LOG")
  [[ $check == ok ]] && pass "mfu = flops / step_s / peak_flops in every step record; flops x world = am-plan's $plan_flops" ||
    fail "step records: $check"
  grep -q '"peak_from":"AM_PEAK_TFLOPS"' "$LOG" && pass "the start record says where the peak came from" ||
    fail "no peak_from in the start record"
  # the step line: MFU in percent, the same value as the record's (rounded to 0.1)
  line=$(grep -m1 '^step    1/3' "$OUT")
  rec=$(grep -m1 '"type":"step","step":1,' "$LOG" | grep -o '"mfu":[0-9.e+-]*' | sed 's/"mfu"://')
  want=$(awk -v m="$rec" 'BEGIN { printf "| MFU %.1f%% |", 100 * m }')
  [[ $line == *"$want"* ]] && pass "rank 0's step line shows ${want//|/}" || fail "step line '$line' lacks '$want'"
fi

run nopeak
if [[ $RC != 0 || -z $LOG ]]; then
  fail "without AM_PEAK_TFLOPS: the job exited $RC"
else
  ! grep -q '"mfu"' "$LOG" && pass "on the CPU without AM_PEAK_TFLOPS: no mfu field" || fail "an mfu field without a peak"
  ! grep -q 'MFU' "$OUT" && pass "... and no MFU in the step line" || fail "MFU in the step line without a peak"
fi

run bad AM_PEAK_TFLOPS=fast
want="AM_PEAK_TFLOPS=fast: not a number of TFLOP/s above 0 (the device's dense peak for the step line's MFU, e.g. AM_PEAK_TFLOPS=989)"
[[ $RC != 0 ]] && grep -qF "$want" "$T/bad.err" && pass "AM_PEAK_TFLOPS=fast is refused: $want" ||
  { fail "AM_PEAK_TFLOPS=fast: exit $RC, want the message: $want"; sed 's/^/  /' "$T/bad.err" | head -5; }

[[ $FAILED == 0 ]] && { echo "test-mfu.sh: all passed"; exit 0; }
exit 1
