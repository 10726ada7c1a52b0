#!/usr/bin/env bash
# test-leftovers.sh - `am-launch --nproc` leaves no process behind (launcher/reaper.h): the
# rank programs are shells whose child `sleep` would outlive a supervisor that signalled only
# the rank's pid. Each case asserts am-launch's exact exit status and that no process with
# that sleep's command line (unique to this run) survives: SIGTERM, SIGINT and SIGHUP to
# am-launch, the SIGKILL after the grace period (ranks that ignore SIGTERM), a rank that
# fails with a child left in the background, a child that left the rank's process group
# (setsid), and a SIGKILL of am-launch itself (the guard). Then --nproc above the open-file
# limit: the soft limit raised when the hard one allows, else one exact error.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

T=$(mktemp -d /tmp/am-test-leftovers.XXXXXX)
LAUNCHED=()
cleanup() {
  local p
  for p in "${LAUNCHED[@]}"; do kill -KILL "$p" 2>/dev/null; done
  pkill -KILL -f "^sleep 7$$[0-9]$" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
cd "$T" || exit 1

# count PATTERN: processes whose whole command line is PATTERN
count() { pgrep -cxf "$1" || true; }

# wait_count PATTERN N SECONDS: until exactly N such processes run
wait_count() {
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    [[ $(count "$1") == "$2" ]] && return 0
    sleep 0.1
  done
  return 1
}

# none_left NAME PATTERN: no process with that command line (checked at once: am-launch
# has returned, and everything it started must be gone)
none_left() {
  local n
  n=$(count "$2")
  if [[ $n == 0 ]]; then pass "$1: no '$2' left"; else fail "$1: $n '$2' left: $(pgrep -axf "$2" | tr '\n' ';')"; fi
}

# start NAME PROGRAM-ARGS...: am-launch --nproc 2 in the background; sets PID
start() {
  local name=$1
  shift
  "$LAUNCH" --nproc 2 --log-dir "$T/$name" "$RECIPE" -- "$@" >"$T/$name.out" 2>"$T/$name.err" &
  PID=$!
  LAUNCHED+=("$PID")
}

# ---- stop signals reach each rank's whole process group ---------------------------------
n=0
for sig in TERM INT HUP; do
  n=$((n + 1))
  s="sleep 7$$$n"
  start "$sig" sh -c "$s; echo done"
  wait_count "$s" 2 10 || fail "SIG$sig: the two sleeps did not start"
  kill -s "$sig" "$PID"
  wait "$PID"
  rc=$?
  case $sig in TERM) want=143 ;; INT) want=130 ;; HUP) want=129 ;; esac
  expect_rc "SIG$sig to am-launch" "$want" "$rc" "$T/$sig.err"
  none_left "SIG$sig to am-launch" "$s"
  expect_line "SIG$sig reported" "$T/$sig.err" "am-launch: got SIG$sig, stopping every rank"
done
grep -q '^done$' "$T/TERM.out" && fail "a rank's shell went on after its sleep was stopped" || pass "no rank went on"

# ---- ranks that ignore SIGTERM: SIGKILL for the whole group after the grace period --------
s="sleep 7${$}4"
start ignore sh -c "trap '' TERM; $s; echo done"
wait_count "$s" 2 10 || fail "ignore: the two sleeps did not start"
t0=$EPOCHREALTIME
kill -TERM "$PID"
wait "$PID"
rc=$?
secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
expect_rc "ranks ignoring SIGTERM" 143 "$rc" "$T/ignore.err"
awk -v s="$secs" 'BEGIN { exit !(s >= 4.5 && s < 9) }' && pass "SIGKILL after the grace period (${secs}s)" ||
  fail "ranks ignoring SIGTERM ended after ${secs}s (grace period 5 s)"
none_left "SIGKILL after the grace period" "$s"

# ---- a rank fails and leaves a child in the background; the other is stopped -------------
s="sleep 7${$}5"
start fails sh -c "$s & if [ \$AM_RANK = 1 ]; then sleep 0.5; exit 3; fi; wait"
wait "$PID"
rc=$?
expect_rc "rank 1 exits 3" 3 "$rc" "$T/fails.err"
expect_line "rank 1's failure reported" "$T/fails.err" "am-launch: rank 1 on $(hostname) exited with status 3; stopping the other ranks"
none_left "a failed rank's background child and the stopped rank's" "$s"

# ---- a child that left the rank's process group is collected as an orphan ----------------
s="sleep 7${$}6"
start setsid sh -c "setsid $s & sleep 0.3; exit 0"
wait "$PID"
rc=$?
expect_rc "ranks whose child left their group" 0 "$rc" "$T/setsid.err"
none_left "a child in its own session" "$s"

# ---- SIGKILL of am-launch: the ranks die with it, the guard kills their groups ------------
s="sleep 7${$}7"
start killed sh -c "$s; echo done"
wait_count "$s" 2 10 || fail "killed: the two sleeps did not start"
kill -KILL "$PID"
wait "$PID"
rc=$?
expect_rc "SIGKILL to am-launch" 137 "$rc" "$T/killed.err"
wait_count "$s" 0 3
none_left "SIGKILL to am-launch (after up to 3 s)" "$s"
left=$(pgrep -af -- "--log-dir $T/killed " | grep -v pgrep || true)
[[ -z $left ]] && pass "the guard ended too" || fail "left after SIGKILL: $left"

# ---- the open-file limit ------------------------------------------------------------------
(ulimit -n 1024 && exec "$LAUNCH" --nproc 1100 --log-dir "$T/nofile" "$RECIPE" -- true) >"$T/nofile.out" 2>"$T/nofile.err"
expect_rc "--nproc 1100 under ulimit -n 1024" 2 "$?" "$T/nofile.err"
cat >"$T/nofile.want" <<'EOF'
am-launch: --nproc 1100 needs 1116 open files (one per rank and 16 for itself), more than the open-file limit allows (ulimit -n: 1024, hard limit 1024): raise it with `ulimit -n 1116` (above the hard limit only as root, or with nofile in /etc/security/limits.conf), or start at most 1008 ranks
EOF
diff "$T/nofile.want" "$T/nofile.err" >"$T/nofile.diff" && pass "--nproc 1100: one exact error" ||
  { fail "--nproc 1100: stderr differs"; show "$T/nofile.diff"; }
[[ ! -e $T/nofile ]] && pass "--nproc 1100: nothing started" || fail "--nproc 1100: a log directory was created"

(ulimit -Sn 32 && ulimit -Hn 256 && exec "$LAUNCH" --nproc 40 --log-dir "$T/raised" "$RECIPE" -- sh -c 'test "$(ulimit -n)" = 56') \
  >"$T/raised.out" 2>"$T/raised.err"
expect_rc "--nproc 40 under a soft limit of 32 (hard 256): raised to 56" 0 "$?" "$T/raised.err"
[[ ! -s $T/raised.err ]] && pass "raised silently" || { fail "raising the limit printed something"; show "$T/raised.err"; }

finish
