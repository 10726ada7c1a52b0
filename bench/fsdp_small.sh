#!/bin/bash
# Fully sharded data parallelism against full replicas: bench-small on 2 data-parallel ranks,
# each with THREADS OpenMP threads (default 1), once with strategy fsdp2 (weights, gradients
# and AdamW state sharded over the 2 ranks: each group's weights all-gathered before its
# forward and its backward, the next one prefetched; each group's gradients reduce-scattered
# from a per-group buffer after its backward) and once with
# ddp (full replicas, gradients all-reduced), alternating REPEAT times (default 3). Prints the
# median step time, tokens/s per rank, the time waiting for all-gathers (gather_wait_s) and
# the ratio fsdp2 / ddp. Then the resident state per rank from the `memory` records of one
# step of bench-small (global batch 8) on 1, 2, 4 and 8 ranks with fsdp2: weights (master
# shards), AdamW state, gradients (the reduced shards) and, apart, the working buffers of the
# backward: the gathered groups and the per-group gradient buffers.
#   bench/fsdp_small.sh [BUILDDIR] [THREADS]
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
threads=${2:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"
sed -e "s/global_batch_size: .*/global_batch_size: 8/" "$src/bench/bench_small.yaml" >"$work/fsdp2.yaml"
sed -e "s/strategy: fsdp2/strategy: ddp/" "$work/fsdp2.yaml" >"$work/ddp.yaml"
for ((i = 0; i < ${REPEAT:-3}; i++)); do
    for s in fsdp2 ddp; do
        (cd "$work" && OMP_NUM_THREADS=$threads AM_LOG_DIR="logs-$s-$i" "$build/am-launch" --nproc 2 $s.yaml \
            >/dev/null 2>&1) || { echo "bench: $s run failed"; exit 1; }
    done
done
echo "bench-small, dp 2 (2 ranks x $threads thread(s)), $(nproc) cores: fsdp2 (sharded) vs ddp (replicas)"
printf '%-8s %10s %16s %16s\n' strategy "step ms" "tokens/s/rank" "gather wait ms"
declare -A tps
for s in fsdp2 ddp; do
    step=$(for d in "$work"/logs-$s-*; do step_field "$d" step_s; done | median)
    wait=0
    [ $s = fsdp2 ] && wait=$(for d in "$work"/logs-$s-*; do step_field "$d" gather_wait_s; done | median)
    tps[$s]=$(echo "4 * 256 / $step" | bc -l)
    printf '%-8s %10.1f %16.1f %16.1f\n' $s "$(echo "$step * 1000" | bc -l)" "${tps[$s]}" "$(echo "$wait * 1000" | bc -l)"
done
printf 'fsdp2 / ddp tokens/s: %.3f\n' "$(echo "${tps[fsdp2]} / ${tps[ddp]}" | bc -l)"

sed -e "s/max_steps: .*/max_steps: 1/" "$work/fsdp2.yaml" >"$work/one.yaml"
echo
echo "resident state per rank (bytes, rank 0's memory record), fsdp2 over dp_shard ranks"
printf '%-9s %12s %12s %12s %12s %12s %12s\n' dp_shard weights optimizer grads "w+opt+grads" gathered "grad buffers"
mem() { grep -h '"type":"memory"' "$1"/*/rank-0.jsonl | sed -E "s/.*\"$2\":([0-9]*).*/\\1/"; }
for n in 1 2 4 8; do
    sed -e "s/local_batch_size: .*/local_batch_size: $((8 / n))/" "$work/one.yaml" >"$work/one-$n.yaml"
    (cd "$work" && OMP_NUM_THREADS=1 AM_LOG_DIR="mem-$n" "$build/am-launch" --nproc $n one-$n.yaml >/dev/null 2>&1) ||
        { echo "bench: $n ranks failed"; exit 1; }
    w=$(mem "$work/mem-$n" weights_bytes) o=$(mem "$work/mem-$n" optimizer_bytes) g=$(mem "$work/mem-$n" grads_bytes)
    printf '%-9s %12d %12d %12d %12d %12d %12d\n' $n "$w" "$o" "$g" $((w + o + g)) "$(mem "$work/mem-$n" gathered_bytes)" \
        "$(mem "$work/mem-$n" grad_buffers_bytes)"
done
