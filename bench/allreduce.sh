#!/usr/bin/env bash
# bench/allreduce.sh - allreduce bus bandwidth of am's communicators (UCX backend, host memory,
# standalone launcher) against Open MPI's MPI_Allreduce, on this machine, same rank counts, run
# side by side (the two alternate, REPEAT times each) and printed as one table with the ratio.
#
#   bench/allreduce.sh [--ranks "2 4"] [--min 1M] [--max 256M] [--step 4] [--repeat 3] [--no-latency]
#
# Bus bandwidth as nccl-tests defines it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n,
# fp32 sum, out of place; each program times every call after a barrier, takes the slowest
# rank, and reports the median over its iterations after 2 warm-up calls (bench/allreduce.c,
# bench/allreduce_mpi.c); this script reports the median over the REPEAT runs. Small-message
# latency (8 B .. 64 KiB) follows, for information. Needs mpicc and mpirun (Debian:
# openmpi-bin libopenmpi-dev, in scripts/install-deps); run as root, mpirun gets
# --allow-run-as-root. With more ranks than CPUs the ranks share CPUs (--oversubscribe).
# Environment: AM_BUILDDIR, AM_SRCDIR (default: this checkout), MPIRUN_ARGS (extra mpirun flags).
set -euo pipefail

SRCDIR=${AM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
BUILDDIR=${AM_BUILDDIR:-$SRCDIR}
RANKS="2 4" MIN=1M MAX=256M STEP=4 REPEAT=3 LATENCY=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --ranks) RANKS=$2; shift 2 ;;
    --min) MIN=$2; shift 2 ;;
    --max) MAX=$2; shift 2 ;;
    --step) STEP=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --no-latency) LATENCY=0; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "allreduce.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "allreduce.sh: needs mpicc and mpirun: apt-get install openmpi-bin libopenmpi-dev" >&2
  exit 1
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/am-bench-allreduce.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
make -s -C "$BUILDDIR" bench/allreduce >/dev/null
mpicc -O2 -o "$WORK/allreduce_mpi" "$SRCDIR/bench/allreduce_mpi.c"
RECIPE=$SRCDIR/sbatch-templates/recipes/tiny.yaml
export AM_LOG_DIR=$WORK/am-logs
ROOT_ARGS=()
[[ $(id -u) -eq 0 ]] && ROOT_ARGS=(--allow-run-as-root)

am() { # NP ARGS...
  local np=$1; shift
  "$BUILDDIR/am-launch" --nproc "$np" "$RECIPE" -- "$BUILDDIR/bench/allreduce" "$@" | grep -v '^#'
}
ompi() { # NP ARGS...
  local np=$1; shift
  # shellcheck disable=SC2086
  mpirun "${ROOT_ARGS[@]}" --oversubscribe -np "$np" ${MPIRUN_ARGS:-} "$WORK/allreduce_mpi" "$@" | grep -v '^#'
}

# median of column COL (1-based) per size over files: prints "bytes median"
medians() { # COL FILE...
  local col=$1; shift
  cat "$@" | awk -v c="$col" '{ v[$1] = v[$1] " " $c } END { for (b in v) print b, v[b] }' |
    while read -r bytes vals; do
      printf '%s %s\n' "$bytes" "$(tr ' ' '\n' <<<"$vals" | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')"
    done | sort -k1,1 # join(1) wants lexical order
}

human() { awk -v b="$1" 'BEGIN { if (b >= 1048576) printf "%g MiB", b / 1048576; else if (b >= 1024) printf "%g KiB", b / 1024; else printf "%d B", b }'; }

echo "# allreduce, fp32 sum: am (UCX backend, am-launch --nproc N) vs Open MPI MPI_Allreduce (mpirun -np N)"
echo "# $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p')); $(mpirun --version 2>/dev/null | head -n1);" \
  "UCX $(pkg-config --modversion ucx 2>/dev/null || echo '?'); median of $REPEAT runs each"
for np in $RANKS; do
  over=""; [[ $np -gt $(nproc) ]] && over=" (oversubscribed: $np ranks on $(nproc) CPUs)"
  for ((i = 1; i <= REPEAT; i++)); do
    am "$np" --min "$MIN" --max "$MAX" --step "$STEP" >"$WORK/am.$np.$i"
    ompi "$np" --min "$MIN" --max "$MAX" --step "$STEP" >"$WORK/mpi.$np.$i"
  done
  echo
  echo "## $np ranks$over: bus bandwidth, GB/s"
  printf '%-10s %14s %14s %12s\n' "size" "am busbw" "OpenMPI busbw" "am/OpenMPI"
  join <(medians 4 "$WORK"/am."$np".*) <(medians 4 "$WORK"/mpi."$np".*) | sort -n |
    while read -r bytes a m; do
      printf '%-10s %14.3f %14.3f %12.2f\n' "$(human "$bytes")" "$a" "$m" "$(awk -v a="$a" -v m="$m" 'BEGIN { print a / m }')"
    done
  if [[ $LATENCY == 1 ]]; then
    for ((i = 1; i <= REPEAT; i++)); do
      am "$np" --min 8 --max 64K --step 2 >"$WORK/lam.$np.$i"
      ompi "$np" --min 8 --max 64K --step 2 >"$WORK/lmpi.$np.$i"
    done
    echo
    echo "## $np ranks$over: small-message latency, microseconds"
    printf '%-10s %14s %14s %12s\n' "size" "am time" "OpenMPI time" "am/OpenMPI"
    join <(medians 2 "$WORK"/lam."$np".*) <(medians 2 "$WORK"/lmpi."$np".*) | sort -n |
      while read -r bytes a m; do
        printf '%-10s %14.1f %14.1f %12.2f\n' "$(human "$bytes")" "$a" "$m" "$(awk -v a="$a" -v m="$m" 'BEGIN { print a / m }')"
      done
  fi
done
