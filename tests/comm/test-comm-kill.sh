#!/bin/sh
# tests/comm/test-comm-kill.sh - a rank that stops in the middle of a run of 8 MiB allreduces
# on 4 ranks (comm_check COMM_CHECK_DIE): the others must fail within the communicators'
# timeout (AM_COMM_TIMEOUT=3) with a message that names the operation, the group and the
# dead peer, and the launcher must end the job; a hang fails the test (60 s guard).
#   exit  the rank exits with status 0, which the launcher does not treat as a failure: the
#         survivors alone must notice (a copy from its memory fails, or the wait times out)
#   hang  the rank stops answering: the survivors' waits time out
#   kill  the rank is killed by SIGKILL: the launcher stops the job (or a survivor that was
#         copying from it reports it first)
# and the same (exit, hang) in a run of rounds in which the other ranks send the dying rank
# 8 MiB each with am_isend and wait with am_send_wait (COMM_CHECK_DIE=2:MODE:isend): the
# pending send must fail within the timeout with a message naming it and the dead peer; the
# same (exit, hang) in rounds of two non-blocking allreduces in flight (COMM_CHECK_DIE=2:MODE:
# iallreduce), waited for in reverse: the wait must fail naming the call and the dead peer.
# Last, a stalled non-blocking allreduce (COMM_CHECK_STALL, am_comm_inject_stall) on 2 ranks
# must be ended by a watchdog's abort: the wait fails with "aborted" naming the call.
set -u
B=${AM_BUILDDIR:-$(pwd)}
S=${AM_SRCDIR:-$(dirname "$0")/../..}
recipe=$S/sbatch-templates/recipes/tiny.yaml
logs=$(mktemp -d "${TMPDIR:-/tmp}/am-test-comm-kill.XXXXXX") || exit 1
trap 'rm -rf "$logs"' EXIT
export AM_LOG_DIR="$logs/am-logs" AM_COMM_TIMEOUT=3
failed=0

check() { # MODE EXPECTED-REGEX
  mode=$1 want=$2
  start=$(date +%s)
  COMM_CHECK_DIE=2:$mode timeout 60 "$B/am-launch" --nproc 4 "$recipe" -- "$B/tests/comm/comm_check" \
    >"$logs/out" 2>&1
  rc=$? took=$(( $(date +%s) - start ))
  if [ $rc -eq 124 ]; then
    echo "not ok - $mode: the job hung (killed after 60 s)"; failed=1
  elif [ $rc -eq 0 ]; then
    echo "not ok - $mode: the job succeeded"; failed=1
  elif [ $took -gt 20 ]; then
    echo "not ok - $mode: the job took $took s to fail (timeout 3 s)"; failed=1
  elif ! grep -Eq "$want" "$logs/out"; then
    echo "not ok - $mode: no message matching /$want/"; failed=1
  else
    echo "ok - $mode: failed in $took s (exit status $rc): $(grep -Em1 "$want" "$logs/out")"
    return
  fi
  sed 's/^/#   /' "$logs/out" | tail -n 20
}

peer='rank 2 \(global 2\)'
check exit "allreduce #[0-9]+ on group world \(4 ranks\) (failed.* $peer|timed out after 3 s waiting for $peer)"
check hang "allreduce #[0-9]+ on group world \(4 ranks\) timed out after 3 s waiting for $peer"
check kill "(rank 2 .*killed by signal 9|allreduce #[0-9]+ on group world \(4 ranks\) failed.* $peer)"
check exit:isend "isend #[0-9]+ to rank 2 on group world \(4 ranks\) (failed.* $peer|timed out after 3 s waiting for $peer)"
check hang:isend "isend #[0-9]+ to rank 2 on group world \(4 ranks\) timed out after 3 s waiting for $peer to take its data"
check exit:iallreduce "iallreduce #[0-9]+ on group world \(4 ranks\) (failed.* $peer|timed out after 3 s waiting for $peer)"
check hang:iallreduce "iallreduce #[0-9]+ on group world \(4 ranks\) timed out after 3 s waiting for $peer"

start=$(date +%s)
COMM_CHECK_STALL=1 timeout 60 "$B/am-launch" --nproc 2 "$recipe" -- "$B/tests/comm/comm_check" >"$logs/out" 2>&1
rc=$? took=$(( $(date +%s) - start ))
if [ $rc -eq 0 ] && [ "$(grep -Ec 'stall: iallreduce #1 on group world \(2 ranks\) aborted: the test.s watchdog' "$logs/out")" -eq 2 ]; then
  echo "ok - stall: the watchdog's abort ended the waits in $took s: $(grep -m1 'stall:' "$logs/out")"
else
  echo "not ok - stall: exit status $rc after $took s"
  sed 's/^/#   /' "$logs/out" | tail -n 20
  failed=1
fi
exit $failed
