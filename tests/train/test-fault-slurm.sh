#!/usr/bin/env bash
# test-fault-slurm.sh - the fault matrix on the local Slurm cluster (tests/slurm/cluster):
# 8 ranks over 4 nodes, `srun -N4 --ntasks-per-node=2 --mpi=pmix --am-recipe=... am-launch`
# through the SPANK plugin, every AM_FAULT kind at two (rank, step) places; checks in
# tests/train/fault-lib.sh (every rank's host is n1..n4: rank r runs on n(r/2+1)). The layout is
# tp 2 x dp 4 (--am-tp=2): tensor-parallel pairs on each node ({0,1} on n1, ...), two
# data-parallel groups of 4 across the nodes ({0,2,4,6}, {1,3,5,7}), so a failure leaves
# ranks waiting in both kinds of group. The oom kind moves each task into one memory cgroup with a 2 GiB limit first
# (skipped, with a message, where none can be made). Fails, never skips, when the cluster
# cannot start.
set -uo pipefail
source "$(dirname "$0")/fault-lib.sh"

T=$(mktemp -d /tmp/am-fault-slurm-XXXXXX)
chmod 755 "$T"
export AM_CLUSTER_DIR=$T/cluster
cluster() { "$AM_SRCDIR/tests/slurm/cluster" "$@"; }
CG=""
cleanup() {
  cluster down --purge >/dev/null 2>&1
  [[ -n $CG && -d $CG ]] && rmdir "$CG" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
host_of() { echo "n$(($1 / 2 + 1))"; }
make_recipe "$T" || { echo "FAIL: cannot build the corpus"; exit 1; }

if ! AM_SPANK_PLUGIN=$AM_BUILDDIR/.libs/spank_am.so cluster up; then
  echo "FAIL: the local Slurm cluster did not start (see above); nothing was tested"
  exit 1
fi
eval "$(cluster env)"

WORLD=8
# run NAME KIND RANK STEP [CGROUP]: one step of 8 tasks, tp 2 x dp 4; sets RC, WALL, DIR
run() {
  local name=$1 kind=$2 rank=$3 step=$4 cg=${5:-} start
  local logs=$T/$name/logs
  local -a task=("$LAUNCH")
  [[ -n $cg ]] && task=(bash -c 'echo $$ >"$0/cgroup.procs" && exec "$1"' "$cg" "$LAUNCH")
  mkdir -p "$T/$name"
  start=$(date +%s.%N)
  (cd "$T" && AM_FAULT="rank=$rank,step=$step,kind=$kind" AM_WATCHDOG_S=$WATCHDOG_S \
    exec timeout 90 srun -N 4 --ntasks-per-node=2 --mpi=pmix --am-recipe="$T/tiny.yaml" --am-tp=2 --am-log-dir="$logs" \
    "${task[@]}") >"$T/$name/out" 2>"$T/$name/err"
  RC=$?
  finish_case slurm "$name" "$kind" "$rank" "$step" $WORLD "$start" "$logs"
}

for place in "5 3" "2 2"; do
  set -- $place
  for kind in segv abort exit:3 nan kill hang hang-in-collective slow:2.5; do
    run "${kind%%:*}-$1-$2" "$kind" "$1" "$2"
  done
done

if out=$(memory_cgroup am-fault-oom-$$ $((2 << 30))); then
  CG=${out% *}
  for place in "6 2" "1 3"; do
    set -- $place
    run "oom-$1-$2" oom "$1" "$2" "$CG"
  done
else
  echo "SKIP: oom: cannot create a memory cgroup with a limit here (not root, or no writable memory controller); every other kind ran"
fi
finish
