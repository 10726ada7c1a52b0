#!/usr/bin/env bash
# test-oom.sh - a rank killed by the kernel's OOM killer is recorded as such: am-launch
# runs in a fresh memory cgroup (v1 memory.limit_in_bytes or v2 memory.max) of 64 MiB, a
# rank allocates until it is killed. Skipped (77) where no memory cgroup can be made (not
# root, read-only cgroupfs); the exit record then says "oom_killed":null or false, which
# test-standalone.sh accepts.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

T=$(mktemp -d /tmp/am-test-oom.XXXXXX)
CG=""
cleanup() {
  [[ -n $CG && -d $CG ]] && rmdir "$CG" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
HOST=$(hostname)

# the memory cgroup this shell is in, and a child of it
v1=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
if [[ -n $v1 && -d /sys/fs/cgroup/memory ]]; then
  CG=/sys/fs/cgroup/memory${v1%/}/am-oom-test-$$
  limit=memory.limit_in_bytes
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  v2=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  CG=/sys/fs/cgroup${v2%/}/am-oom-test-$$
  limit=memory.max
fi
if [[ -z $CG ]] || ! mkdir "$CG" 2>/dev/null || ! echo $((64 << 20)) >"$CG/$limit" 2>/dev/null; then
  echo "SKIP: cannot create a memory cgroup with a limit here (${CG:-none})"
  CG=""
  exit 77
fi

# a subshell moves itself into the cgroup, then runs am-launch
( echo $BASHPID >"$CG/cgroup.procs" && exec "$LAUNCH" --log-dir "$T/logs" --nproc 2 "$RECIPE" -- \
    env BOOT_CHECK_OOM=1 BOOT_CHECK_HANG=0 "$BOOT_CHECK" ) >"$T/out" 2>"$T/err"
expect_rc "OOM-killed rank" 137 $? "$T/err"
expect_line "OOM reported" "$T/err" "am-launch: rank 1 on $HOST was killed by the OOM killer (signal 9, SIGKILL): it ran out of memory; stopping the other ranks"
expect_match "OOM exit record" "$(job_dir "$T/logs")/rank-1.jsonl" "$(exit_record_re 1 "$HOST" 137 9 SIGKILL false true null)"
expect_match "the other rank is not OOM-killed" "$(job_dir "$T/logs")/rank-0.jsonl" "$(exit_record_re 0 "$HOST" 143 15 SIGTERM false false SIGTERM)"
finish
