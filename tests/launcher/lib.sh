# tests/launcher/lib.sh - helpers for the shell tests that launch ranks with am-launch (sourced):
# the launcher's, tests/rank/test-nvml.sh and tests/doctor/test-doctor.sh.
#
# Expects AM_SRCDIR and AM_BUILDDIR (make check exports them); falls back to the tree this
# file is in, so a test also runs by hand from the build directory.

: "${AM_SRCDIR:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
LAUNCH=$AM_BUILDDIR/am-launch
BOOT_CHECK=$AM_BUILDDIR/tests/launcher/boot_check
RECIPE=$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml
# the rank programs must not inherit what a calling job set
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_TOPOLOGY_FILE AM_LOG_DIR AM_DRY_RUN \
  CUDA_VISIBLE_DEVICES SLURM_STEP_GPUS SLURM_JOB_GPUS PMIX_NAMESPACE PMIX_RANK \
  SLURM_STEP_ID SLURM_PROCID BOOT_CHECK_FAIL BOOT_CHECK_SEGV BOOT_CHECK_HANG BOOT_CHECK_EXIT \
  BOOT_CHECK_ABORT BOOT_CHECK_OOM BOOT_CHECK_WAIT BOOT_CHECK_TIMEOUT 2>/dev/null || true
ulimit -c 0

FAILED=0
TEST_NAME=${0##*/}

pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILED=1; }

# show FILE...: the files, indented, for a failure's context
show() {
  local f
  for f in "$@"; do
    printf '  ---- %s\n' "$f"
    sed 's/^/    /' "$f" 2>/dev/null | head -n 40
  done
}

# expect_rc NAME WANT GOT [FILES...]
expect_rc() {
  local name=$1 want=$2 got=$3
  shift 3
  if [[ $got == "$want" ]]; then pass "$name: exit status $got"; else fail "$name: exit status $got, want $want"; show "$@"; fi
}

# expect_line NAME FILE TEXT: FILE has a line equal to TEXT
expect_line() {
  if grep -qxF -- "$3" "$2"; then pass "$1"; else fail "$1: no line '$3' in $2"; show "$2"; fi
}

# expect_match NAME FILE ERE: FILE has a line matching the extended regex
expect_match() {
  if grep -qE -- "$3" "$2"; then pass "$1"; else fail "$1: no line matching /$3/ in $2"; show "$2"; fi
}

# expect_count NAME FILE FIXED N: FILE has exactly N lines containing FIXED
expect_count() {
  local n
  n=$(grep -cF -- "$3" "$2" || true)
  if [[ $n == "$4" ]]; then pass "$1"; else fail "$1: $n lines with '$3' in $2, want $4"; show "$2"; fi
}

# exit_record_re RANK HOST STATUS SIGNAL SIGNAME CORE OOM STOP: the regex of one exit record
# (pid and time vary; OOM, SIGNAME and STOP may be given as a regex like '(false|null)' or
# '("SIGTERM"|null)')
exit_record_re() {
  local sig=$5 stop=$8
  [[ $sig == null || $sig == \(* ]] || sig="\"$sig\""
  [[ $stop == null || $stop == \(* ]] || stop="\"$stop\""
  printf '^\\{"type":"exit","rank":%s,"host":"%s","pid":[0-9]+,"status":%s,"signal":%s,"signal_name":%s,"core_dumped":%s,"oom_killed":%s,"stop_signal":%s,"time":[0-9]+(\\.[0-9]+)?\\}$' \
    "$1" "$2" "$3" "$4" "$sig" "$6" "$7" "$stop"
}

# the one job directory under a log dir
job_dir() {
  local d
  d=$(find "$1" -mindepth 1 -maxdepth 1 -type d | head -n 1)
  printf '%s' "$d"
}

finish() {
  if [[ $FAILED -eq 0 ]]; then
    printf '%s: all checks passed\n' "$TEST_NAME"
    exit 0
  fi
  printf '%s: some checks FAILED\n' "$TEST_NAME"
  exit 1
}
