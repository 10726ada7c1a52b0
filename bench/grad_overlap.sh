#!/bin/bash
# The data-parallel gradient reduction overlapped with the backward, against reducing after
# it: bench-small on 2 data-parallel ranks, each with THREADS OpenMP threads (default 1),
# once with AM_GRAD_OVERLAP=1 (each parameter group's all-reduce started as its backward ends,
# waited for before the optimizer) and once with AM_GRAD_OVERLAP=0 (the same all-reduces, one
# after another, after the backward). Prints the median step time, the median time waiting
# for gradient communication after the backward (grad_wait_s in the rank logs) and its share
# of the step, alternating the two modes REPEAT times (default 3).
#   bench/grad_overlap.sh [BUILDDIR] [THREADS]
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
threads=${2:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"
sed -e "s/global_batch_size: .*/global_batch_size: 8/" "$src/bench/bench_small.yaml" >"$work/dp2.yaml"
for ((i = 0; i < ${REPEAT:-3}; i++)); do
    for ov in 1 0; do
        (cd "$work" && OMP_NUM_THREADS=$threads AM_GRAD_OVERLAP=$ov AM_LOG_DIR="logs-$ov-$i" \
            "$build/am-launch" --nproc 2 dp2.yaml >/dev/null 2>&1) || { echo "bench: run failed"; exit 1; }
    done
done
echo "bench-small, dp 2 (2 ranks x $threads thread(s)), $(nproc) cores: gradient reduction overlapped vs after the backward"
printf '%-22s %10s %14s %8s\n' mode "step ms" "grad wait ms" share
for ov in 1 0; do
    step=$(for d in "$work"/logs-$ov-*; do step_field "$d" step_s; done | median)
    wait=$(for d in "$work"/logs-$ov-*; do step_field "$d" grad_wait_s; done | median)
    printf '%-22s %10.1f %14.1f %7.1f%%\n' "$([ $ov = 1 ] && echo overlapped || echo 'after the backward')" \
        "$(echo "$step * 1000" | bc -l)" "$(echo "$wait * 1000" | bc -l)" "$(echo "100 * $wait / $step" | bc -l)"
done
