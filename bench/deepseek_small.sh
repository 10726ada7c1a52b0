#!/bin/bash
# A small DeepSeek-V3-style model on the CPU, am beside transformers' DeepseekV3ForCausalLM
# (bench/torch_deepseek.py, its default sdpa attention and grouped_mm experts) under the same
# settings: the same config key for key, the same random tokens (bench/lib.sh's 64 documents),
# fp32, AdamW with clipping, one rank, THREADS threads (default 1: OMP_NUM_THREADS against
# torch.set_num_threads), alternating am and transformers REPEAT times (default 3).
#   PYTHON=/path/to/venv/bin/python [EXPERTS=fine|coarse] [ADAMW=default] bench/deepseek_small.sh [BUILDDIR]
# The model: vocab 8192, hidden 512, 4 layers, 8 heads; multi-head latent attention with
# q_lora_rank 256, kv_lora_rank 128, qk_nope 64, qk_rope 32, v 64 (interleaved rope); layer 0
# a dense MLP (intermediate 1408, first_k_dense_replace 1), layers 1-3 DeepSeekMoE: sigmoid
# scores, the top k in the best groups, normalised, scaled 2.5, beside shared experts. EXPERTS
# chooses the experts:
#   fine (default): 64 routed experts of width 128, top 6 in 4 of 8 groups, 2 shared experts
#     (DeepSeekMoE's fine-grained experts: Moonlight's 64 routed, 6 chosen and 2 shared,
#     DeepSeek-V3's 8 groups of which 4; 52.8M parameters);
#   coarse: 16 routed experts of width 256, top 4 in 2 of 4 groups, 1 shared (33.8M).
# Sequence 256, batch 2: 512 tokens a step. ADAMW chooses torch.optim.AdamW's implementation in
# the peer: fused (default: fused=True, its fastest on the CPU, so the peer runs at its best),
# foreach, or default (torch's own choice, one tensor at a time on the CPU: what AutoModel's
# recipes get, which name torch.optim.AdamW without `fused`: a quarter of a second a step slower
# on the fine layout here).
# Each run times STEPS steps (default 10) and takes medians over steps 3.. (two warm up); the
# table gives the median over the runs of tokens/s by the wall clock and by the process's CPU
# time (the second stands when other work loads the machine, with one thread), and am's step
# record's moe_dispatch_s and moe_experts_s as shares of its step_s (docs/training.md). The
# load average is read before and after each run.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-.}" && pwd)
py=${PYTHON:-/tmp/goldenv/bin/python}
repeat=${REPEAT:-3} steps=${STEPS:-10} threads=${THREADS:-1}
case ${EXPERTS:-fine} in # routed top-k groups top-groups width shared
fine) moe=(64 6 8 4 128 2) ;;
coarse) moe=(16 4 4 2 256 1) ;;
*) echo "bench: EXPERTS=${EXPERTS}: not a layout (fine or coarse)"; exit 1 ;;
esac
peer=("$src/bench/torch_deepseek.py" --routed "${moe[0]}" --topk "${moe[1]}" --groups "${moe[2]}"
    --topk-group "${moe[3]}" --moe-width "${moe[4]}" --shared "${moe[5]}" --adamw "${ADAMW:-fused}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -c "import torch, transformers" 2>/dev/null || { echo "bench: $py has no torch/transformers (set PYTHON)"; exit 1; }
source "$src/bench/lib.sh"
bench_data "$work" "$build"
sed -e 's/model_type: llama/model_type: deepseek_v3/' -e "s/num_key_value_heads: 4/num_key_value_heads: 8\n  q_lora_rank: 256\n  kv_lora_rank: 128\n  qk_nope_head_dim: 64\n  qk_rope_head_dim: 32\n  v_head_dim: 64\n  rope_interleave: true\n  n_routed_experts: ${moe[0]}\n  num_experts_per_tok: ${moe[1]}\n  n_group: ${moe[2]}\n  topk_group: ${moe[3]}\n  moe_intermediate_size: ${moe[4]}\n  n_shared_experts: ${moe[5]}\n  routed_scaling_factor: 2.5\n  first_k_dense_replace: 1\n  norm_topk_prob: true/" \
    -e 's/global_batch_size: .*/global_batch_size: 2/' -e 's/local_batch_size: .*/local_batch_size: 2/' \
    -e "s/max_steps: .*/max_steps: $steps/" "$src/bench/bench_small.yaml" >"$work/ds.yaml"
load() { cut -d' ' -f1 /proc/loadavg; }
# am_run: one run; appends tokens/s (wall, CPU) to am, the shares to share
am_run() {
    (cd "$work" && rm -rf logs && OMP_NUM_THREADS=$threads AM_LOG_DIR=logs "$build/am-launch" --nproc 1 ds.yaml >out 2>&1) ||
        { echo "bench: am-train failed"; cat "$work/out"; exit 1; }
    local tok wall cpu
    tok=$(step_field "$work/logs" tokens 0 | head -1)
    wall=$(step_field "$work/logs" step_s 0 | median) cpu=$(step_field "$work/logs" cpu_s 0 | median)
    echo "$(echo "$tok / $wall" | bc -l) $(echo "$tok / $cpu" | bc -l)" >>"$work/am"
    paste <(step_field "$work/logs" step_s 0) <(step_field "$work/logs" moe_dispatch_s 0) \
        <(step_field "$work/logs" moe_experts_s 0) | awk '{ print $2 / $1, $3 / $1 }' >"$work/sh"
    echo "$(cut -f1 -d' ' "$work/sh" | median) $(cut -f2 -d' ' "$work/sh" | median)" >>"$work/share"
}
col() { cut -d' ' -f"$2" "$work/$1" | median; } # FILE COLUMN: the median over the runs
echo "DeepSeek-V3-style small (MLA, DeepSeekMoE ${EXPERTS:-fine}: ${moe[0]} experts of ${moe[4]}, top ${moe[1]} in ${moe[3]} of ${moe[2]} groups, + ${moe[5]} shared), 512 tokens a step, fp32, AdamW, $threads thread(s)"
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
am_ps=$(printf '%.0f' "$("$build/am-plan" "$work/ds.yaml" --gpus-per-node 1 --json | sed -nE 's/.*"params_total":([0-9.]+).*/\1/p')")
peer_is=$("$py" "${peer[@]}" --ids "$work/ids.txt" --describe)
echo "am: $am_ps parameters; $peer_is"
case $peer_is in *", $am_ps parameters") ;; *) echo "bench: the two models differ in size"; exit 1 ;; esac
: >"$work/am" && : >"$work/torch" && : >"$work/share" && : >"$work/load"
for ((i = 0; i < repeat; i++)); do
    load >>"$work/load"
    am_run
    load >>"$work/load"
    "$py" "${peer[@]}" --ids "$work/ids.txt" --threads "$threads" --steps "$steps" --warmup 2 >>"$work/torch"
    load >>"$work/load"
done
am_w=$(col am 1) am_c=$(col am 2) t_w=$(col torch 1) t_c=$(col torch 2)
printf '%-10s %12s %12s %10s\n' clock "am tok/s" "torch tok/s" "am/torch"
printf '%-10s %12.1f %12.1f %10.2f\n' wall "$am_w" "$t_w" "$(echo "$am_w / $t_w" | bc -l)"
printf '%-10s %12.1f %12.1f %10.2f\n' cpu "$am_c" "$t_c" "$(echo "$am_c / $t_c" | bc -l)"
echo "runs (am wall cpu | torch wall cpu): $(paste -d' ' "$work/am" "$work/torch" | awk '{ printf "%s%.1f %.1f | %.1f %.1f", (NR > 1 ? "; " : ""), $1, $2, $3, $4 }')"
printf 'am step shares (medians): MoE dispatch %.1f%%, routed experts %.1f%%\n' \
    "$(echo "100 * $(col share 1)" | bc -l)" "$(echo "100 * $(col share 2)" | bc -l)"
echo "load average (1 min) over the runs: $(sort -g "$work/load" | head -1) to $(sort -g "$work/load" | tail -1)"
