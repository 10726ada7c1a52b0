#!/bin/bash
# LoRA on gpt-oss (gpt_oss; docs/training.md, "LoRA") end to end with am-train, on CPU: the
# bundled tiny_lora recipe as gpt_oss (4 experts, top 2, q, k, v, o biases, attention sinks,
# sliding and full layers) with the target_modules of AutoModel's gpt-oss LoRA recipes, '*_proj':
# adapters on q, k, v and o (their biases, the sinks, the router and the experts frozen: the
# experts, a module named mlp.experts, are not matched by '*_proj'). In fp32:
#   golden: golden_dist on the peft golden gpt_oss_lora (the same projections on transformers'
#     GptOssForCausalLM with its load-balancing loss; tests/golden/README.md) at one rank and tp 2:
#     5 AdamW losses within 1e-5 and the final adapters within 5e-5 (test_lora_golden checks the
#     first gradients; not at pp 2, whose micro-batches of one row each would take the
#     load-balancing loss per row, where the golden's is the whole batch's);
#   the adapters train: the loss falls, the gradients are the adapters' alone;
#   checkpoint: step-N/peft holds q, k, v and o's adapters of every layer with their shapes and no
#     expert's; adapter_config.json's target_modules name them;
#   parity: tp 2 (q, k, v's B split by heads, o's A by columns, the sinks with their heads), ep 2,
#     pp 2 and tp 2 x ep 2 against one rank: losses within 1e-5, grad norms 1e-5 relative; the
#     saved adapters within 1e-5 of one rank's;
#   bf16: tp 2 x ep 2 against one rank in bf16, within twice one rank's bf16-vs-fp32 differences;
#   resume: tp 2 stopped after step 2 and restored gives steps 3 and 4 to the last bit;
#   memory: every rank's allocation equals am-plan's estimate for its pipeline rank, to the byte
#     (less the CUDA kernels' scratch, which the CPU's kernels do not allocate);
#   merge: am-ckpt merge makes q_proj's and o_proj's weights W + s B A in the base (whose experts
#     are transformers' fused tensors, copied as they are).
# The experts adapted too (target_modules ['*_proj', '*.experts']), as AutoModel's
# GroupedExpertsLoRA does (g/u = x W + s (x A) B + b, the down bias times the routing weight):
#   golden: golden_dist on gpt_oss_lora_experts (peft's target_parameters on the fused experts,
#     checked against AutoModel's formula by make_golden.py) at one rank and tp 2, as above;
#   checkpoint: each layer's experts' adapters in peft's ParamWrapper tensors (experts.lora_A/B
#     for down_proj, experts.base_layer.lora_A/B for gate_up_proj, the experts folded into the
#     rank), adapter_config.json's target_parameters naming the fused parameters;
#   parity: tp 2, ep 2, pp 2, tp 2 x ep 2 and tp 2 x ep 2 in bf16 against one rank, as above, the
#     saved adapters within 5e-5 (golden_dist's tolerance for final adapters: after 4 AdamW steps
#     an element whose gradient nearly cancels moves by up to lr on rounding alone; the experts'
#     came within 1e-5 here);
#   resume: ep 2 stopped after step 2 and restored gives steps 3 and 4 to the last bit;
#   moe_rank_scaling: the experts' adapters at rank dim // top_k, rank_pattern naming them;
#   memory: every rank's allocation is am-plan's estimate, to the byte;
#   merge: am-ckpt merge makes gate_up_proj and down_proj W_e + s A_eᵀ B_eᵀ for each expert.
set -u
. "$(dirname "$0")/lora-lib.sh"
steps=4 loss_tol=1e-5 norm_tol=1e-5

# golden: golden_dist on peft's gpt_oss_lora and gpt_oss_lora_experts
for tp in 1 2; do lora_golden gpt_oss_lora "'*_proj'" $tp 1; done
for tp in 1 2; do lora_golden gpt_oss_lora_experts "['*_proj', '*.experts']" $tp 1; done

lora_dataset 600 GPL-3 Apache-2.0

recipe() { # NAME EP [TARGETS]: tiny_lora.yaml as gpt_oss in fp32 on the instruction data, target_modules '*_proj'
    sed -e "s|paths: .*|paths: $work/ds|" -e "s/max_steps: .*/max_steps: $steps/" -e "s/ckpt_every_steps: .*/ckpt_every_steps: 2/" \
        -e 's/model_type: llama/model_type: gpt_oss\n  num_local_experts: 4\n  num_experts_per_tok: 2\n  head_dim: 16\n  sliding_window: 24/' \
        -e "s/target_modules: .*/target_modules: ${3:-'*_proj'}/" -e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$1|" \
        -e "s/tp_size: 1/tp_size: 1\n  ep_size: $2/" \
        "$AM_SRCDIR/sbatch-templates/recipes/tiny_lora.yaml" >"$work/$1.yaml"
}

lora_ref "LoRA on gpt_oss"
ad="$work/ckpt-ref/step-$steps/peft/adapter_model.safetensors" cfg="$work/ckpt-ref/step-$steps/peft/adapter_config.json"
p=base_model.model.model.layers
# 4 layers x q, k, v, o x A, B; q [4 x 16, 64], k and v [2 x 16, 64], o [64, 4 x 16]
if [ -f "$ad" ] && tensors "$ad" >"$work/names-ref" && [ "$(wc -l <"$work/names-ref")" = 32 ] &&
    grep -qx "$p.0.self_attn.q_proj.lora_A.weight 8 64" "$work/names-ref" &&
    grep -qx "$p.0.self_attn.q_proj.lora_B.weight 64 8" "$work/names-ref" &&
    grep -qx "$p.1.self_attn.k_proj.lora_B.weight 32 8" "$work/names-ref" &&
    grep -qx "$p.2.self_attn.v_proj.lora_B.weight 32 8" "$work/names-ref" &&
    grep -qx "$p.3.self_attn.o_proj.lora_A.weight 8 64" "$work/names-ref" &&
    ! grep -q "experts\|router\|sinks\|lm_head" "$work/names-ref" &&
    tr -d ' \n' <"$cfg" | grep -qE '"target_modules":\["(q|k|v|o)_proj","(q|k|v|o)_proj","(q|k|v|o)_proj","(q|k|v|o)_proj"\]'; then
    ok "step-$steps/peft holds q, k, v and o's adapters of every layer with their shapes, no expert's, router's or sinks'; target_modules name them"
else
    bad "step-$steps/peft: $(wc -l <"$work/names-ref" 2>&1) tensors; $(tr -d ' \n' <"$cfg" | grep -o '"target_modules":\[[^]]*' | cut -c1-300)"
fi


lora_layouts "LoRA on gpt_oss" "tp2 2 1 AM_TP=2" "ep2 2 2" "pp2 2 1 AM_PP=2" "tp2-ep2 4 2 AM_TP=2"

# bf16: tp 2 x ep 2 against one rank's bf16 run, within twice one rank's bf16-vs-fp32 differences
lora_bf16 "tp2-ep2-bf16 4 tp2-ep2 AM_TP=2"
if compare ref-bf16 tp2-ep2-bf16 "${tol%% *}" "${tol##* }"; then
    ok "LoRA on gpt_oss tp2-ep2 matches one rank in bf16: $(cat "$work/cmp-tp2-ep2-bf16")"
else
    bad "LoRA on gpt_oss tp2-ep2 in bf16: $(cat "$work/cmp-tp2-ep2-bf16")"; paste "$work/steps-ref-bf16" "$work/steps-tp2-ep2-bf16" | sed 's/^/    /'
fi
lora_resume "LoRA on gpt_oss" tp2 2 1 AM_TP=2

# the experts adapted too: one rank, its checkpoint, the layouts and bf16 against it
xt="['*_proj', '*.experts']"
recipe xref 1 "$xt"
train xref 1 "$work/xref.yaml" || { sed 's/^/    /' "$work/out-xref"; bad "LoRA on gpt_oss's experts did not train on one rank"; exit 1; }
steps_of "$work/logs-xref" >"$work/steps-xref"
if [ "$(wc -l <"$work/steps-xref")" = "$steps" ] &&
    awk 'NR == 1 { a = $2 } END { exit !($2 < a) }' "$work/steps-xref" &&
    [ "$(memory "$work/logs-xref" 0 grads_bytes)" = "$(($(memory "$work/logs-xref" 0 adapter_params) * 4))" ] &&
    [ "$(memory "$work/logs-xref" 0 adapter_params)" -gt "$(memory "$work/logs-ref" 0 adapter_params)" ]; then
    ok "LoRA on gpt_oss's attention and experts, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-xref"); gradients of the $(memory "$work/logs-xref" 0 adapter_params) adapter parameters only"
else
    bad "LoRA on gpt_oss's experts, one rank: losses $(awk '{ printf "%s ", $2 }' "$work/steps-xref"), grads_bytes $(memory "$work/logs-xref" 0 grads_bytes) for $(memory "$work/logs-xref" 0 adapter_params) adapter parameters"
fi
xad="$work/ckpt-xref/step-$steps/peft/adapter_model.safetensors" xcfg="$work/ckpt-xref/step-$steps/peft/adapter_config.json"
# the attention's 32 and 4 layers x 4 ParamWrapper tensors: rank 8 x 4 experts = 32; C 64, I 176
if [ -f "$xad" ] && tensors "$xad" >"$work/names-xref" && [ "$(wc -l <"$work/names-xref")" = 48 ] &&
    [ "$(grep -v experts "$work/names-xref")" = "$(cat "$work/names-ref")" ] &&
    grep -qx "$p.1.mlp.experts.base_layer.lora_A.weight 32 64" "$work/names-xref" &&
    grep -qx "$p.1.mlp.experts.base_layer.lora_B.weight 352 32" "$work/names-xref" &&
    grep -qx "$p.3.mlp.experts.lora_A.weight 32 176" "$work/names-xref" &&
    grep -qx "$p.3.mlp.experts.lora_B.weight 64 32" "$work/names-xref" &&
    [ "$(grep -c experts "$work/names-xref")" = 16 ] &&
    tr -d ' \n' <"$xcfg" | grep -qF '"target_parameters":["mlp.experts.gate_up_proj","mlp.experts.down_proj"]' &&
    ! tr -d ' \n' <"$xcfg" | grep -q 'experts\.[0-9]'; then
    ok "step-$steps/peft holds each layer's experts' adapters in peft's ParamWrapper tensors (base_layer.lora_A [32, 64], base_layer.lora_B [352, 32], lora_A [32, 176], lora_B [64, 32]) beside the attention's; target_parameters name the fused experts"
else
    bad "step-$steps/peft with the experts: $(wc -l <"$work/names-xref" 2>&1) tensors; $(grep experts "$work/names-xref" | head -4 | tr '\n' ';'); $(tr -d ' \n' <"$xcfg" | grep -o '"target_parameters":\[[^]]*')"
fi
lora_layouts -r xref -t 5e-5 -x "$xt" "LoRA on gpt_oss's experts" "xtp2 2 1 AM_TP=2" "xep2 2 2" "xpp2 2 1 AM_PP=2" "xtp2-ep2 4 2 AM_TP=2"
lora_bf16 -r xref "xtp2-ep2-bf16 4 xtp2-ep2 AM_TP=2"
if compare xref-bf16 xtp2-ep2-bf16 "${tol%% *}" "${tol##* }"; then
    ok "LoRA on gpt_oss's experts tp2-ep2 matches one rank in bf16: $(cat "$work/cmp-xtp2-ep2-bf16")"
else
    bad "LoRA on gpt_oss's experts tp2-ep2 in bf16: $(cat "$work/cmp-xtp2-ep2-bf16")"; paste "$work/steps-xref-bf16" "$work/steps-xtp2-ep2-bf16" | sed 's/^/    /'
fi
lora_resume -x "$xt" "LoRA on gpt_oss's experts" xep2 2 2

# moe_rank_scaling (AutoModel's): the experts' adapters of rank dim // num_experts_per_tok = 8 // 2
# = 4 at ep 2: their ParamWrapper tensors at rank 4 x 4 experts, rank_pattern saying so
recipe xrank 2 "$xt" && sed -i "s/target_modules: .*/&\n  moe_rank_scaling: true/" "$work/xrank.yaml"
if train xrank 2 "$work/xrank.yaml" && tensors "$work/ckpt-xrank/step-$steps/peft/adapter_model.safetensors" >"$work/names-xrank" &&
    grep -qx "$p.0.mlp.experts.base_layer.lora_A.weight 16 64" "$work/names-xrank" &&
    grep -qx "$p.0.mlp.experts.lora_B.weight 64 16" "$work/names-xrank" &&
    grep -qx "$p.0.self_attn.q_proj.lora_A.weight 8 64" "$work/names-xrank" &&
    tr -d ' \n' <"$work/ckpt-xrank/step-$steps/peft/adapter_config.json" |
    grep -qF '"rank_pattern":{"experts\\.(gate_up_proj|down_proj)":4}'; then
    ok "moe_rank_scaling: the experts' ParamWrapper tensors at rank 4 (x 4 experts), the attention's at 8; rank_pattern {experts\\.(gate_up_proj|down_proj): 4}"
else
    bad "moe_rank_scaling on gpt_oss's experts: $(grep 'experts' "$work/names-xrank" 2>/dev/null | head -2 | tr '\n' ';') $(tail -3 "$work/out-xrank")"
fi

lora_memory "LoRA on gpt_oss" "ref 1" "tp2 2 AM_TP=2" "ep2 2" "pp2 2 AM_PP=2" "tp2-ep2 4 AM_TP=2" "tp2-ep2-bf16 4 AM_TP=2" \
    "xref 1" "xtp2 2 AM_TP=2" "xep2 2" "xpp2 2 AM_PP=2" "xtp2-ep2 4 AM_TP=2" "xtp2-ep2-bf16 4 AM_TP=2" "xrank 2"

# merge: am-ckpt merge writes q_proj's and o_proj's weights as W + s B A into the base the adapters
# were trained on, exported by a run of the same seed after one step at lr 0 (the warmup's first:
# the initial weights); the experts' fused tensors copied as they are
sed -e '/^peft:/,/^distributed:/{/^distributed:/!d}' -e 's/max_steps: .*/max_steps: 1/' -e 's/is_peft: true/is_peft: false/' \
    -e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-base|" "$work/ref.yaml" >"$work/base.yaml"
if train base 1 "$work/base.yaml" && "$AM_BUILDDIR/am-ckpt" merge "$work/ckpt-base/step-1/hf" "$work/ckpt-ref/step-$steps/peft" \
    "$work/merged" >"$work/out-merge" 2>&1 && grep -q "merged 16 adapted weights" "$work/out-merge"; then
    fit=1
    for w in "model.layers.0.self_attn.q_proj 64 64" "model.layers.3.self_attn.o_proj 64 64"; do
        set -- $w
        awk -v s=4 -v r=8 -v rows="$2" -v cols="$3" '
            FNR == 1 { f++ } f == 1 { B[FNR - 1] = $1 } f == 2 { A[FNR - 1] = $1 } f == 3 { W[FNR - 1] = $1 }
            f == 4 { i = FNR - 1; o = int(i / cols); c = i % cols; d = 0
                     for (k = 0; k < r; k++) d += B[o * r + k] * A[k * cols + c]
                     e = $1 - W[i] - s * d; if (e < 0) e = -e; if (e > worst) worst = e; n++ }
            END { printf "%.2g ", worst; exit !(n == rows * cols && worst < 1e-6) }' \
            <(values "$ad" "base_model.model.$1.lora_B.weight") <(values "$ad" "base_model.model.$1.lora_A.weight") \
            <(values "$work/ckpt-base/step-1/hf/model.safetensors" "$1.weight") \
            <(values "$work/merged/model.safetensors" "$1.weight") >>"$work/merge-fit" || fit=0
    done
    for t in model.layers.1.mlp.experts.gate_up_proj model.layers.2.self_attn.sinks; do
        [ "$(values "$work/ckpt-base/step-1/hf/model.safetensors" "$t" | md5sum)" = \
            "$(values "$work/merged/model.safetensors" "$t" | md5sum)" ] || fit=0
    done
    if [ "$fit" = 1 ]; then
        ok "am-ckpt merge: q_proj's and o_proj's weights become W + s B A (within $(cat "$work/merge-fit")), the fused experts and the sinks copied"
    else
        bad "am-ckpt merge: a merged weight is not W + s B A, or a base tensor changed ($(cat "$work/merge-fit" 2>/dev/null))"
    fi
else
    bad "am-ckpt merge of gpt_oss's adapters: $(cat "$work/out-merge" 2>/dev/null)"; sed 's/^/    /' "$work/out-base" | tail -5
fi

# merge with the experts: gate_up_proj and down_proj become W_e + s A_eᵀ B_eᵀ for each expert
# (A [r E, in] with expert e's rows at e r + k, B [out, r E] its columns at k E + e; r 8, E 4, s 4)
if [ -d "$work/ckpt-base/step-1/hf" ] && "$AM_BUILDDIR/am-ckpt" merge "$work/ckpt-base/step-1/hf" \
    "$work/ckpt-xref/step-$steps/peft" "$work/xmerged" >"$work/out-xmerge" 2>&1 &&
    grep -q "merged 24 adapted weights" "$work/out-xmerge"; then
    fit=1
    for w in "model.layers.1.mlp.experts.base_layer gate_up_proj 64 352" "model.layers.2.mlp.experts down_proj 176 64"; do
        set -- $w
        awk -v s=4 -v r=8 -v E=4 -v ni="$3" -v no="$4" '
            FNR == 1 { f++ } f == 1 { A[FNR - 1] = $1 } f == 2 { B[FNR - 1] = $1 } f == 3 { W[FNR - 1] = $1 }
            f == 4 { i = FNR - 1; e = int(i / (ni * no)); x = int(i / no) % ni; o = i % no; d = 0
                     for (k = 0; k < r; k++) d += A[(e * r + k) * ni + x] * B[o * r * E + k * E + e]
                     g = $1 - W[i] - s * d; if (g < 0) g = -g; if (g > worst) worst = g; n++ }
            END { printf "%.2g ", worst; exit !(n == E * ni * no && worst < 1e-6) }' \
            <(values "$xad" "base_model.model.$1.lora_A.weight") <(values "$xad" "base_model.model.$1.lora_B.weight") \
            <(values "$work/ckpt-base/step-1/hf/model.safetensors" "${1%.base_layer}.$2") \
            <(values "$work/xmerged/model.safetensors" "${1%.base_layer}.$2") >>"$work/xmerge-fit" || fit=0
    done
    for t in model.layers.1.mlp.experts.gate_up_proj_bias model.layers.2.mlp.router.weight; do
        [ "$(values "$work/ckpt-base/step-1/hf/model.safetensors" "$t" | md5sum)" = \
            "$(values "$work/xmerged/model.safetensors" "$t" | md5sum)" ] || fit=0
    done
    if [ "$fit" = 1 ]; then
        ok "am-ckpt merge: gate_up_proj and down_proj become W_e + s A_eᵀ B_eᵀ (within $(cat "$work/xmerge-fit")), the experts' biases and the router copied"
    else
        bad "am-ckpt merge of the experts' adapters: a merged parameter is not W_e + s A_eᵀ B_eᵀ, or a base tensor changed ($(cat "$work/xmerge-fit" 2>/dev/null))"
    fi
else
    bad "am-ckpt merge of gpt_oss's experts' adapters: $(cat "$work/out-xmerge" 2>/dev/null)"
fi

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
