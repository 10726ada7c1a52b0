#!/bin/bash
# Packing's overhead: bench-small (4 sequences of 256 rows a step) on a dataset of short
# documents, packed (packed_sequence_size 256: whole documents back to back, each row attending
# within its document, rope restarting per document; docs/data.md, "Packed sequences") against
# the same dataset cut into plain samples of 256 tokens: the same number of rows, the same model.
#   bench/pack_small.sh [BUILDDIR] [REPEAT] [STEPS] [THREADS]   (run from the source tree;
#                     BUILDDIR defaults to ., REPEAT to 5, STEPS to 6: the first two warm up; THREADS to 1)
# The documents: 512 of 20 to 239 random tokens (the same every time), so a pack holds about
# two and pads its end. The two runs alternate (plain packed plain packed ...) REPEAT times, so
# that load from other work falls on both alike; each figure is the median step time over all
# runs' steps 3..; overhead = packed / plain - 1. Under load the wall times wander; each run's
# CPU seconds (user + system) wander less: CPU s / step = (a run's - a 1-step run's) / (STEPS - 1),
# the median over runs.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
repeat=${2:-5} steps=${3:-6} threads=${4:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/lib.sh"
awk 'BEGIN { srand(2); for (d = 0; d < 512; d++) { n = 20 + int(rand() * 220); for (i = 0; i < n; i++) printf "%d ", int(rand() * 8192); print "" } }' \
    >"$work/ids.txt"
mkdir -p "$work/bench-data"
"$build/am-data" build --out "$work/bench-data/random_tokens" "$work/ids.txt" >/dev/null

sed -e "s/max_steps: .*/max_steps: $steps/" "$src/bench/bench_small.yaml" >"$work/plain.yaml"
sed 's/^dataset:/packed_sequence:\n  packed_sequence_size: 256\ndataset:/' "$work/plain.yaml" >"$work/packed.yaml"
sed -e "s/max_steps: .*/max_steps: 1/" "$work/plain.yaml" >"$work/once.yaml"
run() { # NAME YAML: one run, its CPU seconds (user + system, am-launch and am-train) into cpu-NAME
    local TIMEFORMAT='%U %S'
    { time (cd "$work" && env OMP_NUM_THREADS="$threads" AM_LOG_DIR="logs-$1" "$build/am-launch" --nproc 1 "$2" \
        >"out-$1" 2>&1); } 2>"$work/time-$1" || { echo "bench: $1 failed"; cat "$work/out-$1"; exit 1; }
    awk '{ print $1 + $2 }' "$work/time-$1" >"$work/cpu-$1"
}
for ((i = 0; i < repeat; i++)); do
    for how in plain packed; do run "$how-$i" "$how.yaml"; done
done
run once once.yaml
field() { for d in "$work/logs-$1"-*; do step_field "$d" "$2"; done | median; } # HOW KEY: over runs, steps 3..
cpu() { cat "$work/cpu-$1"-* | median; } # HOW: a run's CPU seconds, median over runs
# CPU seconds a step (what the load from other work changes least): (run - a 1-step run) / (steps - 1)
cps() { echo "($(cpu "$1") - $(cat "$work/cpu-once")) / ($steps - 1)" | bc -l; }
echo "packing: bench-small (4 x 256 rows a step) on 512 documents of 20-239 tokens, $threads thread(s), $repeat runs each, alternated"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-7s %10s %15s\n' run "s / step" "CPU s / step"
for how in plain packed; do
    printf '%-7s %10.3f %15.3f\n' "$how" "$(field $how step_s)" "$(cps $how)"
done
printf 'packed: %.0f of the 1024 rows a step have a target (median; the rest are pads)\n' \
    "$(field packed label_tokens)"
printf 'packed / plain: %.3fx wall (overhead %.1f %%), %.3fx CPU (overhead %.1f %%)\n' \
    "$(echo "$(field packed step_s) / $(field plain step_s)" | bc -l)" \
    "$(echo "100 * ($(field packed step_s) / $(field plain step_s) - 1)" | bc -l)" \
    "$(echo "$(cps packed) / $(cps plain)" | bc -l)" "$(echo "100 * ($(cps packed) / $(cps plain) - 1)" | bc -l)"
