#!/bin/bash
# GPU training throughput, am against PyTorch side by side on one GPU: the shapes of Llama 3.2 1B
# (sequence 2048 and 8192) and Llama 3.1 8B (sequence 2048; 12 of its 32 layers by default, so
# that PyTorch's fp32 masters, bf16 copy, gradients of both and AdamW state fit beside the
# activations on one 141 GB H200: LAYERS_8B=N for another count), bf16 mixed precision (fp32
# masters and AdamW state), random tokens over the 128256-token vocabulary. am-train on one rank
# (AM_DEVICE=cuda) and transformers' LlamaForCausalLM (bench/torch_gpu_llama.py: SDPA attention,
# fused AdamW; eager and torch.compile) under the same policy, batch and sequence, one after the
# other in this call. Prints tokens/s and MFU of each and the ratios am/eager and am/compile.
#
# MFU = model FLOPs per step / step time / the GPU's dense bf16 peak, for both peers: the FLOPs
# are am-plan's for the recipe (6 N + 12 L H Q T per token, PaLM's count; the same number the
# step line uses), the peak is the one am-train reports in its start record (its table by GPU
# name, or AM_PEAK_TFLOPS).
#
#   bench/gpu_llama.sh [--quick] [BUILDDIR]    (from the source tree; BUILDDIR defaults to .)
#
# PYTHON names an interpreter with torch (CUDA) and transformers (default: python3); without
# one the PyTorch columns say "-". --quick: the 1B shape with 2 layers at sequence 2048, 6 steps,
# eager PyTorch only (tests/gpu/run's smoke run, about a minute). STEPS (default 10) and WARMUP
# (default 3: steps not timed) change the runs.
set -u
quick=0
[ "${1:-}" = --quick ] && { quick=1; shift; }
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=${STEPS:-10} warmup=${WARMUP:-3}
[ $quick = 1 ] && steps=${STEPS:-6} warmup=${WARMUP:-2}
export AM_MODELS_DIR=${AM_MODELS_DIR:-$src/runtime/recipe/models}

have_torch=0
if "$py" -c "import torch, transformers; assert torch.cuda.is_available()" 2>/dev/null; then
    have_torch=1
fi

# random token ids in [0, 128256): 48 documents of 8193, enough for every run's steps
awk 'BEGIN { srand(1); for (d = 0; d < 48; d++) { for (i = 0; i < 8193; i++) printf "%d ", int(rand() * 128256); print "" } }' \
    >"$work/ids.txt"
"$build/am-data" build --out "$work/tokens" "$work/ids.txt" >/dev/null || { echo "bench: am-data failed"; exit 1; }

# recipe SHAPE LAYERS SEQ BATCH: the inline model (Hugging Face's config.json of the shape),
# bf16 mixed precision, one rank
recipe() {
    local shape=$1 layers=$2 seq=$3 batch=$4 f=$work/$1-$2-$3.yaml
    if [ "$shape" = 1b ]; then
        printf 'model:\n  model_type: llama\n  vocab_size: 128256\n  hidden_size: 2048\n  intermediate_size: 8192\n  num_attention_heads: 32\n  num_key_value_heads: 8\n  head_dim: 64\n  tie_word_embeddings: true\n  rope_scaling: {rope_type: llama3, factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}\n' >"$f"
    else
        printf 'model:\n  model_type: llama\n  vocab_size: 128256\n  hidden_size: 4096\n  intermediate_size: 14336\n  num_attention_heads: 32\n  num_key_value_heads: 8\n  head_dim: 128\n  tie_word_embeddings: false\n  rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}\n' >"$f"
    fi
    cat >>"$f" <<EOF
  num_hidden_layers: $layers
  max_position_embeddings: 131072
  rope_theta: 500000.0
  rms_norm_eps: 1.0e-5
  torch_dtype: float32
distributed:
  strategy: fsdp2
  mp_policy:
    param_dtype: bfloat16
    reduce_dtype: float32
step_scheduler:
  global_batch_size: $batch
  local_batch_size: $batch
  max_steps: $steps
dataset:
  paths: $work/tokens
  seq_length: $seq
optimizer:
  _target_: torch.optim.AdamW
  lr: 1.0e-4
  betas: [0.9, 0.95]
  weight_decay: 0.1
clip_grad_norm:
  max_norm: 1.0
rng:
  seed: 1
EOF
    echo "$f"
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR) printf "%.4f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# am_run RECIPE: "tokens/s peak_flops" (the median step after the warm-up), or "- -" with the
# reason on stderr
am_run() {
    local r=$1 logs=$work/logs
    rm -rf "$logs"
    if ! (cd "$work" && AM_DEVICE=cuda AM_LOG_DIR=$logs timeout 900 "$build/am-launch" --nproc 1 "$r" \
        >"$work/am.out" 2>"$work/am.err"); then
        echo "bench: am-train failed on $(basename "$r"):" >&2
        tail -n 5 "$work/am.err" | sed 's/^/  /' >&2
        echo "- -"
        return
    fi
    local log tokens dt peak
    log=$(ls "$logs"/*/rank-0.jsonl | head -n 1)
    tokens=$(grep -m1 '"type":"step"' "$log" | sed -E 's/.*"tokens":([0-9]+).*/\1/')
    dt=$(grep -h '"type":"step"' "$log" | sed -E 's/.*"step_s":([^,}]*).*/\1/' | tail -n +$((warmup + 1)) | median)
    peak=$(grep -m1 '"type":"start"' "$log" | sed -nE 's/.*"peak_flops":([0-9.e+]+).*/\1/p')
    awk -v t="$tokens" -v s="$dt" -v p="${peak:--}" 'BEGIN { printf "%.1f %s\n", t / s, p }'
}

torch_run() { # SHAPE LAYERS SEQ BATCH [--compile]: tokens/s, or -
    [ $have_torch = 1 ] || { echo -; return; }
    local out
    if out=$("$py" "$src/bench/torch_gpu_llama.py" --shape "$1" --layers "$2" --seq "$3" --batch "$4" --steps "$steps" \
        --warmup "$warmup" ${5:-} 2>"$work/torch.err" | tail -n 1) && [ -n "$out" ]; then
        echo "$out"
    else
        echo "bench: PyTorch $5 failed on $1 x $2 layers, sequence $3:" >&2
        tail -n 3 "$work/torch.err" | sed 's/^/  /' >&2
        echo -
    fi
}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "gpu_llama: ${gpu:-no GPU found by nvidia-smi}; bf16 mixed precision (fp32 masters and AdamW), random tokens, $steps steps ($warmup warm-up)"
if [ $have_torch = 1 ]; then
    echo "peer: PyTorch $("$py" -c 'import torch; print(torch.__version__)'), transformers $("$py" -c 'import transformers; print(transformers.__version__)') (SDPA, fused AdamW) from $py"
else
    echo "peer: none ($py has no CUDA torch with transformers: set PYTHON)"
fi

if [ $quick = 1 ]; then
    runs=("1b 2 2048 4")
else
    runs=("1b 16 2048 4" "1b 16 8192 1" "8b ${LAYERS_8B:-12} 2048 2")
fi
printf '%-6s %6s %6s %5s %11s %7s %11s %7s %11s %7s %8s %8s\n' shape layers seq batch "am tok/s" "am MFU" \
    "eager tok/s" MFU "compile" MFU am/eager am/comp
status=0
for run in "${runs[@]}"; do
    set -- $run
    r=$(recipe "$1" "$2" "$3" "$4")
    flops=$("$build/am-plan" "$r" --gpus-per-node 1 --json | grep -o '"flops_per_step": *[0-9.e+]*' | sed 's/.*: *//')
    read -r am peak < <(am_run "$r")
    [ "$am" = - ] && status=1
    if [ "$peak" = - ]; then # am did not say: AM_PEAK_TFLOPS, else the same table as am-train's (train/records.c)
        case "${AM_PEAK_TFLOPS:-}:$gpu" in
        [0-9]*:*) peak=$(awk -v t="$AM_PEAK_TFLOPS" 'BEGIN { printf "%.6g", t * 1e12 }') ;;
        *H100*NVL*) peak=835e12 ;;
        *H100*PCIe*) peak=756e12 ;;
        *H200* | *H100*) peak=989.4e12 ;;
        *A100*) peak=312e12 ;;
        esac
    fi
    eager=$(torch_run "$1" "$2" "$3" "$4")
    comp=-
    [ $quick = 0 ] && comp=$(torch_run "$1" "$2" "$3" "$4" --compile)
    tokens=$(($3 * $4))
    mfu() { # TOKENS_PER_S: percent of the peak, or -
        awk -v v="$1" -v f="$flops" -v t="$tokens" -v p="$peak" \
            'BEGIN { if (v == "-" || p == "-" || p == "") print "-"; else printf "%.1f%%\n", 100 * v * f / t / p }'
    }
    ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-") print "-"; else printf "%.2f\n", a / b }'; }
    printf '%-6s %6s %6s %5s %11s %7s %11s %7s %11s %7s %8s %8s\n' "$1" "$2" "$3" "$4" "$am" "$(mfu "$am")" "$eager" \
        "$(mfu "$eager")" "$comp" "$(mfu "$comp")" "$(ratio "$am" "$eager")" "$(ratio "$am" "$comp")"
done
echo "MFU against ${peak:-an unknown} FLOP/s (am-train's peak for this GPU; AM_PEAK_TFLOPS overrides); FLOPs per step from am-plan"
exit $status
