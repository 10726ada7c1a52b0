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
source "$src/bench/lib.sh"
bench_data "$work" "$a"
sed_args=()
for e in "$@"; do sed_args+=(-e "$e"); done
if [ $# -gt 0 ]; then sed "${sed_args[@]}" "$src/bench/bench_small.yaml"; else cat "$src/bench/bench_small.yaml"; fi \
    >"$work/bench_small.yaml"
echo "bench-small ($*): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
echo "A = $a"
echo "B = $b"
printf '%-8s %12s %12s %8s\n' threads "A tok/s" "B tok/s" "B / A"
for th in 1 2; do
    : >"$work/a" && : >"$work/b"
    for ((i = 0; i < ${REPEAT:-3}; i++)); do
        am_tokens_s "$work" "$a" bench_small.yaml "$th" >>"$work/a"
        am_tokens_s "$work" "$b" bench_small.yaml "$th" >>"$work/b"
    done
    ta=$(median <"$work/a") tb=$(median <"$work/b")
    printf '%-8s %12.1f %12.1f %8.3f\n' "$th" "$ta" "$tb" "$(echo "$tb / $ta" | bc -l)"
done
