#!/usr/bin/env bash
# bench/bootstrap.sh - bootstrap time as ranks grow: am-launch standalone with 1, 2, 4, 8
# ranks, and srun --mpi=pmix on a private local Slurm cluster (tests/slurm/cluster, started
# and stopped here) with 2, 4, 8, 16 ranks over up to 4 nodes.
#
# Per run: launch_s = wall time of the whole am-launch (or srun) command; the rest from
# bench/boot_bench, the slowest rank: init_ms = connecting to the launcher (hello),
# first_ms = init + the first allgather of a 64-byte blob + a fence, round_ms = the median
# of 20 more allgather + fence rounds. Each configuration runs REPEAT times (default 3) and
# the median run (by first_ms) is shown.
#
# Usage: bench/bootstrap.sh [--no-srun]     (from the build directory, after make check)
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${AM_BUILDDIR:-$PWD}
REPEAT=${REPEAT:-3}
LAUNCH=$BUILD/am-launch
BENCH=$BUILD/bench/boot_bench
RECIPE=$SRC/sbatch-templates/recipes/tiny.yaml
[[ -x $BENCH ]] || make -C "$BUILD" bench/boot_bench >/dev/null || { echo "cannot build $BENCH" >&2; exit 1; }
T=$(mktemp -d /tmp/am-bench-boot.XXXXXX)
CLUSTER_UP=0
cleanup() {
  [[ $CLUSTER_UP -eq 1 ]] && "$SRC/tests/slurm/cluster" down --purge >/dev/null 2>&1
  rm -rf "$T"
}
trap cleanup EXIT

# one MODE RANKS COMMAND...: prints a table row (median of REPEAT runs by first_ms)
one() {
  local mode=$1 ranks=$2 i t0 line
  shift 2
  : >"$T/runs"
  for ((i = 0; i < REPEAT; i++)); do
    t0=$EPOCHREALTIME
    line=$("$@" 2>"$T/err" | grep '^ranks=')
    [[ -n $line ]] || { echo "$mode $ranks: failed:" >&2; cat "$T/err" >&2; return 1; }
    awk -v a="$t0" -v b="$EPOCHREALTIME" -v l="$line" 'BEGIN {
      n = split(l, f, /[ =]/); printf "%.3f %s %s %s\n", b - a, f[4], f[6], f[8] }' >>"$T/runs"
  done
  sort -k3,3n "$T/runs" | awk -v m="$mode" -v r="$ranks" -v k="$REPEAT" 'NR == int((k + 1) / 2) {
    printf "%-10s %6d %9.2f %9.2f %9.2f %9.3f\n", m, r, $1, $2, $3, $4 }'
}

printf '%-10s %6s %9s %9s %9s %9s\n' mode ranks launch_s init_ms first_ms round_ms
for n in 1 2 4 8; do
  one standalone $n "$LAUNCH" --log-dir "$T/logs" --nproc $n "$RECIPE" -- "$BENCH"
done
[[ ${1:-} == --no-srun ]] && exit 0

export AM_CLUSTER_DIR=/tmp/am-cluster-bench-$$
"$SRC/tests/slurm/cluster" up >"$T/cluster.log" 2>&1 || { echo "cannot start the local cluster:" >&2; cat "$T/cluster.log" >&2; exit 1; }
CLUSTER_UP=1
eval "$("$SRC/tests/slurm/cluster" env)"
for n in 2 4 8 16; do
  nodes=$((n < 4 ? n : 4))
  one srun $n srun -N$nodes -n$n --ntasks-per-node=$((n / nodes)) --mpi=pmix "$LAUNCH" --log-dir "$T/logs" "$RECIPE" -- "$BENCH"
done
