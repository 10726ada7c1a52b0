#!/bin/sh
# tests/comm/test-comm-nccl.sh - the communicator checks on device buffers with the NCCL
# backend (comm_check_nccl: every operation x dtype x edge size, each rank's groups of every
# shape), one rank per GPU, standalone launcher. Needs a GPU machine: not part of `make check`.
#   AM_BUILDDIR=$PWD AM_SRCDIR=$PWD tests/comm/test-comm-nccl.sh [RANKS]   (default: 1)
# NCCL refuses two ranks on one GPU: RANKS must not exceed the visible GPUs.
set -u
B=${AM_BUILDDIR:-$(pwd)}
S=${AM_SRCDIR:-$(dirname "$0")/../..}
n=${1:-1}
logs=$(mktemp -d "${TMPDIR:-/tmp}/am-test-comm-nccl.XXXXXX") || exit 1
trap 'rm -rf "$logs"' EXIT
[ -x "$B/tests/comm/comm_check_nccl" ] || { echo "not ok - no $B/tests/comm/comm_check_nccl (make check with CUDA)"; exit 1; }
start=$(date +%s)
if AM_LOG_DIR=$logs AM_COMM_BACKEND=nccl AM_COMM_TIMEOUT=${AM_COMM_TIMEOUT:-120} timeout 900 \
     "$B/am-launch" --nproc "$n" "$S/sbatch-templates/recipes/tiny.yaml" -- "$B/tests/comm/comm_check_nccl" \
     >"$logs/out" 2>&1 && [ "$(grep -c 'checks passed' "$logs/out")" -eq "$n" ]; then
  echo "ok - NCCL, $n rank(s) ($(( $(date +%s) - start )) s): $(grep -m1 'checks passed' "$logs/out")"
else
  echo "not ok - NCCL, $n rank(s)"
  sed 's/^/#   /' "$logs/out" | tail -n 40
  exit 1
fi
