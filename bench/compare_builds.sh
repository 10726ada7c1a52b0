#!/bin/bash
# bench-small trained by two builds of am, side by side: tokens/s at 1 and 2 threads, the two
# builds alternating run by run (REPEAT runs each, default 3; median of steps 3.. per run,
# median over runs), and their ratio. For checking that a change did not slow training down.
#   bench/compare_builds.sh BUILD_A BUILD_B [RECIPE_CHANGE...]
# RECIPE_CHANGE: sed expressions applied to bench/bench_small.yaml for both builds (e.g.
# 's/param_dtype: float32/param_dtype: bfloat16/'); BUILD_B may also be the same build as A.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
a=$(cd "$1" && pwd)
b=$(cd "$2" && pwd)
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
awk 'BEGIN { srand(1); for (d = 0; d < 64; d++) { for (i = 0; i < 2048; i++) printf "%d ", int(rand() * 8192); print "" } }' \
    >"$work/ids.txt"
mkdir -p "$work/bench-data"
"$a/am-data" build --out "$work/bench-data/random_tokens" "$work/ids.txt" >/dev/null
sed_args=()
for e in "$@"; do sed_args+=(-e "$e"); done
sed "${sed_args[@]:-}" "$src/bench/bench_small.yaml" >"$work/bench_small.yaml"
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.1f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
tokens_s() { # BUILD THREADS
    (cd "$work" && rm -rf logs && OMP_NUM_THREADS=$2 AM_LOG_DIR=logs "$1/am-launch" --nproc 1 bench_small.yaml >/dev/null)
    grep -h '"type":"step"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"step_s":([^,}]*).*/\1/' | tail -n +3 |
        median | awk '{ printf "%.1f\n", 1024 / $1 }'
}
echo "bench-small ($*): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
echo "A = $a"
echo "B = $b"
printf '%-8s %12s %12s %8s\n' threads "A tok/s" "B tok/s" "B / A"
for th in 1 2; do
    : >"$work/a" && : >"$work/b"
    for ((i = 0; i < ${REPEAT:-3}; i++)); do
        tokens_s "$a" "$th" >>"$work/a"
        tokens_s "$b" "$th" >>"$work/b"
    done
    ta=$(median <"$work/a") tb=$(median <"$work/b")
    printf '%-8s %12s %12s %8.3f\n' "$th" "$ta" "$tb" "$(echo "$tb / $ta" | bc -l)"
done
