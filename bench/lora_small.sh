#!/bin/bash
# LoRA with the frozen base sharded against the base whole: bench-small with a peft section
# (dim 8, alpha 32, on every projection, '*_proj').
#   step time: 2 data-parallel ranks, each with THREADS OpenMP threads (default 1), fp32, once
#     with strategy fsdp2 (the frozen base sharded over the 2 ranks, each group all-gathered
#     before its forward and its backward, the next one prefetched; the adapters whole, their
#     gradients all-reduced) and once with ddp (the base whole on each rank, the same adapters'
#     all-reduce), STEPS steps (default 6) alternating REPEAT times (default 2): the median step
#     time (steps 3 on), tokens/s per rank, the time waiting for all-gathers and the ratio
#     fsdp2 / ddp of the step times;
#   memory: one step in bf16 (param_dtype bfloat16, the compute dtype of a GPU run) on 1, 2, 4
#     and 8 ranks with fsdp2 (global batch 8): rank 0's memory record, the base's bytes
#     (weights_bytes less the adapters' fp32 master and bf16 copy, 6 bytes each), the gathered
#     groups' buffers, and their ratio to one rank's base (held whole).
#   bench/lora_small.sh [BUILDDIR] [THREADS]
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
threads=${2:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$src/bench/lib.sh"
bench_data "$work" "$build"
{
    sed -e "s/global_batch_size: .*/global_batch_size: 8/" -e "s/max_steps: .*/max_steps: ${STEPS:-6}/" \
        "$src/bench/bench_small.yaml"
    printf 'peft:\n  target_modules: %s\n  dim: 8\n  alpha: 32\n' "'*_proj'"
} >"$work/fsdp2.yaml"
sed -e "s/strategy: fsdp2/strategy: ddp/" "$work/fsdp2.yaml" >"$work/ddp.yaml"
for ((i = 0; i < ${REPEAT:-2}; i++)); do
    for s in fsdp2 ddp; do
        (cd "$work" && OMP_NUM_THREADS=$threads AM_LOG_DIR="logs-$s-$i" "$build/am-launch" --nproc 2 $s.yaml \
            >"$work/out-$s" 2>&1) || { echo "bench: $s run failed"; cat "$work/out-$s"; exit 1; }
    done
done
echo "bench-small + LoRA (dim 8, every projection), fp32, dp 2 (2 ranks x $threads thread(s)), $(nproc) cores:"
echo "fsdp2 (the base sharded) vs ddp (the base whole)"
printf '%-8s %10s %16s %16s\n' strategy "step ms" "tokens/s/rank" "gather wait ms"
declare -A step_of
for s in fsdp2 ddp; do
    step=$(for d in "$work"/logs-$s-*; do step_field "$d" step_s; done | median)
    wait=0
    [ $s = fsdp2 ] && wait=$(for d in "$work"/logs-$s-*; do step_field "$d" gather_wait_s; done | median)
    step_of[$s]=$step
    printf '%-8s %10.1f %16.1f %16.1f\n' $s "$(echo "$step * 1000" | bc -l)" "$(echo "4 * 256 / $step" | bc -l)" \
        "$(echo "$wait * 1000" | bc -l)"
done
printf 'step time fsdp2 / ddp: %.3f\n' "$(echo "${step_of[fsdp2]} / ${step_of[ddp]}" | bc -l)"

sed -e "s/max_steps: .*/max_steps: 1/" -e "s/param_dtype: .*/param_dtype: bfloat16/" "$work/fsdp2.yaml" >"$work/one.yaml"
echo
echo "the frozen base per rank in bf16 (bytes, rank 0's memory record), fsdp2 over dp ranks"
printf '%-4s %12s %12s %12s %12s %10s %14s\n' dp weights adapters base gathered "base / dp1" "+gathered/dp1"
mem() { grep -h '"type":"memory"' "$1"/*/rank-0.jsonl | sed -E "s/.*\"$2\":([0-9]*).*/\\1/"; }
whole=0
for n in 1 2 4 8; do
    sed -e "s/local_batch_size: .*/local_batch_size: $((8 / n))/" "$work/one.yaml" >"$work/one-$n.yaml"
    (cd "$work" && OMP_NUM_THREADS=1 AM_LOG_DIR="mem-$n" "$build/am-launch" --nproc $n one-$n.yaml >"$work/out-$n" 2>&1) ||
        { echo "bench: $n ranks failed"; cat "$work/out-$n"; exit 1; }
    w=$(mem "$work/mem-$n" weights_bytes) a=$(mem "$work/mem-$n" adapter_params) g=$(mem "$work/mem-$n" gathered_bytes)
    b=$((w - 6 * a))
    [ $n = 1 ] && whole=$b
    printf '%-4s %12d %12d %12d %12d %10.3f %14.3f\n' $n "$w" $((6 * a)) $b "$g" "$(echo "$b / $whole" | bc -l)" \
        "$(echo "($b + $g) / $whole" | bc -l)"
done
