#!/bin/bash
# LoRA on GLM-4.5 MoE (glm4_moe; docs/training.md, "LoRA") end to end with am-train, on CPU: the
# bundled tiny_lora recipe as glm4_moe (partial rotary, q, k, v biases, q/k norms, layer 0 a
# dense MLP, layers 1-3 8 experts in 4 groups with the sigmoid router and 2 shared experts) with
# AutoModel's target_modules: ['*']: adapters on q, k, v, o, the dense layer's MLP
# (mlp.gate_proj, up_proj, down_proj), the shared experts' (mlp.shared_experts.gate_proj, ...:
# peft's names, apart from the dense one's), every expert (GroupedExpertsLoRA, as on qwen3_moe)
# and lm_head; the router and the base frozen. In fp32:
#   golden: golden_dist on the peft golden glm4_moe_lora (the same projections on transformers'
#     Glm4MoeForCausalLM; README.md) at one rank and tp 2: 5 AdamW losses within 1e-5 and
#     the final adapters within 5e-5 (test_lora_golden checks the first gradients);
#   the adapters train: the loss falls, the gradients are the adapters' alone;
#   checkpoint: step-N/peft holds the dense MLP's and the shared experts' adapters under their
#     own names with their shapes (the shared experts' width 2 x 32), every expert's and
#     lm_head's; adapter_config.json's target_modules name gate_proj, up_proj, down_proj;
#   parity: tp 2 (the dense MLP's and the shared experts' adapters split with them: B of gate
#     and up by rows, A of down by columns), ep 2, pp 2 and tp 2 x ep 2 against one rank: losses
#     within 1e-5, grad norms 1e-5 relative; the saved adapters within 1e-5 of one rank's;
#   bf16: tp 2 x ep 2 against one rank in bf16, within twice one rank's bf16-vs-fp32 differences;
#   dropout: adapter dropout 0.1 (all adapters but the experts' and lm_head's) at tp 2 against
#     one rank;
#   resume: tp 2 stopped after step 2 and restored gives steps 3 and 4 to the last bit;
#   memory: every rank's allocation equals am-plan's estimate for its pipeline rank, to the byte
#     (less the CUDA kernels' scratch, which the CPU's kernels do not allocate);
#   merge: am-ckpt merge makes the dense MLP's and the shared experts' weights W + s B A.
# With LORA_ARCH=deepseek_v3 (tests/train/test-lora-mla.sh) the same on DeepSeek-V3 (its MoE
# glm4_moe's; multi-head latent attention with q_lora_rank 24, kv_lora_rank 16, v narrower than
# q and k): the attention's adapters are on q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj
# and o_proj (under tp q_b_proj's and kv_b_proj's B split by heads, o_proj's A by columns,
# q_a_proj's and kv_a_proj_with_mqa's whole with their gradients summed over tp), against the
# golden deepseek_v3_lora, and the merge checks q_a_proj and kv_b_proj too.
set -u
arch=${LORA_ARCH:-glm4_moe}
case $arch in
glm4_moe)
    golden=glm4_moe_lora golden_targets="['*_proj', 'lm_head']" drop_targets="['*_proj']"
    edits='s/model_type: llama/model_type: glm4_moe\n  partial_rotary_factor: 0.5\n  attention_bias: true\n  use_qk_norm: true\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n  routed_scaling_factor: 1.5\n  first_k_dense_replace: 1\n  norm_topk_prob: true/'
    attn=8 ;; # q, k, v, o: A and B
deepseek_v3)
    golden=deepseek_v3_lora golden_targets="['*_proj', '*.kv_a_proj_with_mqa', 'lm_head']"
    drop_targets="['*_proj', '*.kv_a_proj_with_mqa']"
    edits='s/model_type: llama/model_type: deepseek_v3\n  q_lora_rank: 24\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n  v_head_dim: 12\n  rope_interleave: true\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n  routed_scaling_factor: 1.5\n  first_k_dense_replace: 1\n  norm_topk_prob: true/; s/num_key_value_heads: 2/num_key_value_heads: 4/'
    attn=10 ;; # q_a, q_b, kv_a, kv_b, o
*) echo "test-lora-glm.sh: LORA_ARCH $arch is not glm4_moe or deepseek_v3" >&2; exit 2 ;;
esac
. "$(dirname "$0")/lora-lib.sh"
steps=4 loss_tol=1e-5 norm_tol=1e-5

# golden: golden_dist on peft's glm4_moe_lora (deepseek_v3_lora)
lora_golden "$golden" "$golden_targets" 1 1
lora_golden "$golden" "$golden_targets" 2 1

lora_dataset 600 GPL-3 Apache-2.0

recipe() { # NAME EP: tiny_lora.yaml as $arch in fp32 on the instruction data, target_modules ['*']
    sed -e "s|paths: .*|paths: $work/ds|" -e "s/max_steps: .*/max_steps: $steps/" -e "s/ckpt_every_steps: .*/ckpt_every_steps: 2/" \
        -e "$edits" \
        -e "s/target_modules: .*/target_modules: ['*']/" -e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$1|" \
        -e "s/tp_size: 1/tp_size: 1\n  ep_size: $2/" \
        "$AM_SRCDIR/sbatch-templates/recipes/tiny_lora.yaml" >"$work/$1.yaml"
}

lora_ref "LoRA on $arch"

ad="$work/ckpt-ref/step-$steps/peft/adapter_model.safetensors" cfg="$work/ckpt-ref/step-$steps/peft/adapter_config.json"
p=base_model.model.model.layers
# per layer: the attention's adapters, the MLP's (6); per MoE layer 8 experts x 6; lm_head 2
names_ok() {
    grep -qx "$p.0.mlp.gate_proj.lora_A.weight 8 64" "$work/names-ref" &&
        grep -qx "$p.0.mlp.gate_proj.lora_B.weight 176 8" "$work/names-ref" &&
        grep -qx "$p.0.mlp.down_proj.lora_A.weight 8 176" "$work/names-ref" &&
        grep -qx "$p.2.mlp.shared_experts.up_proj.lora_B.weight 64 8" "$work/names-ref" &&
        grep -qx "$p.2.mlp.shared_experts.down_proj.lora_A.weight 8 64" "$work/names-ref" &&
        grep -qx "$p.3.mlp.shared_experts.gate_proj.lora_A.weight 8 64" "$work/names-ref" &&
        ! grep -q "$p.0.mlp.shared_experts" "$work/names-ref" && ! grep -q "$p.1.mlp.gate_proj" "$work/names-ref" &&
        grep -qx "$p.3.mlp.experts.7.down_proj.lora_B.weight 64 8" "$work/names-ref" &&
        grep -qx "base_model.model.lm_head.lora_B.weight 1024 8" "$work/names-ref" &&
        [ "$(wc -l <"$work/names-ref")" = $((4 * (attn + 6) + 3 * 8 * 6 + 2)) ] &&
        grep -q '"model.layers.3.mlp.experts.7.down_proj"' "$cfg" || return 1
    if [ "$arch" = glm4_moe ]; then
        tr -d ' \n' <"$cfg" | grep -qF '"q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head"'
    else # multi-head latent attention: q_a [24, 64], q_b [4 x 16, 24], kv_a [16 + 8, 64], kv_b [4 x (8 + 12), 16], o [64, 4 x 12]
        grep -qx "$p.1.self_attn.q_a_proj.lora_B.weight 24 8" "$work/names-ref" &&
            grep -qx "$p.1.self_attn.q_b_proj.lora_A.weight 8 24" "$work/names-ref" &&
            grep -qx "$p.1.self_attn.q_b_proj.lora_B.weight 64 8" "$work/names-ref" &&
            grep -qx "$p.2.self_attn.kv_a_proj_with_mqa.lora_B.weight 24 8" "$work/names-ref" &&
            grep -qx "$p.2.self_attn.kv_b_proj.lora_A.weight 8 16" "$work/names-ref" &&
            grep -qx "$p.2.self_attn.kv_b_proj.lora_B.weight 80 8" "$work/names-ref" &&
            grep -qx "$p.3.self_attn.o_proj.lora_A.weight 8 48" "$work/names-ref" &&
            tr -d ' \n' <"$cfg" |
            grep -qF '"q_b_proj","o_proj","gate_proj","up_proj","down_proj","q_a_proj","kv_a_proj_with_mqa","kv_b_proj","lm_head"'
    fi
}
if [ -f "$ad" ] && tensors "$ad" >"$work/names-ref" && names_ok; then
    ok "step-$steps/peft holds the attention's adapters, the dense MLP's (mlp.gate_proj ...) and the shared experts' (mlp.shared_experts.gate_proj ...) apart, with their shapes, every expert's and lm_head's; target_modules name them"
else
    bad "step-$steps/peft: $(wc -l <"$work/names-ref" 2>&1) tensors; $(grep -E 'mlp\.(shared_experts\.)?gate_proj' "$work/names-ref" 2>&1 | tr '\n' ' '); $(tr -d ' \n' <"$cfg" | grep -o '"target_modules":\[[^]]*' | cut -c1-300)"
fi

lora_layouts "LoRA on $arch" "tp2 2 1 AM_TP=2" "ep2 2 2" "pp2 2 1 AM_PP=2" "tp2-ep2 4 2 AM_TP=2"

# bf16: tp 2 x ep 2 against one rank's bf16 run, within twice one rank's bf16-vs-fp32 differences
lora_bf16 "tp2-ep2-bf16 4 tp2-ep2 AM_TP=2"
if compare ref-bf16 tp2-ep2-bf16 "${tol%% *}" "${tol##* }"; then
    ok "LoRA on $arch tp2-ep2 matches one rank in bf16: $(cat "$work/cmp-tp2-ep2-bf16")"
else
    bad "LoRA on $arch tp2-ep2 in bf16: $(cat "$work/cmp-tp2-ep2-bf16")"; paste "$work/steps-ref-bf16" "$work/steps-tp2-ep2-bf16" | sed 's/^/    /'
fi

# adapter dropout 0.1 on every adapter but the experts' and lm_head's: tp 2 draws the masks of one rank
for run in "drop 1" "drop-tp2 2 AM_TP=2"; do
    set -- $run
    recipe "$1" 1 && sed -i -e "s/target_modules: .*/target_modules: $drop_targets/" -e 's/dropout: 0.0/dropout: 0.1/' "$work/$1.yaml"
    name=$1 n=$2
    shift 2
    train "$name" "$n" "$work/$name.yaml" "$@" && steps_of "$work/logs-$name" >"$work/steps-$name" || { bad "$name did not train"; sed 's/^/    /' "$work/out-$name"; }
done
if compare drop drop-tp2 && [ "$(head -1 "$work/steps-drop")" != "$(head -1 "$work/steps-ref")" ]; then
    ok "LoRA on $arch with adapter dropout 0.1: tp 2 matches one rank ($(cat "$work/cmp-drop-tp2"))"
else
    bad "LoRA on $arch with adapter dropout 0.1 at tp 2: $(cat "$work/cmp-drop-tp2")"; paste "$work/steps-drop" "$work/steps-drop-tp2" | sed 's/^/    /'
fi

lora_resume "LoRA on $arch" tp2 2 1 AM_TP=2
lora_memory "LoRA on $arch" "ref 1" "tp2 2 AM_TP=2" "ep2 2" "pp2 2 AM_PP=2" "tp2-ep2 4 AM_TP=2" "tp2-ep2-bf16 4 AM_TP=2"

# merge: am-ckpt merge writes the dense MLP's and the shared experts' weights as W + s B A into
# the base the adapters were trained on, exported by a run of the same seed after one step at
# lr 0 (the warmup's first: the initial weights)
sed -e '/^peft:/,/^distributed:/{/^distributed:/!d}' -e 's/max_steps: .*/max_steps: 1/' -e 's/is_peft: true/is_peft: false/' \
    -e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-base|" "$work/ref.yaml" >"$work/base.yaml"
if train base 1 "$work/base.yaml" && "$AM_BUILDDIR/am-ckpt" merge "$work/ckpt-base/step-1/hf" "$work/ckpt-ref/step-$steps/peft" \
    "$work/merged" >"$work/out-merge" 2>&1 &&
    grep -q "merged $((4 * (attn / 2 + 3) + 3 * 8 * 3 + 1)) adapted weights" "$work/out-merge"; then
    fit=1 mw=("model.layers.0.mlp.gate_proj 176 64" "model.layers.0.mlp.down_proj 64 176"
        "model.layers.2.mlp.shared_experts.up_proj 64 64" "model.layers.3.mlp.shared_experts.down_proj 64 64")
    [ "$arch" = deepseek_v3 ] && mw+=("model.layers.1.self_attn.q_a_proj 24 64" "model.layers.2.self_attn.kv_b_proj 80 16")
    for w in "${mw[@]}"; do
        set -- $w
        merge_error 4 8 "$2" "$3" \
            <(values "$ad" "base_model.model.$1.lora_B.weight") <(values "$ad" "base_model.model.$1.lora_A.weight") \
            <(values "$work/ckpt-base/step-1/hf/model.safetensors" "$1.weight") \
            <(values "$work/merged/model.safetensors" "$1.weight") >>"$work/merge-fit" || fit=0
    done
    if [ "$fit" = 1 ]; then
        ok "am-ckpt merge: the dense MLP's and the shared experts' weights$([ "$arch" = deepseek_v3 ] && echo ", q_a_proj's and kv_b_proj's") become W + s B A (within $(tr '\n' ' ' <"$work/merge-fit"))"
    else
        bad "am-ckpt merge: a merged weight is not W + s B A ($(tr '\n' ' ' <"$work/merge-fit" 2>/dev/null))"
    fi
else
    bad "am-ckpt merge of $arch's adapters: $(cat "$work/out-merge" 2>/dev/null)"; sed 's/^/    /' "$work/out-base" | tail -5
fi

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
