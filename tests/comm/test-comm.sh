#!/bin/sh
# tests/comm/test-comm.sh - every communicator operation x dtype x edge size (comm_check) on
# 1, 2, 3, 4 and 8 ranks started by the standalone launcher (UCX backend), then on 3 and 4
# ranks with every allreduce taking the ring path in 64-byte segments and a 3-slot staging
# window (empty chunks, many segments, uneven chunks). Fails, never skips.
set -u
B=${AM_BUILDDIR:-$(pwd)}
S=${AM_SRCDIR:-$(dirname "$0")/../..}
recipe=$S/sbatch-templates/recipes/tiny.yaml
logs=$(mktemp -d "${TMPDIR:-/tmp}/am-test-comm.XXXXXX") || exit 1
trap 'rm -rf "$logs"' EXIT
export AM_LOG_DIR="$logs/am-logs" AM_COMM_TIMEOUT="${AM_COMM_TIMEOUT:-60}"
failed=0

run() { # NAME NPROC [VAR=VALUE...]
  name=$1 n=$2
  shift 2
  start=$(date +%s)
  if env "$@" timeout 600 "$B/am-launch" --nproc "$n" "$recipe" -- "$B/tests/comm/comm_check" >"$logs/out" 2>&1 &&
     [ "$(grep -c 'checks passed' "$logs/out")" -eq "$n" ]; then
    echo "ok - $name: $n ranks ($(( $(date +%s) - start )) s; $(grep -m1 'checks passed' "$logs/out" | sed 's/.*: //'))"
  else
    echo "not ok - $name: $n ranks"
    sed 's/^/#   /' "$logs/out" | tail -n 30
    failed=1
  fi
}

for n in 1 2 3 4 8; do
  run "every op x dtype x size" "$n"
done
for n in 3 4; do
  run "ring path, 64-byte segments" "$n" AM_COMM_UCX_SMALL=0 AM_COMM_UCX_SEGMENT=64 AM_COMM_UCX_WINDOW=3 \
    COMM_CHECK_BIG_BYTES=100000
done
exit $failed
