#!/bin/bash
# bench-small, am against PyTorch, side by side: the same model (DESIGN.md's bench-small),
# the same batch, fp32, AdamW, at 1 and 2 threads (Debian's /usr/bin/python3 with its torch).
# Prints tokens/s for both, the ratio, and am's achieved GFLOP/s (6 * parameters * tokens /
# time) against OpenBLAS sgemm measured in the same run. Needs python3-torch (Debian's; installed here when missing, as root).
#   bench/train_small.sh [BUILDDIR]    (run from the source tree; BUILDDIR defaults to .)
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "bench: needs python3-torch (apt-get install python3-torch)"; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-torch >/dev/null
fi
# both peers run OpenBLAS; give both the kernels for this CPU (am-launch would do it for am)
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512bw /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi

# random tokens in [0, 8192), 64 documents of 2048
awk 'BEGIN { srand(1); for (d = 0; d < 64; d++) { for (i = 0; i < 2048; i++) printf "%d ", int(rand() * 8192); print "" } }' \
    >"$work/ids.txt"
mkdir -p "$work/bench-data"
"$build/am-data" build --out "$work/bench-data/random_tokens" "$work/ids.txt" >/dev/null
cp "$src/bench/bench_small.yaml" "$work/"

am_tokens_s() { # THREADS: median tokens/s of steps 3.. (the first two warm up)
    (cd "$work" && rm -rf logs && OMP_NUM_THREADS=$1 AM_LOG_DIR=logs "$build/am-launch" --nproc 1 bench_small.yaml >/dev/null)
    grep -h '"type":"step"' "$work"/logs/*/rank-0.jsonl | sed -E 's/.*"step_s":([^,}]*).*/\1/' | tail -n +3 | sort -g |
        awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f", 1024 / m }'
}

echo "bench-small: Llama vocab 8192, hidden 512, 4 layers, 8 heads (4 kv), intermediate 1408, seq 256, batch 4, fp32, AdamW"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.1f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
repeat=${REPEAT:-3}
echo "tokens/s: median of $repeat runs each, am and PyTorch alternating"
printf '%-8s %14s %14s %8s\n' threads "am tok/s" "torch tok/s" ratio
best_am=0 best_torch=0
for th in 1 2; do
    : >"$work/am-$th"
    : >"$work/torch-$th"
    for ((i = 0; i < repeat; i++)); do
        am_tokens_s "$th" >>"$work/am-$th"
        echo >>"$work/am-$th"
        /usr/bin/python3 "$src/bench/torch_llama.py" --threads "$th" >>"$work/torch-$th"
    done
    am=$(median <"$work/am-$th")
    torch=$(median <"$work/torch-$th")
    printf '%-8s %14s %14s %8.2f\n' "$th" "$am" "$torch" "$(echo "$am / $torch" | bc -l)"
    best_am=$(echo "if ($am > $best_am) $am else $best_am" | bc -l)
    best_torch=$(echo "if ($torch > $best_torch) $torch else $best_torch" | bc -l)
done
printf 'best of each: am %.1f tok/s, torch %.1f tok/s, ratio %.2f\n' "$best_am" "$best_torch" "$(echo "$best_am / $best_torch" | bc -l)"
sgemm=$(for ((i = 0; i < repeat; i++)); do
    "$build/bench/kernels" 0.5 2>/dev/null | sed -nE 's/.*peer: OpenBLAS sgemm .*: ([0-9.]+) GFLOP\/s.*/\1/p'
done | median)
params=$("$build/am-plan" "$work/bench_small.yaml" --gpus-per-node 1 --json | sed -nE 's/.*"params_total":([0-9.]+).*/\1/p')
gf=$(echo "6 * $params * $best_am / 1000000000" | bc -l)
printf 'am achieved %.1f GFLOP/s (6 x %.0f parameters x tokens/s) = %.0f%% of OpenBLAS sgemm (%.1f GFLOP/s, 2 threads)\n' \
    "$gf" "$params" "$(echo "100 * $gf / $sgemm" | bc -l)" "$sgemm"
