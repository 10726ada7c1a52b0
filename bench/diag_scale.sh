#!/usr/bin/env bash
# bench/diag_scale.sh - how am-diag's time and memory grow with the job: synthetic logs of
# 64, 256, 1024 and 4096 ranks (bench/diag_logs: 8 flight groups per rank, full 1024-entry
# flight recorders, 10k step records per rank, one rank segfaulting, every other stopped
# while waiting), am-diag run on each, its output checked (it must name the injected rank).
#
#   bench/diag_scale.sh [--ranks "64 256 1024 4096"] [--steps 10000] [--ring 1024] [--dir DIR]
#                       [--threads N] [--peer BUILDDIR] [--keep]
#
# Per size: the logs' bytes; am-diag's wall time, CPU time (user + sys) and peak RSS, from
# /usr/bin/time (else python3's getrusage), on a warm page cache (a first run reads the logs
# in, the second is measured); the CPU time per rank and per MB, whose flatness across sizes
# is the claim (linear growth). The logs are deleted after each size (4096 ranks: about 7 GB)
# unless --keep. --threads: am-diag --threads (default: one per CPU, at most 16). --peer: also
# run BUILDDIR/am-diag (another build: the reader before a change) on the same logs, the two
# alternating (each measured twice, the lower CPU time kept), its reports required identical,
# and print its row and the ratio of the CPU times (peer / this build).
# Environment: AM_BUILDDIR (default: this checkout).
set -euo pipefail
SRCDIR=$(cd "$(dirname "$0")/.." && pwd)
BUILDDIR=${AM_BUILDDIR:-$SRCDIR}
RANKS="64 256 1024 4096" STEPS=10000 RING=1024 DIR="" KEEP=0 THREADS="" PEER=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --ranks) RANKS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --ring) RING=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --threads) THREADS="--threads $2"; shift 2 ;;
    --peer) PEER=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "diag_scale.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
GEN=$BUILDDIR/bench/diag_logs DIAG=$BUILDDIR/am-diag
[[ -x $GEN && -x $DIAG ]] || { echo "diag_scale.sh: build first: make am-diag bench/diag_logs" >&2; exit 2; }
[[ -z $PEER || -x $PEER/am-diag ]] || { echo "diag_scale.sh: --peer $PEER: no am-diag there (build it first)" >&2; exit 2; }
if [[ -z $DIR ]]; then DIR=$(mktemp -d); trap 'rm -rf "$DIR"' EXIT; fi

# measure OUT CMD...: runs CMD with stdout to OUT; prints "wall_s cpu_s rss_kb"
measure() {
  local out=$1; shift
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -f '%e %U %S %M' -o "$DIR/time" "$@" >"$out" 2>/dev/null || true
    tail -n 1 "$DIR/time" | awk '{ printf "%s %.2f %s\n", $1, $2 + $3, $4 }'
  else
    python3 - "$out" "$@" <<'PY'
import resource, subprocess, sys, time
t = time.monotonic()
with open(sys.argv[1], "w") as f:
    subprocess.run(sys.argv[2:], stdout=f, stderr=subprocess.DEVNULL)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print("%.2f %.2f %d" % (time.monotonic() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss))
PY
  fi
}

printf '%-6s %9s %8s %8s %9s %12s %9s  %s\n' ranks log_MB wall_s cpu_s rss_MB cpu_ms/rank MB/cpu_s culprit
status=0
for n in $RANKS; do
  logs=$DIR/$n
  rm -rf "$logs"
  culprit=$("$GEN" "$logs" "$n" "$STEPS" "$RING")
  mb=$(du -sm "$logs" | cut -f1)
  "$DIAG" $THREADS "$logs" >/dev/null 2>&1 || true   # the page cache
  read -r wall cpu rss < <(measure "$DIR/out.$n" "$DIAG" $THREADS "$logs")
  if [[ -n $PEER ]]; then # alternating: this build, the peer, this build, the peer
    read -r pwall pcpu prss < <(measure "$DIR/peer.$n" "$PEER/am-diag" $THREADS "$logs")
    read -r wall2 cpu2 rss2 < <(measure "$DIR/out.$n" "$DIAG" $THREADS "$logs")
    read -r pwall2 pcpu2 prss2 < <(measure "$DIR/peer.$n" "$PEER/am-diag" $THREADS "$logs")
    if awk -v a="$cpu2" -v b="$cpu" 'BEGIN { exit !(a < b) }'; then wall=$wall2 cpu=$cpu2 rss=$rss2; fi
    if awk -v a="$pcpu2" -v b="$pcpu" 'BEGIN { exit !(a < b) }'; then pwall=$pwall2 pcpu=$pcpu2 prss=$prss2; fi
  fi
  if grep -q "^first failure: rank $culprit on node" "$DIR/out.$n" &&
     grep -q "^others: $((n - 1)) victims" "$DIR/out.$n"; then
    named="rank $culprit named"
  else
    named="WRONG: $(sed -n 2p "$DIR/out.$n")"; status=1
  fi
  [[ -z $PEER ]] || cmp -s "$DIR/out.$n" "$DIR/peer.$n" || { named="$named; PEER'S REPORT DIFFERS"; status=1; }
  rm -f "$DIR/out.$n"
  awk -v n="$n" -v mb="$mb" -v wall="$wall" -v cpu="$cpu" -v rss="$rss" -v named="$named" 'BEGIN {
    printf "%-6d %9d %8.2f %8.2f %9.0f %12.2f %9.0f  %s\n", n, mb, wall, cpu, rss / 1024, 1000 * cpu / n,
           (cpu > 0 ? mb / cpu : 0), named }'
  if [[ -n $PEER ]]; then
    awk -v n="$n" -v mb="$mb" -v wall="$pwall" -v cpu="$pcpu" -v rss="$prss" -v ratio="$(awk -v a="$pcpu" -v b="$cpu" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')" 'BEGIN {
      printf "%-6s %9d %8.2f %8.2f %9.0f %12.2f %9.0f  peer (CPU %s times this build'"'"'s)\n", "(peer)", mb, wall, cpu, rss / 1024,
             1000 * cpu / n, (cpu > 0 ? mb / cpu : 0), ratio }'
    rm -f "$DIR/peer.$n"
  fi
  [[ $KEEP == 1 ]] || rm -rf "$logs"
done
exit $status
