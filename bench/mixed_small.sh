#!/bin/bash
# bench-small in bf16 mixed precision against fp32, am and PyTorch side by side: am-train with
# mp_policy.param_dtype float32 and bfloat16, and transformers' LlamaForCausalLM under the same
# policy (bench/torch_mixed.py, with torch's fused AdamW), at 1 and 2 threads, one after the other
# REPEAT times (default 3), median tokens/s. PYTHON names an interpreter with torch and
# transformers (the venv of tests/golden/README.md; default /tmp/goldenv/bin/python). PyTorch's
# bf16 on a CPU without bf16 instructions takes about a minute a step here, so its bf16 runs time
# 2 steps after one of warm-up (TORCH_BF16_STEPS, default 3) where every other run times 10 after
# 2.
#   bench/mixed_small.sh [BUILDDIR]
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
py=${PYTHON:-/tmp/goldenv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -c "import torch, transformers" 2>/dev/null || { echo "bench: $py has no torch/transformers (set PYTHON)"; exit 1; }
source "$src/bench/lib.sh"
bench_data "$work" "$build"
cp "$src/bench/bench_small.yaml" "$work/fp32.yaml"
sed 's/param_dtype: float32/param_dtype: bfloat16/' "$src/bench/bench_small.yaml" >"$work/bf16.yaml"
echo "bench-small, fp32 and bf16 mixed precision: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
echo "PyTorch $("$py" -c 'import torch; print(torch.__version__)'), transformers $("$py" -c 'import transformers; print(transformers.__version__)') (sdpa attention)"
printf '%-8s %-7s %12s %12s %10s\n' threads policy "am tok/s" "torch tok/s" "am/torch"
for th in 1 2; do
    for pol in fp32 bf16; do
        : >"$work/am" && : >"$work/torch"
        for ((i = 0; i < ${REPEAT:-3}; i++)); do
            am_tokens_s "$work" "$build" "$pol.yaml" "$th" >>"$work/am"
            steps=12 warmup=2
            [ "$pol" = bf16 ] && steps=${TORCH_BF16_STEPS:-3} warmup=1
            "$py" "$src/bench/torch_mixed.py" --threads "$th" --policy "$pol" --steps "$steps" --warmup "$warmup" \
                >>"$work/torch"
        done
        am=$(median <"$work/am") torch=$(median <"$work/torch")
        printf '%-8s %-7s %12.1f %12.1f %10.2f\n' "$th" "$pol" "$am" "$torch" "$(echo "$am / $torch" | bc -l)"
    done
done
