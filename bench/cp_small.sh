#!/bin/bash
# Context parallelism on a long sequence: bench-small's width (hidden 512, 4 layers, 8 heads,
# 4 kv heads, vocabulary 8192) on one sequence of 8192 tokens, am-train at cp 2 against cp 1,
# side by side, and the share of the ring's time hidden behind the attention's compute.
#   bench/cp_small.sh [BUILDDIR] [STEPS] [SEQ]   (run from the source tree; BUILDDIR defaults
#                                   to ., STEPS to 4: the first two warm up; SEQ to 8192)
# Each rank runs one OpenMP thread, so cp 2 uses 2 cores: efficiency = tokens/s at cp 2 /
# (2 x tokens/s at cp 1). The ring: `ring_wait_s` of the step records is the time a rank waited
# for its shifts (runtime/model/ring.h); a third run with AM_RING_OVERLAP=0 waits for each
# shift as soon as it is started, so its ring_wait_s is the ring's time alone, and
# hidden = 1 - wait(overlapped) / wait(alone). Both waits include waiting for the slower rank.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
steps=${2:-4} seq=${3:-8192}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$src/bench/lib.sh"
bench_data "$work" "$build"

sed -e "s/global_batch_size: .*/global_batch_size: 1/" -e "s/local_batch_size: .*/local_batch_size: 1/" \
    -e "s/max_position_embeddings: .*/max_position_embeddings: $seq/" -e "s/seq_length: .*/seq_length: $seq/" \
    -e "s/max_steps: .*/max_steps: $steps/" "$src/bench/bench_small.yaml" >"$work/long.yaml"
run() { # NAME RANKS [VAR=VALUE...]
    local name=$1 n=$2
    shift 2
    (cd "$work" && env OMP_NUM_THREADS=1 "$@" AM_LOG_DIR="logs-$name" "$build/am-launch" --nproc "$n" long.yaml \
        >"out-$name" 2>&1) || { echo "bench: $name failed"; cat "$work/out-$name"; exit 1; }
}
field() { step_field "$work/logs-$1" "$2" | median; } # NAME KEY: median over steps 3.., all ranks

run cp1 1
run cp2 2 AM_CP=2
run cp2-alone 2 AM_CP=2 AM_RING_OVERLAP=0
one=$(echo "$seq / $(field cp1 step_s)" | bc -l)
two=$(echo "$seq / $(field cp2 step_s)" | bc -l)
w_on=$(field cp2 ring_wait_s) w_off=$(field cp2-alone ring_wait_s) blk=$(field cp2 ring_block_s)
echo "context parallelism: bench-small's width on one sequence of $seq tokens, fp32, 1 thread per rank"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
printf '%-28s %10s %11s\n' layout "tok/s" efficiency
printf '%-28s %10.0f %11s\n' "cp 1 (1 rank)" "$one" -
printf '%-28s %10.0f %10.0f%%\n' "cp 2 (2 ranks)" "$two" "$(echo "100 * $two / (2 * $one)" | bc -l)"
printf 'ring at cp 2, per step: waited %.3f s overlapped, %.3f s alone (AM_RING_OVERLAP=0); block kernels %.3f s; hidden %.0f%%\n' \
    "$w_on" "$w_off" "$blk" "$(echo "100 * (1 - $w_on / $w_off)" | bc -l)"
