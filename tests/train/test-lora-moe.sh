#!/bin/bash
# LoRA on a mixture-of-experts model (docs/training.md, "LoRA") end to end with am-train, on CPU:
# the bundled tiny_moe recipe (Mixtral-style, 4 experts, top 2, ep 2) with a peft section on
# the attention projections and the experts (AutoModel's target_modules on q, k, v, o and
# '*.experts': each expert's gate, up and down adapted as GroupedExpertsLoRA does), adapter
# dropout 0.1 (on the attention's adapters), in fp32; the router and the base frozen (no
# gradients, no optimizer state),
#   parity: ep 2, tp 2 x ep 2 and pp 2 against one rank (ep 1): losses within 1e-5, grad norms
#     1e-5 relative (test-parity.sh's fp32 tolerances); the saved adapters within 1e-5 of one
#     rank's, under the same names and shapes;
#   bf16: ep 2 and tp 2 x ep 2 against one rank in bf16, within twice one rank's bf16-vs-fp32
#     differences;
#   the adapters train: the loss falls from step 1 and the gradients are the adapters' alone (a
#     grads_bytes record of the adapter parameters), the experts' adapters among them (the grad
#     norm of step 1 differs from the attention-only run's);
#   memory: what LoRA changes of every rank's allocation (the base's gradients and moments gone,
#     the adapters' added) equals what it changes of am-plan's estimate for its pipeline rank, to
#     the byte;
#   checkpoint: step-N/peft holds the attention adapters and every expert's (gathered over ep)
#     as peft names them, with their shapes (lora_A [r, in], lora_B [out, r]; up's lora_A the
#     same values as gate's: AutoModel's shared A), adapter_config.json's target_modules listing
#     each expert's projections; an attention-only run saves no expert's;
#   resume: the ep 2 run stopped after step 2 and restored gives the uninterrupted run's steps 3
#     and 4 to the last bit (each ep rank's experts' adapters in the sharded checkpoint).
#   merge: am-ckpt merge of the saved adapters into the base (exported by a run of the same seed
#     at lr 0) makes an expert's w1, w3, w2 W + s B A, gate's and up's with the shared A;
#   moe_rank_scaling: true: the experts' adapters at rank 8 // 2 = 4, scale 32 / 4: ep 2 against
#     one rank, the saved shapes and adapter_config.json's rank_pattern, the merge at each
#     module's scale, the memory against am-plan's.
# (test_recipe checks the refusals: the experts of some layers only, a dense layer's MLP;
# refusals.tsv moe_rank_scaling with dim below num_experts_per_tok; tests/model/test_lora_moe
# the experts' adapters' math, at rank r and r / top-k.)
set -u
steps=4 loss_tol=1e-5 norm_tol=1e-5
source "$(dirname "$0")/lora-lib.sh"

lora_dataset 600 GPL-3 Apache-2.0

recipe() { # NAME EP [TARGETS]: tiny_moe.yaml in fp32 on the instruction data, adapters on the attention and
    # the experts (or TARGETS)
    sed -e "s|paths: .*|paths: $work/ds|" -e "s/vocab_size: .*/vocab_size: 1024/" -e "s/max_steps: .*/max_steps: $steps/" \
        -e "s/ep_size: .*/ep_size: $2/" -e 's/^  ep_size: \(.*\)/  ep_size: \1\n  mp_policy:\n    param_dtype: float32/' \
        "$AM_SRCDIR/sbatch-templates/recipes/tiny_moe.yaml" >"$work/$1.yaml"
    cat >>"$work/$1.yaml" <<YAML

peft:
  _target_: nemo_automodel.components._peft.lora.PeftConfig
  target_modules: ${3:-['*.q_proj', '*.k_proj', '*.v_proj', '*.o_proj', '*.experts']}
  dim: 8
  alpha: 32
  dropout: 0.1

checkpoint:
  enabled: true
  checkpoint_dir: $work/ckpt-$1
YAML
}

lora_ref "LoRA on tiny_moe"
# the saved adapters: their names and shapes (and up's lora_A the same values as gate's), from
# the safetensors header, and target_modules
slice() { # FILE NAME: the tensor's bytes, as hex
    local n off
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    off=$(head -c $((8 + n)) "$1" | tail -c "$n" | grep -oE "\"$2\":\\{[^}]*\\}" | grep -oE 'data_offsets":\[[0-9]+,[0-9]+' |
        grep -oE '[0-9]+,[0-9]+')
    od -An -v -t x1 -j $((8 + n + ${off%,*})) -N $((${off#*,} - ${off%,*})) "$1" | tr -d ' \n'
}
ad="$work/ckpt-ref/step-$steps/peft/adapter_model.safetensors"
e=base_model.model.model.layers.2.block_sparse_moe.experts.3
if [ -f "$ad" ] && tensors "$ad" >"$work/names-ref" &&
    grep -qx 'base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight 64 8' "$work/names-ref" &&
    grep -qx "$e.w1.lora_A.weight 8 64" "$work/names-ref" && grep -qx "$e.w3.lora_A.weight 8 64" "$work/names-ref" &&
    grep -qx "$e.w1.lora_B.weight 96 8" "$work/names-ref" && grep -qx "$e.w3.lora_B.weight 96 8" "$work/names-ref" &&
    grep -qx "$e.w2.lora_A.weight 8 96" "$work/names-ref" && grep -qx "$e.w2.lora_B.weight 64 8" "$work/names-ref" &&
    [ "$(grep -c 'experts' "$work/names-ref")" = $((4 * 4 * 6)) ] && [ "$(wc -l <"$work/names-ref")" = $((4 * 4 * 6 + 4 * 4 * 2)) ] &&
    [ "$(slice "$ad" "$e.w1.lora_A.weight")" = "$(slice "$ad" "$e.w3.lora_A.weight")" ] &&
    [ -n "$(slice "$ad" "$e.w2.lora_B.weight" | tr -d 0)" ] &&
    grep -q '"model.layers.0.block_sparse_moe.experts.0.w1"' "$work/ckpt-ref/step-$steps/peft/adapter_config.json" &&
    grep -q '"model.layers.3.block_sparse_moe.experts.3.w2"' "$work/ckpt-ref/step-$steps/peft/adapter_config.json" &&
    grep -q '"lora_dropout": 0.1' "$work/ckpt-ref/step-$steps/peft/adapter_config.json"; then
    ok "step-$steps/peft holds the attention adapters and each expert's as peft names them, with their shapes (up's lora_A gate's, the trained B non-zero), target_modules naming each expert's projections, lora_dropout 0.1"
else
    bad "step-$steps/peft: $(ls "$work/ckpt-ref/step-$steps/peft" 2>&1 | tr '\n' ' '); $(grep -c experts "$work/names-ref" 2>&1) experts' tensors"
fi
# the attention alone: the experts frozen with the base, none saved, and the experts' adapters
# change the gradients from step 1
recipe att 1 "['*.q_proj', '*.k_proj', '*.v_proj', '*.o_proj']"
if train att 1 "$work/att.yaml" && steps_of "$work/logs-att" >"$work/steps-att" &&
    ! tensors "$work/ckpt-att/step-$steps/peft/adapter_model.safetensors" | grep -q experts &&
    [ "$(head -1 "$work/steps-att" | cut -d' ' -f2)" = "$(head -1 "$work/steps-ref" | cut -d' ' -f2)" ] &&
    [ "$(head -1 "$work/steps-att" | cut -d' ' -f3)" != "$(head -1 "$work/steps-ref" | cut -d' ' -f3)" ]; then
    ok "adapters on the attention alone: no expert's saved; the experts' adapters (B zero) leave step 1's loss and change its gradients"
else
    bad "adapters on the attention alone: $(head -1 "$work/steps-att" 2>&1) against $(head -1 "$work/steps-ref")"
fi

lora_layouts "LoRA on tiny_moe" "ep2 2 2" "tp2-ep2 4 2 AM_TP=2" "pp2 2 1 AM_PP=2"

# bf16: ep 2 and tp 2 x ep 2 against one rank's bf16 run, within twice one rank's bf16-vs-fp32
# differences (loss; grad norm relative), as test-lora.sh tolerates bf16 layouts
lora_bf16 "ep2-bf16 2 ep2" "tp2-ep2-bf16 4 tp2-ep2 AM_TP=2"
for name in ep2-bf16 tp2-ep2-bf16; do
    if compare ref-bf16 "$name" "${tol%% *}" "${tol##* }"; then
        ok "LoRA on tiny_moe $name matches one rank in bf16: $(cat "$work/cmp-$name")"
    else
        bad "LoRA on tiny_moe $name: $(cat "$work/cmp-$name")"; paste "$work/steps-ref-bf16" "$work/steps-$name" | sed 's/^/    /'
    fi
done

# bf16 storage (model.torch_dtype bfloat16: the adapters, their AdamW moments and the frozen base
# in bf16, as AutoModel keeps them without lora_dtype): ep 2 and tp 2 x ep 2 against one rank's
# bf16-storage run, within twice that run's distance from fp32; every rank's allocation am-plan's
lora_bf16 -s "ep2-s16 2 ep2" "tp2-ep2-s16 4 tp2-ep2 AM_TP=2"
for name in ep2-s16 tp2-ep2-s16; do
    if compare ref-s16 "$name" "${tol%% *}" "${tol##* }"; then
        ok "LoRA on tiny_moe $name matches one rank with bf16 storage: $(cat "$work/cmp-$name")"
    else
        bad "LoRA on tiny_moe $name: $(cat "$work/cmp-$name")"; paste "$work/steps-ref-s16" "$work/steps-$name" | sed 's/^/    /'
    fi
done
lora_memory "LoRA on tiny_moe, bf16 storage," "ref-s16 1" "ep2-s16 2" "tp2-ep2-s16 4 AM_TP=2"

# resume: ep 2 stopped after step 2 (its checkpoint) and restored gives the uninterrupted run's
# steps 3 and 4 to the last bit
recipe cut 2 && sed -i -e 's/max_steps: .*/max_steps: 2/' -e 's|checkpoint_dir: .*|&\n  restore_from: latest|' "$work/cut.yaml" &&
    train cut 2 "$work/cut.yaml" && sed -i 's/max_steps: .*/max_steps: 4/' "$work/cut.yaml" && rm -rf "$work/logs-cut" && train cut 2 "$work/cut.yaml" &&
    steps_of "$work/logs-cut" >"$work/steps-cut"
if [ -f "$work/steps-cut" ] && [ "$(tail -2 "$work/steps-ep2")" = "$(cat "$work/steps-cut")" ]; then
    ok "LoRA on tiny_moe ep2: restored after step 2, steps 3-4 are the uninterrupted run's to the last bit"
else
    bad "LoRA on tiny_moe ep2 resume: $(tail -2 "$work/steps-ep2" | tr '\n' ' ') against $(tr '\n' ' ' <"$work/steps-cut" 2>/dev/null)"
fi

# merge: am-ckpt merge writes each expert's weights as W + s B A (gate's and up's with the shared
# A) into the base the adapters were trained on, exported by a run of the same seed after one
# step at lr 0 (the warmup's first: the initial weights)
sed -e '/^peft:/,$d' -e 's/max_steps: .*/max_steps: 1/' "$work/ref.yaml" >"$work/base.yaml"
printf '\ncheckpoint:\n  enabled: true\n  checkpoint_dir: %s\n' "$work/ckpt-base" >>"$work/base.yaml"
if train base 1 "$work/base.yaml" && "$AM_BUILDDIR/am-ckpt" merge "$work/ckpt-base/step-1/hf" "$work/ckpt-ref/step-$steps/peft" \
    "$work/merged" >"$work/out-merge" 2>&1 && grep -q 'merged 64 adapted weights' "$work/out-merge"; then
    e=model.layers.2.block_sparse_moe.experts.3 pe=base_model.model.model.layers.2.block_sparse_moe.experts.3 fit=1
    for w in "w1 w1 w1 96 64" "w3 w3 w1 96 64" "w2 w2 w2 64 96"; do
        set -- $w
        merge_error 4 8 "$4" "$5" \
            <(values "$ad" "$pe.$2.lora_B.weight") <(values "$ad" "$pe.$3.lora_A.weight") \
            <(values "$work/ckpt-base/step-1/hf/model.safetensors" "$e.$1.weight") \
            <(values "$work/merged/model.safetensors" "$e.$1.weight") >"$work/merge-$1" || fit=0
    done
    if [ "$fit" = 1 ]; then
        ok "am-ckpt merge: each expert's w1, w3, w2 become W + s B A (within $(cat "$work/merge-w1"), $(cat "$work/merge-w3"), $(cat "$work/merge-w2"))"
    else
        bad "am-ckpt merge: an expert's merged weight is not W + s B A ($(cat "$work"/merge-* 2>/dev/null | tr '\n' ' '))"
    fi
else
    bad "am-ckpt merge of the experts' adapters: $(cat "$work/out-merge" 2>/dev/null)"
fi

# moe_rank_scaling (AutoModel's): the experts' adapters of rank dim // num_experts_per_tok = 8 // 2
# = 4 (the attention's 8) and scale alpha / 4: ep 2 matches one rank; the saved experts'
# adapters are [4, in] and [out, 4] with adapter_config.json's rank_pattern naming their rank, so
# that peft rebuilds them so; am-ckpt merge merges an expert's w1 at lora_alpha / 4 (32 / 4 = 8)
# and an attention projection at lora_alpha / 8; the memory is checked below with the layouts
for run in "rs 1" "rs-ep2 2"; do
    set -- $run
    recipe "$1" "$2" && sed -i 's/^  dim: 8$/  dim: 8\n  moe_rank_scaling: true/' "$work/$1.yaml"
    train "$1" "$2" "$work/$1.yaml" && steps_of "$work/logs-$1" >"$work/steps-$1" || { bad "$1 did not train"; sed 's/^/    /' "$work/out-$1"; }
done
if compare rs rs-ep2 &&
    [ "$(head -1 "$work/steps-rs" | cut -d' ' -f3)" != "$(head -1 "$work/steps-ref" | cut -d' ' -f3)" ]; then
    ok "moe_rank_scaling: ep 2 matches one rank ($(cat "$work/cmp-rs-ep2")); step 1's gradients differ from rank 8's"
else
    bad "moe_rank_scaling: $(cat "$work/cmp-rs-ep2" 2>/dev/null)"; paste "$work/steps-rs" "$work/steps-rs-ep2" | sed 's/^/    /'
fi
rad="$work/ckpt-rs/step-$steps/peft/adapter_model.safetensors" rcfg="$work/ckpt-rs/step-$steps/peft/adapter_config.json"
e=base_model.model.model.layers.2.block_sparse_moe.experts.3
if [ -f "$rad" ] && tensors "$rad" >"$work/names-rs" &&
    grep -qx 'base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight 64 8' "$work/names-rs" &&
    grep -qx "$e.w1.lora_A.weight 4 64" "$work/names-rs" && grep -qx "$e.w3.lora_A.weight 4 64" "$work/names-rs" &&
    grep -qx "$e.w1.lora_B.weight 96 4" "$work/names-rs" && grep -qx "$e.w3.lora_B.weight 96 4" "$work/names-rs" &&
    grep -qx "$e.w2.lora_A.weight 4 96" "$work/names-rs" && grep -qx "$e.w2.lora_B.weight 64 4" "$work/names-rs" &&
    [ "$(wc -l <"$work/names-rs")" = "$(wc -l <"$work/names-ref")" ] &&
    tr -d ' \n' <"$rcfg" | grep -qF '"r":8,' && tr -d ' \n' <"$rcfg" | grep -qF '"lora_alpha":32,' &&
    tr -d ' \n' <"$rcfg" | grep -qF '"rank_pattern":{"experts\\.[0-9]+\\.(w1|w3|w2)":4}' &&
    f="$work/ckpt-rs-ep2/step-$steps/peft/adapter_model.safetensors" && [ "$(tensors "$f")" = "$(cat "$work/names-rs")" ] &&
    cmp -s "$rcfg" "$work/ckpt-rs-ep2/step-$steps/peft/adapter_config.json"; then
    ok "moe_rank_scaling: the experts' adapters saved at rank 4 (the attention's at 8), adapter_config.json's r 8 and rank_pattern {experts\\.[0-9]+\\.(w1|w3|w2): 4}; ep 2 saves the same"
else
    bad "moe_rank_scaling's saved adapters: $(grep "$e.w1" "$work/names-rs" 2>&1 | tr '\n' ' '); $(tr -d ' \n' <"$rcfg" 2>&1)"
fi
if "$AM_BUILDDIR/am-ckpt" merge "$work/ckpt-base/step-1/hf" "$work/ckpt-rs/step-$steps/peft" "$work/merged-rs" \
    >"$work/out-merge-rs" 2>&1 && grep -q 'merged 64 adapted weights' "$work/out-merge-rs"; then
    fit=1
    for w in "model.layers.2.block_sparse_moe.experts.3.w1 8 4 96 64" "model.layers.1.self_attn.q_proj 4 8 64 64"; do
        set -- $w
        merge_error "$2" "$3" "$4" "$5" \
            <(values "$rad" "base_model.model.$1.lora_B.weight") <(values "$rad" "base_model.model.$1.lora_A.weight") \
            <(values "$work/ckpt-base/step-1/hf/model.safetensors" "$1.weight") \
            <(values "$work/merged-rs/model.safetensors" "$1.weight") >>"$work/merge-rs" || fit=0
    done
    if [ "$fit" = 1 ]; then
        ok "moe_rank_scaling: am-ckpt merge makes an expert's w1 W + (32 / 4) B A and q_proj W + (32 / 8) B A (within $(tr '\n' ' ' <"$work/merge-rs"))"
    else
        bad "moe_rank_scaling: am-ckpt merge: $(tr '\n' ' ' <"$work/merge-rs")"
    fi
else
    bad "moe_rank_scaling: am-ckpt merge: $(cat "$work/out-merge-rs" 2>/dev/null)"
fi

# memory: what LoRA changes of every rank's allocation (the adapters, their gradients, moments and
# scratch added; the frozen base's gradients and moments gone) equals what it changes of am-plan's
# estimate for its pipeline rank, to the byte:
# each layout run again without the peft section (one step) and both compared with am-plan's.
# (Compared as differences: the MoE model's own allocation was a few hundred bytes off
# am-plan's estimate, with or without LoRA, until am-plan counted each MoE layer's tokens per
# expert as the 64-byte buffer am-train carves; test-parity.sh checks the totals themselves.)
for run in "ref 1" "ep2 2" "tp2-ep2 4 AM_TP=2" "pp2 2 AM_PP=2" "rs 1" "rs-ep2 2"; do
    set -- $run
    name=$1 n=$2
    shift 2
    sets=()
    for v in "$@"; do
        case $v in AM_TP=*) sets+=(--set "distributed.tp_size=${v#*=}") ;; AM_PP=*) sets+=(--set "distributed.pp_size=${v#*=}") ;; esac
    done
    sed -e '/^peft:/,$d' -e 's/max_steps: .*/max_steps: 1/' "$work/$name.yaml" >"$work/$name-base.yaml"
    if ! train "$name-base" "$n" "$work/$name-base.yaml" "$@"; then
        bad "$name without LoRA did not train"; sed 's/^/    /' "$work/out-$name-base"; continue
    fi
    wl=($(plan_of "$work/$name.yaml" "$n" "${sets[@]}")) wb=($(plan_of "$work/$name-base.yaml" "$n" "${sets[@]}"))
    equal=0 detail=
    for r in $(seq 0 $((n - 1))); do
        pp=$(grep -h '"coords":{"pp":' "$work/logs-$name"/*/rank-"$r".jsonl | sed -E 's/.*"coords":\{"pp":([0-9]+).*/\1/')
        got=$(($(total_of "$work/logs-$name" "$r") - $(total_of "$work/logs-$name-base" "$r")))
        want=$(awk -v a="${wl[$pp]:-0}" -v b="${wb[$pp]:-0}" 'BEGIN { printf "%d", a - b }')
        if [ "$got" = "$want" ]; then
            equal=$((equal + 1))
        else
            detail="$detail rank $r (pp $pp): LoRA changes the allocation by $got bytes, am-plan by $want;"
        fi
    done
    if [ "$equal" = "$n" ]; then
        ok "LoRA on tiny_moe $name: LoRA changes every rank's allocation by what it changes am-plan's estimate, to the byte"
    else
        bad "LoRA on tiny_moe $name: allocation off am-plan's estimate:$detail"
    fi
done

echo "$passes passed, $fails failed"
[ "$fails" = 0 ]
