#!/usr/bin/env bash
# tests/comm/test-srun-comm.sh - comm_check (every communicator operation x dtype x edge size,
# UCX backend) under `srun --mpi=pmix am-launch` on the local Slurm cluster (tests/slurm/
# cluster: 4 nodes on this machine), 4 nodes x 2 tasks, with block and then cyclic task
# distribution; asserts that every rank passed and ran on the node the distribution puts it on.
# Starts its own cluster and stops it on exit; fails (never skips) when it cannot start.
# Alone: AM_BUILDDIR=$PWD AM_SRCDIR=$PWD tests/comm/test-srun-comm.sh   (AM_TEST_KEEP=1 keeps logs)
set -uo pipefail

SRCDIR=${AM_SRCDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILDDIR=${AM_BUILDDIR:-$SRCDIR}
CLUSTER=$SRCDIR/tests/slurm/cluster
AM_CLUSTER_DIR=/tmp/am-comm-srun.$$
export -n AM_BUILDDIR AM_SRCDIR AM_CLUSTER_DIR 2>/dev/null
unset AM_RECIPE AM_LOG_DIR SLURM_JOB_ID SLURM_JOBID UCX_TLS
cluster() { AM_CLUSTER_DIR=$AM_CLUSTER_DIR "$CLUSTER" "$@"; }
WORK=$(mktemp -d /tmp/am-comm-srun-work.XXXXXX) || { echo "test-srun-comm: no work directory"; exit 1; }
FAILED=0
cleanup() {
  local rc=$?
  cluster down >/dev/null 2>&1 || echo "test-srun-comm: warning: cluster down failed"
  if [[ ${AM_TEST_KEEP:-0} == 1 || $FAILED -ne 0 || $rc -ne 0 ]]; then
    echo "test-srun-comm: work directory kept: $WORK; cluster logs: $AM_CLUSTER_DIR/log"
  else
    cluster down --purge >/dev/null 2>&1
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

for f in "$BUILDDIR/am-launch" "$BUILDDIR/tests/comm/comm_check"; do
  [[ -x $f ]] || { echo "test-srun-comm: FAIL: no $f (build first: make check)"; exit 1; }
done
chmod 0755 "$WORK"
cluster up >"$WORK/cluster-up.log" 2>&1 || { echo "test-srun-comm: FAIL: the cluster did not start:"; cat "$WORK/cluster-up.log"; exit 1; }
eval "$(cluster env)"
cd "$WORK" || exit 1

for dist in block cyclic; do
  start=$(date +%s)
  AM_LOG_DIR=$WORK/logs-$dist AM_COMM_TIMEOUT=60 COMM_CHECK_BIG_BYTES=$((1 << 20)) \
    timeout 600 srun -N 4 --ntasks-per-node=2 --distribution="$dist" --mpi=pmix --kill-on-bad-exit=1 \
    "$BUILDDIR/am-launch" "$SRCDIR/sbatch-templates/recipes/tiny.yaml" -- "$BUILDDIR/tests/comm/comm_check" \
    >"$WORK/$dist.out" 2>&1
  rc=$?
  bad=""
  for r in 0 1 2 3 4 5 6 7; do
    if [[ $dist == block ]]; then node=n$((r / 2 + 1)); else node=n$((r % 4 + 1)); fi
    grep -q "^comm_check: rank $r/8 on $node: .* checks passed" "$WORK/$dist.out" || bad="$bad $r"
  done
  if [[ $rc -eq 0 && -z $bad ]]; then
    echo "ok - srun 4 nodes x 2 tasks, $dist distribution ($(( $(date +%s) - start )) s)"
  else
    echo "not ok - srun 4 nodes x 2 tasks, $dist distribution: exit status $rc; ranks not passing on their node:$bad"
    sed 's/^/#   /' "$WORK/$dist.out" | tail -n 30
    FAILED=1
  fi
done
exit $FAILED
