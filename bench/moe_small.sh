#!/bin/bash
# bench-small MoE: tokens/s of am-train with expert parallelism (ep 2) against ep 1 on 2 ranks
# (dp 2 both), and the share of the ep 2 step spent in the experts' all-to-alls.
#   bench/moe_small.sh [BUILDDIR]    (run from the source tree; BUILDDIR defaults to .)
# The model is bench-small (bench/bench_small.yaml) made a Mixtral: 8 experts, top 2, expert
# width 704, vocabulary 8192, hidden 512, 4 layers, sequence 256; a global batch of 8 (4 per
# rank), fp32, one OpenMP thread per rank. At ep 1 each rank computes every expert on its own
# tokens; at ep 2 each holds 4 experts and exchanges tokens with the other. The all-to-all
# share is the step record's alltoall_s / step_s on rank 0 (counts, tokens and their
# gradients; on one machine the exchange costs little, so what it shows is mostly the wait for
# the slower rank's experts: the load imbalance). Medians over steps 3.. (two warm up).
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
awk 'BEGIN { srand(1); for (d = 0; d < 64; d++) { for (i = 0; i < 2048; i++) printf "%d ", int(rand() * 8192); print "" } }' \
    >"$work/ids.txt"
mkdir -p "$work/bench-data"
"$build/am-data" build --out "$work/bench-data/random_tokens" "$work/ids.txt" >/dev/null
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.4f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
sed -e 's/global_batch_size: .*/global_batch_size: 8/' -e 's/model_type: llama/model_type: mixtral\n  num_local_experts: 8\n  num_experts_per_tok: 2/' \
    -e 's/intermediate_size: .*/intermediate_size: 704/' "$src/bench/bench_small.yaml" >"$work/moe.yaml"
run() { # NAME [VAR=VALUE...]
    local name=$1
    shift
    (cd "$work" && env OMP_NUM_THREADS=1 "$@" AM_LOG_DIR="logs-$name" "$build/am-launch" --nproc 2 moe.yaml \
        >"out-$name" 2>&1) || { echo "bench: $name failed"; cat "$work/out-$name"; exit 1; }
}
field() { # NAME KEY: the median of KEY in rank 0's step records over steps 3..
    grep -h '"type":"step"' "$work"/logs-"$1"/*/rank-0.jsonl | sed -E "s/.*\"$2\":([^,}]*).*/\\1/" | tail -n +3 | median
}
tok_s() { echo "$(grep -h '"type":"step"' "$work"/logs-"$1"/*/rank-0.jsonl | head -1 |
    sed -E 's/.*"tokens":([0-9]+).*/\1/') / $(field "$1" step_s)" | bc -l; }
share() { grep -h '"type":"step"' "$work"/logs-"$1"/*/rank-0.jsonl | tail -n +3 |
    sed -E 's/.*"step_s":([^,}]*).*"alltoall_s":([^,}]*).*/\1 \2/' | awk '{ print $2 / $1 }' | median; }

echo "bench-small MoE: Mixtral 8 experts top 2, hidden 512, 4 layers, seq 256, fp32, 2 ranks x 1 thread"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
run ep1
run ep2 AM_EP=2
one=$(tok_s ep1) two=$(tok_s ep2)
printf '%-22s %10s %10s %16s\n' layout "tok/s" "vs ep 1" "all-to-all share"
printf '%-22s %10.0f %10s %16s\n' "dp 2, ep 1" "$one" 1.00 -
printf '%-22s %10.0f %10.2f %15.1f%%\n' "dp 2, ep 2" "$two" "$(echo "$two / $one" | bc -l)" "$(echo "100 * $(share ep2)" | bc -l)"
