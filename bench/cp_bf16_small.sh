#!/bin/bash
# Ring attention in bf16 against fp32 on the CPU: bench-small's width (hidden 512, 4 layers,
# 8 heads, 4 kv heads, vocabulary 8192) on one sequence of SEQ tokens at cp 2 (2 ranks, one
# OpenMP thread each), mp_policy.param_dtype float32 against bfloat16, the same model and tokens.
#   bench/cp_bf16_small.sh [BUILDDIR] [REPEAT] [SEQ] [STEPS]   (run from the source tree;
#                     BUILDDIR defaults to ., REPEAT to 5, SEQ to 2048, STEPS to 5: the first two warm up)
# The two runs alternate (fp32 bf16 fp32 bf16 ...) REPEAT times, so that load from other work
# falls on both alike; each figure is the median over all runs' steps 3.. of both ranks. The
# step records give the step's seconds (`step_s`) and, of them, the ring attention's block
# kernels (`ring_block_s`, runtime/model/ring.h) and the wait for its shifts (`ring_wait_s`);
# each run's CPU seconds give a figure the load from other work changes less (below, cps).
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
repeat=${2:-5} seq=${3:-2048} steps=${4:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/lib.sh"
bench_data "$work" "$build"

sed -e "s/global_batch_size: .*/global_batch_size: 1/" -e "s/local_batch_size: .*/local_batch_size: 1/" \
    -e "s/max_position_embeddings: .*/max_position_embeddings: $seq/" -e "s/seq_length: .*/seq_length: $seq/" \
    -e "s/max_steps: .*/max_steps: $steps/" "$src/bench/bench_small.yaml" >"$work/fp32.yaml"
sed 's/param_dtype: float32/param_dtype: bfloat16/' "$work/fp32.yaml" >"$work/bf16.yaml"
sed -e "s/max_steps: .*/max_steps: 1/" "$work/fp32.yaml" >"$work/once.yaml"
run() { # NAME YAML: one run, its CPU seconds (user + system, am-launch and both ranks) into cpu-NAME
    local TIMEFORMAT='%U %S'
    { time (cd "$work" && env OMP_NUM_THREADS=1 AM_CP=2 AM_LOG_DIR="logs-$1" "$build/am-launch" --nproc 2 "$2" \
        >"out-$1" 2>&1); } 2>"$work/time-$1" || { echo "bench: $1 failed"; cat "$work/out-$1"; exit 1; }
    awk '{ print $1 + $2 }' "$work/time-$1" >"$work/cpu-$1"
}
for ((i = 0; i < repeat; i++)); do
    for pol in fp32 bf16; do run "$pol-$i" "$pol.yaml"; done
done
run once once.yaml
field() { for d in "$work/logs-$1"-*; do step_field "$d" "$2"; done | median; } # POLICY KEY: over runs, steps 3.., ranks
# CPU seconds a step, both ranks (what the load from other work changes least): (a run's - a
# 1-step run's) / (STEPS - 1), the median over runs
cps() { echo "($(cat "$work/cpu-$1"-* | median) - $(cat "$work/cpu-once")) / ($steps - 1)" | bc -l; }
echo "ring attention, cp 2: bench-small's width on one sequence of $seq tokens, 1 thread per rank, $repeat runs each, alternated"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-7s %10s %14s %13s %15s\n' policy "s / step" "ring blocks s" "ring wait s" "CPU s / step"
for pol in fp32 bf16; do
    printf '%-7s %10.3f %14.3f %13.3f %15.3f\n' "$pol" "$(field $pol step_s)" "$(field $pol ring_block_s)" \
        "$(field $pol ring_wait_s)" "$(cps $pol)"
done
printf 'bf16 / fp32: step %.2fx, ring blocks %.2fx, CPU a step %.2fx\n' \
    "$(echo "$(field bf16 step_s) / $(field fp32 step_s)" | bc -l)" \
    "$(echo "$(field bf16 ring_block_s) / $(field fp32 ring_block_s)" | bc -l)" "$(echo "$(cps bf16) / $(cps fp32)" | bc -l)"
