#!/bin/bash
# Layout parity: every layout of the same recipe trains the same model on the same samples,
# so its loss trajectory (and gradient norms) must equal one rank's to fp32 rounding, and
# so must the checkpoint it saves at the end.
#   data parallel: N ranks with gradient accumulation A/N against 1 rank with A: only the
#     order in which per-sample gradients are summed differs;
#   tensor parallel (tp 2, tp 4, where the 2 kv heads are shared by pairs of ranks), with
#     and without sequence parallelism: matrix products are split and summed across ranks;
#   pipeline parallel (pp 2 and 4; gpipe, 1f1b, interleaved1f1b with 2 virtual stages per
#     rank): micro-batches of 1 sequence, gradients summed in another order; a tied embedding
#     lives on the first and the last stage and its two gradients are summed; interleaved1f1b
#     also with one micro-batch of 4 sequences for 2 ranks (fewer micro-batches than ranks:
#     one round of all of them, as torch's ScheduleInterleaved1F1B), and 6 layers in 4 stages
#     of 2, 2, 1 and 1 (AutoModel's uneven split) at pp 2 and tp 2 x pp 2 with checkpointing;
#   activation checkpointing recomputes each layer in backward: bit-identical in principle;
#   the other architectures at tp 2 x pp 2 (with and without sequence parallelism) against
#   their own one rank: Qwen3 (per-head q/k norms, whose weights every tp rank holds and whose
#   gradients are summed over tp; head_dim 32, so heads * head_dim is twice hidden_size) and
#   Mistral (a sliding window of 24 on sequences of 64); Qwen2 (q, k, v biases split over tp with
#   their rows; at tp 4 each of the 2 kv heads' biases is held by 2 ranks and its gradient summed)
#   at tp 2 x pp 2 (and with sequence parallelism and activation checkpointing), tp 4, dp 2
#   (fsdp2: the biases in their layer's flat shards) and tp 2 x pp 2 x dp 2 interleaved;
#   Gemma 2 (scaled embedding, post norms of
#   the reduced row-parallel outputs, GeGLU, attention scaled by 24 ** -0.5 and capped at 1.0,
#   final logits capped at 5.0, a window of 24 on the even layers; also fsdp2 dp 2 with
#   activation checkpointing and tp 2 x pp 2 interleaved) and Gemma 3 (q/k norms (1 + w), head_dim
#   32, two rope tables, layer_types; also fsdp2 at tp 2 x dp 2 with activation checkpointing);
#   a mixture of experts (Mixtral's layers: 4 experts, top 2; experts replicated over tp) at
#   dp 2 and dp 4 with activation checkpointing, with ddp and with fsdp2 (each layer's experts
#   a group of their own, gathered with the layer), fsdp2 at tp 2 x dp 2 and with
#   reshard_after_forward false, megatron_fsdp's ZeRO 2 at dp 2 and ZeRO 1 at tp 2 x dp 2, pp 2
#   and tp 2 x pp 2 interleaved, Qwen3-MoE at pp 2 x dp 2 (fsdp2)
#   against its own one rank; with the load-balancing loss on, activation checkpointing and
#   tp 2 against one rank (the loss is a product of means over each micro-batch's tokens, as
#   transformers computes it per forward, so it depends on which sequences share a micro-batch:
#   data-parallel ranks' hold other sequences than one rank's), and over pipeline stages (the
#   statistics passed along with the hidden states, the whole model's counts back with the
#   gradients) at pp 2 with micro-batches of 2 sequences (1f1b, and gpipe with activation
#   checkpointing), tp 2 x pp 2, cp 2 x pp 2 and cp 2 x pp 2 x ep 2 against one rank with
#   local batches of 2, and interleaved1f1b with one micro-batch of 4 against one rank; its
#   sequence-parallel layouts are refused with the reason (tests/recipe/test-refusals.sh).
#   Expert parallelism (fsdp2; each ep rank holds E / ep experts, tokens dispatched with
#   all-to-all-v; the experts' groups sharded over the expert-data-parallel group, dp / ep
#   ranks): ep 2, ep 4, ep 2 x dp 4 (also reshard false, and Qwen3-MoE), ep 4 x dp 8, tp 2 and
#   pp 2 with ep 2 and ep 4, tp 2 x dp 4 x ep 2, pp 2 x dp 4 x ep 2 with ac, tp 2 x pp 2 x ep 2;
#   with HSDP (dp_replicate 2) at ep 2 and ep 4 on 4 ranks and (dp_replicate 4, 8 ranks) at
#   ep 2: the experts sharded over the ranks holding the same ones across the replica groups
#   (AutoModel's ep_shard; 4 of them over shard groups of 2: their groups padded to both),
#   not all-reduced over the replicas.
#   Qwen3-MoE (q/k norms, renormalised top 2, layer 1 a dense MLP split over tp) at tp 2 x pp 2.
#   GLM-4.5 (glm4_moe: partial rotary, q, k, v biases, q/k norms, layer 0 dense, then 8 experts in 4
#   groups with the sigmoid router and 2 shared experts, split over tp as an MLP) at ep 2, tp 2,
#   pp 2, fsdp2 dp 2 and dp 4, tp 2 x ep 2 and cp 2 (sequences of 256: partial rotary on each
#   rank's chunks) against its own one rank. DeepSeek-V3 (deepseek_v3: multi-head latent
#   attention with q_lora_rank 24, kv_lora_rank 16, v narrower than q and k, rope_interleave; q_b_proj and
#   kv_b_proj split over tp by heads, q_a_proj, kv_a_proj_with_mqa and their norms whole on every tp
#   rank with their gradients summed; glm4_moe's MoE) at ep 2, tp 2, pp 2, fsdp2 dp 2 and dp 4, tp 2 x ep 2 and
#   cp 2 (sequences of 256) likewise; with AutoModel's selection-bias update (moe_overrides'
#   gate_bias_update_factor 0.01: each step's loads summed over dp x cp, every bias updated alike,
#   the biases in the final checkpoint within the weights' tolerance, far below one update) at
#   ep 2, pp 2, fsdp2 dp 2, tp 2 and cp 2 against its own one rank, and ep 2 in bf16 (below).
#   gpt-oss (gpt_oss: attention sinks split over tp with their heads, q, k, v and o biases, o's added by tp rank 0, layer_types alternating a window of 24 and
#   full attention, yarn rope, the biased router, 4 experts with biases and the clamped SwiGLU) at
#   ep 2, tp 2, pp 2, fsdp2 dp 2 and dp 4, tp 2 x ep 2 and cp 2 (sequences of 256: the sinks applied to the
#   ring's merged out and lse) likewise; with its load-balancing loss (over the biased router's
#   softmax) at tp 2, and at pp 2 with micro-batches of 2 against one rank with local batches of 2.
#   AutoModel's own load-balancing loss (moe_overrides' aux_loss_coeff 0.1: per MoE layer and
#   micro-batch, its gradient injected over dp x micro-batches, never added to the loss; moe.h) on
#   gpt_oss and deepseek_v3 at ep 2, fsdp2 dp 2 and tp 2 x ep 2 (local batches of 1 against one rank's
#   of 1: the loss is a mean over each micro-batch's tokens, and dp ranks hold every dp-th
#   sequence), tp 2, cp 2 (its loads and score sums summed over the cp ranks), pp 2 with
#   micro-batches of 2 (deepseek_v3's with activation checkpointing) against one rank with local
#   batches of 2, one rank with activation checkpointing (gpt_oss), and ep 2 in bf16 (deepseek_v3,
#   below); glm4_moe and Qwen3-MoE (the softmax before the top-k) at ep 2, Qwen3-MoE at tp 2 with
#   activation checkpointing; against their own one rank.
#   Both on packed sequences (packed_sequence_size 256; the pads that end each pack out of the
#   loads, score sums and token counts, AutoModel's token_mask): deepseek_v3's update at ep 2, cp 2
#   and pp 2, its loss at ep 2 (local batches of 1), cp 2 and tp 2, gpt_oss's loss at ep 2 (local
#   batches of 1) and pp 2 with micro-batches of 2 (against local batches of 2), against their own
#   one rank packing the same documents.
#   context parallelism on sequences of 256 (each sequence in 2 x cp chunks, rank r holding
#   chunks r and 2 cp - 1 - r: at cp 4 chunks of 32 tokens, every rank's queries against 4
#   blocks of keys passed around the ring): cp 2 and cp 4 alone, with tp 2 (and sequence
#   parallelism), pp 2, dp 2 (fsdp2 sharding over dp x cp), HSDP (dp_replicate 2: sharding over
#   dp_shard x cp, 1 and 2, the shards all-reduced over the replicas), activation checkpointing,
#   tp 2 x pp 2 and megatron_fsdp, against one rank on the same sequences; Mistral's sliding
#   window (24, across chunks of 16) and Qwen3 at cp 2 on sequences of 64, and the tied
#   embedding at cp 2 x pp 2; a mixture of experts (Mixtral's layers; each token routed alone)
#   at cp 2, cp 2 x ep 2 (the experts split over the cp ranks), cp 2 x dp 2 and cp 2 x tp 2,
#   and with the load-balancing loss (its statistics of the whole sequences, summed over the cp
#   ranks) at cp 2, cp 4, cp 2 x ep 2, cp 2 x tp 2 with activation checkpointing (and cp 2 in
#   bf16, below); each rank's activation memory falls as 1/cp. Gemma over the
#   ring (its scale and soft cap on the block kernels' scores, Gemma 3's second rotary table at
#   the rows' positions): Gemma 2 at cp 2 on sequences of 64 (its window of 24 on the even
#   layers across chunks of 16) and at cp 4 on sequences of 256 (chunks of 32: blocks wholly
#   outside the window are skipped), Gemma 3 at cp 2 and cp 2 x tp 2 with activation
#   checkpointing.
#   packed sequences (packed_sequence_size 256: the corpus's paragraphs packed whole, thd and
#   neat; each document attending to itself only, with its own rotary positions, across the
#   ring's blocks too): cp 2 and cp 4, cp 2 x tp 2 (and with sequence parallelism and
#   activation checkpointing), cp 2 x dp 2, cp 2 x pp 2, and without cp dp 2 and tp 2 x pp 2,
#   against one rank packing the same documents; the loss the mean over the packs' targets;
#   Gemma 2 packed at dp 2 and cp 2, Gemma 3 packed at cp 2 (the windows within documents).
# The tiny recipe's strategy is fsdp2, so every layout with dp > 1 above shards weights,
# gradients and AdamW state over its dp ranks (train/fsdp.h: flat shards per group, weights
# all-gathered before use, gradients reduce-scattered from per-group buffers after each
# backward, micro-batch by micro-batch); dp 8 (local batches of 2), reshard_after_forward false
# (every group kept gathered from its forward to its backward)
# and a bf16 reduction are added, HSDP (dp_replicate_size 2: sharded within each replica
# group, the shards' gradients all-reduced over the replicas), and ddp (full replicas,
# all-reduce) runs a few layouts too; megatron_fsdp with each zero_dp_strategy (1: AdamW state
# sharded, 2: and the reduced gradients, 3: and the weights, as fsdp2). AM_GRAD_OVERLAP=0 (the
# reductions blocking, where the overlapped ones start) may be given to a layout as a VAR.
# Tolerances: 1e-5 absolute on losses near 5 and 1e-5 relative on gradient norms over 8
# steps; every weight of the final checkpoint within 5e-5, as test_golden's final weights
# (AdamW divides each gradient by its own running magnitude, so an element whose gradient
# nearly cancels moves by up to the learning rate, 3e-3, on rounding alone). Measured over
# the 101 layouts on this corpus: losses 4.2e-7, gradient norms 7.9e-8, weights 6.1e-7 at
# most (a corpus of am's own sources gave 8.3e-6 in an embedding row); each layout's worst
# case is printed. AM_PARITY_ONLY="NAME RANKS CHANGES REF
# [VAR=VALUE...]" runs one layout (several separated by ';'), after only the references those
# layouts name (and ref, ref-bf16; all of them with AM_PARITY_BF16).
set -u
: "${AM_SRCDIR:=$(cd "$(dirname "$0")/../.." && pwd)}"
: "${AM_BUILDDIR:=$PWD}"
export AM_MODELS_DIR=${AM_MODELS_DIR:-$AM_SRCDIR/runtime/recipe/models}
unset AM_RECIPE AM_TP AM_PP AM_EP AM_CP AM_LOG_DIR AM_DRY_RUN PMIX_NAMESPACE PMIX_RANK 2>/dev/null || true
work=$(mktemp -d)
trap '[ -n "${AM_PARITY_KEEP:-}" ] || rm -rf "$work"' EXIT
fails=0 passes=0
steps=8 loss_tol=1e-5 norm_tol=1e-5 weight_tol=5e-5

# a corpus that does not change with the sources (Debian's license texts, as README's demo)
"$AM_BUILDDIR/am-data" build --bytes --out "$work/corpus" /usr/share/common-licenses/* >/dev/null || exit 1
# the tiny recipe, made short: 8 steps of a global batch of 16 sequences of 64 tokens
sed -e "s|paths: .*|paths: $work/corpus|" -e "s/max_steps: .*/max_steps: $steps/" \
    -e 's/enabled: false/enabled: true/' "$AM_SRCDIR/sbatch-templates/recipes/tiny.yaml" >"$work/base.yaml"

recipe() { # NAME MODS: base.yaml with comma-separated changes, its checkpoints under ckpt-NAME
    local name=$1 mods=$2 args=(-e "s|checkpoint_dir: .*|checkpoint_dir: $work/ckpt-$name|")
    local m
    for m in ${mods//,/ }; do
        case $m in
        sp) args+=(-e 's/sequence_parallel: false/sequence_parallel: true/') ;;
        ac) args+=(-e 's/activation_checkpointing: false/activation_checkpointing: true/') ;;
        gpipe) args+=(-e 's/pp_schedule: .*/pp_schedule: gpipe/') ;;
        il) args+=(-e 's/pp_schedule: .*/pp_schedule: interleaved1f1b/') ;;
        mb4) args+=(-e 's/pp_microbatch_size: .*/pp_microbatch_size: 4/') ;;
        mb2) args+=(-e 's/pp_microbatch_size: .*/pp_microbatch_size: 2/') ;;
        tied) args+=(-e 's/tie_word_embeddings: false/tie_word_embeddings: true/') ;;
        bf16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16/') ;;
        s16) args+=(-e 's/torch_dtype: float32/torch_dtype: bfloat16/') ;; # bf16 masters and moments
        rbf16) args+=(-e 's/param_dtype: float32.*/param_dtype: bfloat16\n    reduce_dtype: bfloat16/') ;;
        rf32) args+=(-e 's/param_dtype: bfloat16.*/param_dtype: bfloat16\n    reduce_dtype: float32/') ;; # after bf16
        ddp) args+=(-e 's/strategy: fsdp2/strategy: ddp/') ;;
        hsdp) args+=(-e 's/  dp_size: none.*/  dp_size: none\n  dp_replicate_size: 2/') ;;
        hsdp4) args+=(-e 's/  dp_size: none.*/  dp_size: none\n  dp_replicate_size: 4/') ;;
        mz[123]) args+=(-e "s/strategy: fsdp2/strategy: megatron_fsdp\n  zero_dp_strategy: ${m#mz}/") ;;
        keep) args+=(-e 's/strategy: fsdp2/strategy: fsdp2\n  reshard_after_forward: false/') ;;
        lb2) args+=(-e 's/local_batch_size: .*/local_batch_size: 2/') ;;
        lb1) args+=(-e 's/local_batch_size: .*/local_batch_size: 1/') ;;
        qwen3) args+=(-e 's/model_type: llama/model_type: qwen3\n  head_dim: 32/') ;;
        qwen2) args+=(-e 's/model_type: llama/model_type: qwen2/') ;;
        mistral) args+=(-e 's/model_type: llama/model_type: mistral\n  sliding_window: 24/') ;;
        gemma2) args+=(-e 's/model_type: llama/model_type: gemma2\n  head_dim: 16\n  query_pre_attn_scalar: 24\n  attn_logit_softcapping: 1.0\n  final_logit_softcapping: 5.0\n  sliding_window: 24/') ;;
        gemma3) args+=(-e 's/model_type: llama/model_type: gemma3_text\n  head_dim: 32\n  query_pre_attn_scalar: 32\n  sliding_window: 24\n  layer_types: [sliding_attention, full_attention, sliding_attention, full_attention]\n  rope_local_base_freq: 10000.0\n  rope_scaling: {rope_type: linear, factor: 2.0}/') ;;
        moe) args+=(-e 's/model_type: llama/model_type: mixtral\n  num_local_experts: 4\n  num_experts_per_tok: 2/') ;;
        qmoe) args+=(-e 's/model_type: llama/model_type: qwen3_moe\n  num_experts: 4\n  num_experts_per_tok: 2\n  moe_intermediate_size: 64\n  norm_topk_prob: true\n  mlp_only_layers: [1]/') ;;
        glm) args+=(-e 's/model_type: llama/model_type: glm4_moe\n  partial_rotary_factor: 0.5\n  attention_bias: true\n  use_qk_norm: true\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n  routed_scaling_factor: 1.5\n  first_k_dense_replace: 1\n  norm_topk_prob: true/') ;;
        oss) args+=(-e 's/model_type: llama/model_type: gpt_oss\n  num_local_experts: 4\n  num_experts_per_tok: 2\n  head_dim: 16\n  sliding_window: 24/') ;;
        ossaux) args+=(-e 's/model_type: gpt_oss/model_type: gpt_oss\n  output_router_logits: true\n  router_aux_loss_coef: 0.02/') ;;
        dsv3) args+=(-e 's/num_key_value_heads: 2/num_key_value_heads: 4/' -e 's/model_type: llama/model_type: deepseek_v3\n  q_lora_rank: 24\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n  v_head_dim: 12\n  rope_interleave: true\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n  routed_scaling_factor: 1.5\n  first_k_dense_replace: 1\n  norm_topk_prob: true/') ;;
        ossam) args+=(-e 's/model_type: gpt_oss/model_type: gpt_oss\n  moe_overrides:\n    aux_loss_coeff: 0.1/') ;;
        amaux) args+=(-e 's/  norm_topk_prob: true/  norm_topk_prob: true\n  moe_overrides:\n    aux_loss_coeff: 0.1/') ;; # dsv3, glm, qmoe
        bupd) args+=(-e 's/  norm_topk_prob: true/  norm_topk_prob: true\n  moe_overrides:\n    gate_bias_update_factor: 0.01/') ;;
        long) args+=(-e 's/seq_length: .*/seq_length: 256/') ;;
        l6) args+=(-e 's/num_hidden_layers: 4/num_hidden_layers: 6/') ;;
        packed) args+=(-e 's/^dataset:/packed_sequence:\n  packed_sequence_size: 256\ndataset:/') ;;
        neat) args+=(-e 's/^  packed_sequence_size: 256/  packed_sequence_size: 256\n  packing_strategy: neat/') ;;
        aux) args+=(-e 's/model_type: mixtral/model_type: mixtral\n  output_router_logits: true\n  router_aux_loss_coef: 0.02/') ;;
        - | 1f1b) ;;
        *) echo "test-parity.sh: unknown change $m" >&2; exit 2 ;;
        esac
    done
    sed "${args[@]}" "$work/base.yaml" >"$work/$name.yaml"
}

losses() { # LOGDIR: "loss grad_norm" per step of rank 0
    grep -h '"type":"step"' "$1"/*/rank-0.jsonl | sed -E 's/.*"loss":([^,]*),.*"grad_norm":([^,]*),.*/\1 \2/'
}

memory() { # LOGDIR RANK KEY: the value of KEY in the rank's memory record
    grep -h '"type":"memory"' "$1"/*/rank-"$2".jsonl | sed -E "s/.*\"$3\":([0-9a-z]*).*/\1/"
}
check_memory() { # WHAT CONDITION
    if [ "$2" = 1 ]; then echo "ok: $1"; passes=$((passes + 1)); else echo "FAIL: $1"; fails=$((fails + 1)); fi
}

# compare NAME REF LOSS_TOL NORM_TOL WEIGHT_TOL: layout NAME's losses and grad norms against
# REF's (absolute; relative), and its final checkpoint (absolute); counts and prints the verdict
compare() {
    local name=$1 ref=$2 lt=$3 nt=$4 wt=$5
    losses "$work/logs-$name" >"$work/got-$name"
    if ! paste "$work/$ref" "$work/got-$name" | awk -v steps="$steps" -v lt="$lt" -v nt="$nt" '
        { d = $1 - $3; if (d < 0) d = -d; if (d > worst) worst = d
          g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > gworst) gworst = g; n++ }
        END { printf "%d steps, largest loss difference %.2g (tolerance %.2g), grad norm %.2g relative (%.2g)", n,
                     worst, lt, gworst, nt
              exit !(n == steps && worst <= lt && gworst <= nt) }' >"$work/cmp-$name"; then
        echo "FAIL: $name differs from $ref: $(cat "$work/cmp-$name")"
        paste "$work/$ref" "$work/got-$name" | sed 's/^/    /'
        fails=$((fails + 1)); return
    fi
    if ! "$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-$ref/step-$steps/hf" "$work/ckpt-$name/step-$steps/hf" "$wt" \
        >"$work/wdiff-$name" 2>&1; then
        echo "FAIL: $name's checkpoint differs from $ref's: $(cat "$work/wdiff-$name") (tolerance $wt)"
        fails=$((fails + 1)); return
    fi
    echo "ok: $name matches $ref: $(cat "$work/cmp-$name"); checkpoint: $(cat "$work/wdiff-$name") (tolerance $wt)"
    passes=$((passes + 1))
}

run() { # NAME N MODS [VAR=VALUE...]: N ranks, with the plugin's AM_TP-style overrides
    local name=$1 n=$2 mods=$3
    shift 3
    recipe "$name" "$mods"
    (cd "$work" && env "$@" AM_LOG_DIR="$work/logs-$name" "$AM_BUILDDIR/am-launch" --nproc "$n" "$work/$name.yaml" \
        >"$work/out-$name" 2>&1)
}

for ref in "ref -" "ref-long long" "ref-packed packed" "ref-pneat packed,neat" "ref-tied tied" "ref-qwen3 qwen3" "ref-qwen2 qwen2" "ref-mistral mistral" "ref-bf16 bf16" "ref-long-bf16 long,bf16" "ref-packed-bf16 packed,bf16" "ref-moe moe" "ref-moe-aux moe,aux" "ref-moe-aux-bf16 moe,aux,bf16" "ref-moe-aux-lb2 moe,aux,lb2" "ref-qmoe qmoe" \
    "ref-gemma2 gemma2" "ref-gemma3 gemma3" "ref-gemma2-long gemma2,long" "ref-gemma2-packed gemma2,packed" \
    "ref-gemma3-packed gemma3,packed" "ref-gemma2-bf16 gemma2,bf16" "ref-gemma2-packed-bf16 gemma2,packed,bf16" "ref-glm glm" "ref-glm-long glm,long" "ref-dsv3 dsv3" "ref-dsv3-long dsv3,long" "ref-l6 l6" "ref-oss oss" "ref-oss-long oss,long" "ref-oss-aux oss,ossaux" \
    "ref-oss-aux-lb2 oss,ossaux,lb2" "ref-dsv3-bupd dsv3,bupd" "ref-dsv3-long-bupd dsv3,long,bupd" "ref-dsv3-bupd-bf16 dsv3,bupd,bf16" \
    "ref-oss-am oss,ossam" "ref-oss-am-lb2 oss,ossam,lb2" "ref-oss-am-lb1 oss,ossam,lb1" \
    "ref-oss-long-am oss,long,ossam" "ref-dsv3-am dsv3,amaux" "ref-dsv3-am-lb2 dsv3,amaux,lb2" "ref-dsv3-am-lb1 dsv3,amaux,lb1" \
    "ref-dsv3-long-am dsv3,long,amaux" "ref-dsv3-am-lb1-bf16 dsv3,amaux,lb1,bf16" "ref-dsv3-long-bf16 dsv3,long,bf16" \
    "ref-glm-am-lb1 glm,amaux,lb1" "ref-qmoe-am-lb1 qmoe,amaux,lb1" "ref-qmoe-am qmoe,amaux" \
    "ref-dsv3-packed-bupd dsv3,packed,bupd" "ref-dsv3-packed-am dsv3,packed,amaux" \
    "ref-dsv3-packed-am-lb1 dsv3,packed,amaux,lb1" "ref-oss-packed-am-lb1 oss,ossam,packed,lb1" \
    "ref-oss-packed-am-lb2 oss,ossam,packed,lb2" \
    "ref-s16 bf16,s16" "ref-long-s16 long,bf16,s16" "ref-dsv3-s16 dsv3,bf16,s16" \
    "ref-glm-bf16 glm,bf16" "ref-glm-long-bf16 glm,long,bf16" "ref-glm-s16 glm,bf16,s16" "ref-oss-bf16 oss,bf16" \
    "ref-oss-long-bf16 oss,long,bf16" "ref-oss-s16 oss,bf16,s16"; do
    set -- $ref
    # with AM_PARITY_ONLY (and no AM_PARITY_BF16), the references its layouts name, and ref and ref-bf16 (the bf16 check)
    [ -n "${AM_PARITY_ONLY:-}" ] && [ -z "${AM_PARITY_BF16:-}" ] && [ "$1" != ref ] && [ "$1" != ref-bf16 ] &&
        [[ " ${AM_PARITY_ONLY//;/ } " != *" $1 "* ]] && continue
    run "$1" 1 "$2" || { echo "FAIL: $1 (1 rank) did not train"; cat "$work/out-$1"; exit 1; }
    losses "$work/logs-$1" >"$work/$1"
    [ "$(wc -l <"$work/$1")" = "$steps" ] || { echo "FAIL: $1 logged $(wc -l <"$work/$1") steps, want $steps"; exit 1; }
done

# Every valid layout of the tiny recipe on 2 to 8 ranks: tp in 1,2,4; pp in 1,2,4; dp the
# rest (1, 2 or 4: the global batch of 16 is 4 local batches of 4); each schedule (4 layers
# make 2 virtual stages per rank for interleaved1f1b with pp 2, too few with pp 4); sequence
# parallelism on and off (tp > 1); activation checkpointing on and off. Then the tied
# embedding split over the first and the last stage.
# NAME RANKS CHANGES REFERENCE [OVERRIDES]
layouts=()
for tp in 1 2 4; do
    for pp in 1 2 4; do
        for dp in 1 2 4; do
            n=$((tp * pp * dp))
            [ "$n" -le 8 ] && [ "$n" -gt 1 ] || continue
            scheds=1f1b
            [ "$pp" = 2 ] && scheds="1f1b gpipe il"
            [ "$pp" = 4 ] && scheds="1f1b gpipe"
            sps=0
            [ "$tp" -gt 1 ] && sps="0 1"
            for sched in $scheds; do
                for sp in $sps; do
                    for ac in 0 1; do
                        mods=$sched name=tp$tp-pp$pp-dp$dp-$sched
                        [ "$sp" = 1 ] && mods=$mods,sp name=$name-sp
                        [ "$ac" = 1 ] && mods=$mods,ac name=$name-ac
                        layouts+=("$name $n $mods ref AM_TP=$tp AM_PP=$pp")
                    done
                done
            done
        done
    done
done
trained=() # NAME RANKS [OVERRIDES] of each layout that trained (for the memory checks)
exact=()   # layouts whose every rank must allocate exactly am-plan's estimate
layouts+=("ac 1 ac ref" "pp2-tied 2 tied ref-tied AM_PP=2" "pp4-tied-gpipe 4 tied,gpipe ref-tied AM_PP=4"
    "tp2-pp2-tied-il 4 tied,il ref-tied AM_TP=2 AM_PP=2"
    "pp2-il-m1 2 il,mb4 ref AM_PP=2" "dp2-pp2-il-m1-ac 4 il,mb4,ac ref AM_PP=2"
    "pp2-il-l6 2 l6,il ref-l6 AM_PP=2" "tp2-pp2-il-l6-ac 4 l6,il,ac ref-l6 AM_TP=2 AM_PP=2"
    "tp2-pp2-tied-il-m1 4 tied,il,mb4 ref-tied AM_TP=2 AM_PP=2"
    "tp2-pp2-qwen3 4 qwen3 ref-qwen3 AM_TP=2 AM_PP=2" "tp2-pp2-qwen3-sp 4 qwen3,sp ref-qwen3 AM_TP=2 AM_PP=2"
    "tp2-pp2-qwen2 4 qwen2 ref-qwen2 AM_TP=2 AM_PP=2" "tp2-pp2-qwen2-sp-ac 4 qwen2,sp,ac ref-qwen2 AM_TP=2 AM_PP=2"
    "tp4-qwen2 4 qwen2 ref-qwen2 AM_TP=4" "dp2-qwen2 2 qwen2 ref-qwen2" "tp2-pp2-dp2-qwen2-il 8 qwen2,il ref-qwen2 AM_TP=2 AM_PP=2"
    "tp2-pp2-mistral 4 mistral ref-mistral AM_TP=2 AM_PP=2" "tp2-pp2-mistral-sp 4 mistral,sp ref-mistral AM_TP=2 AM_PP=2"
    "tp2-pp2-gemma2 4 gemma2 ref-gemma2 AM_TP=2 AM_PP=2" "tp2-pp2-gemma2-sp 4 gemma2,sp ref-gemma2 AM_TP=2 AM_PP=2"
    "fsdp2-dp2-gemma2-ac 2 gemma2,ac ref-gemma2" "tp2-pp2-gemma2-il 4 gemma2,il ref-gemma2 AM_TP=2 AM_PP=2"
    "tp2-pp2-gemma3 4 gemma3 ref-gemma3 AM_TP=2 AM_PP=2" "tp2-pp2-gemma3-sp 4 gemma3,sp ref-gemma3 AM_TP=2 AM_PP=2"
    "fsdp2-tp2-dp2-gemma3-ac 4 gemma3,ac ref-gemma3 AM_TP=2"
    "dp2-moe 2 moe,ddp ref-moe" "dp4-moe-ac 4 moe,ddp,ac ref-moe" "ac-moe-aux 1 moe,aux,ac ref-moe-aux"
    "tp2-moe-aux 2 moe,aux ref-moe-aux AM_TP=2" "mfsdp-z2-dp2-moe 2 moe,mz2 ref-moe"
    "mfsdp-z1-tp2-dp2-moe 4 moe,mz1 ref-moe AM_TP=2" "fsdp2-dp2-moe 2 moe ref-moe"
    "fsdp2-dp4-moe-ac 4 moe,ac ref-moe" "fsdp2-tp2-dp2-moe 4 moe ref-moe AM_TP=2" "fsdp2-dp2-moe-keep 2 moe,keep ref-moe"
    "fsdp2-pp2-dp2-qmoe 4 qmoe ref-qmoe AM_PP=2"
    "pp2-moe 2 moe ref-moe AM_PP=2" "tp2-pp2-moe-il 4 moe,il ref-moe AM_TP=2 AM_PP=2"
    "tp2-pp2-qmoe 4 qmoe ref-qmoe AM_TP=2 AM_PP=2"
    "dp8 8 lb2 ref" "dp8-ac 8 lb2,ac ref" "dp2-keep 2 keep ref" "tp2-pp2-dp2-keep-ac 8 keep,ac ref AM_TP=2 AM_PP=2"
    "dp2-tied 2 tied ref-tied" "tp2-pp2-dp2-tied-ac 8 tied,ac ref-tied AM_TP=2 AM_PP=2"
    "ddp-dp2 2 ddp ref" "ddp-dp4-ac 4 ddp,ac ref" "ddp-dp8 8 ddp,lb2 ref"
    "hsdp-dp4 4 hsdp ref" "hsdp-dp8-ac 8 hsdp,lb2,ac ref" "hsdp-tp2-dp4-sp 8 hsdp,sp ref AM_TP=2"
    "hsdp-pp2-dp4 8 hsdp ref AM_PP=2" "hsdp-rep2 2 hsdp ref"
    "hsdp-dp4-block 4 hsdp ref AM_GRAD_OVERLAP=0" "tp1-pp2-dp2-gpipe-ac-block 4 gpipe,ac ref AM_PP=2 AM_GRAD_OVERLAP=0"
    "mfsdp-z1-dp2 2 mz1 ref" "mfsdp-z1-dp4-ac 4 mz1,ac ref" "mfsdp-z2-dp2 2 mz2 ref" "mfsdp-z2-tp2-dp2 4 mz2 ref AM_TP=2"
    "mfsdp-z3-dp4 4 mz3 ref" "mfsdp-z3-dp8-ac 8 mz3,lb2,ac ref" "mfsdp-z3-tp2-dp2 4 mz3 ref AM_TP=2"
    "ep2-moe 2 moe ref-moe AM_EP=2" "ep4-moe 4 moe ref-moe AM_EP=4" "ep2-dp4-moe 4 moe ref-moe AM_EP=2"
    "tp2-ep2-moe 4 moe ref-moe AM_TP=2 AM_EP=2" "pp2-ep2-moe 4 moe ref-moe AM_PP=2 AM_EP=2"
    "ep4-dp8-moe 8 moe,lb2 ref-moe AM_EP=4" "ep2-dp4-moe-keep 4 moe,keep ref-moe AM_EP=2"
    "tp2-dp4-ep2-moe 8 moe ref-moe AM_TP=2 AM_EP=2" "pp2-dp4-ep2-moe-ac 8 moe,ac ref-moe AM_PP=2 AM_EP=2"
    "tp2-ep4-moe 8 moe ref-moe AM_TP=2 AM_EP=4" "pp2-ep4-moe 8 moe ref-moe AM_PP=2 AM_EP=4"
    "tp2-pp2-ep2-moe 8 moe ref-moe AM_TP=2 AM_PP=2 AM_EP=2" "ep2-dp4-qmoe 4 qmoe ref-qmoe AM_EP=2"
    "ep2-hsdp-moe 4 moe,hsdp ref-moe AM_EP=2" "ep4-hsdp-moe 4 moe,hsdp ref-moe AM_EP=4"
    "ep2-hsdp4-moe 8 moe,hsdp4,lb2 ref-moe AM_EP=2"
    "ep2-glm 2 glm ref-glm AM_EP=2" "tp2-glm 2 glm ref-glm AM_TP=2" "pp2-glm 2 glm ref-glm AM_PP=2"
    "fsdp2-dp2-glm 2 glm ref-glm" "fsdp2-dp4-glm 4 glm ref-glm" "tp2-ep2-glm 4 glm ref-glm AM_TP=2 AM_EP=2"
    "cp2-glm 2 glm,long ref-glm-long AM_CP=2"
    "ep2-dsv3 2 dsv3 ref-dsv3 AM_EP=2" "tp2-dsv3 2 dsv3 ref-dsv3 AM_TP=2" "pp2-dsv3 2 dsv3 ref-dsv3 AM_PP=2"
    "fsdp2-dp2-dsv3 2 dsv3 ref-dsv3" "fsdp2-dp4-dsv3 4 dsv3 ref-dsv3" "tp2-ep2-dsv3 4 dsv3 ref-dsv3 AM_TP=2 AM_EP=2"
    "cp2-dsv3 2 dsv3,long ref-dsv3-long AM_CP=2"
    "ep2-oss 2 oss ref-oss AM_EP=2" "tp2-oss 2 oss ref-oss AM_TP=2" "pp2-oss 2 oss ref-oss AM_PP=2"
    "fsdp2-dp2-oss 2 oss ref-oss" "fsdp2-dp4-oss 4 oss ref-oss" "tp2-ep2-oss 4 oss ref-oss AM_TP=2 AM_EP=2"
    "cp2-oss 2 oss,long ref-oss-long AM_CP=2" "tp2-oss-aux 2 oss,ossaux ref-oss-aux AM_TP=2"
    "pp2-oss-aux 2 oss,ossaux,mb2 ref-oss-aux-lb2 AM_PP=2"
    "ep2-dsv3-bupd 2 dsv3,bupd ref-dsv3-bupd AM_EP=2" "pp2-dsv3-bupd 2 dsv3,bupd ref-dsv3-bupd AM_PP=2"
    "fsdp2-dp2-dsv3-bupd 2 dsv3,bupd ref-dsv3-bupd" "tp2-dsv3-bupd 2 dsv3,bupd ref-dsv3-bupd AM_TP=2"
    "cp2-dsv3-bupd 2 dsv3,long,bupd ref-dsv3-long-bupd AM_CP=2"
    "ep2-oss-am 2 oss,ossam,lb1 ref-oss-am-lb1 AM_EP=2" "tp2-oss-am 2 oss,ossam ref-oss-am AM_TP=2"
    "pp2-oss-am 2 oss,ossam,mb2 ref-oss-am-lb2 AM_PP=2" "fsdp2-dp2-oss-am 2 oss,ossam,lb1 ref-oss-am-lb1"
    "cp2-oss-am 2 oss,long,ossam ref-oss-long-am AM_CP=2" "ac-oss-am 1 oss,ossam,ac ref-oss-am"
    "ep2-dsv3-am 2 dsv3,amaux,lb1 ref-dsv3-am-lb1 AM_EP=2" "tp2-dsv3-am 2 dsv3,amaux ref-dsv3-am AM_TP=2"
    "pp2-dsv3-am-ac 2 dsv3,amaux,mb2,ac ref-dsv3-am-lb2 AM_PP=2" "fsdp2-dp2-dsv3-am 2 dsv3,amaux,lb1 ref-dsv3-am-lb1"
    "cp2-dsv3-am 2 dsv3,long,amaux ref-dsv3-long-am AM_CP=2"
    "tp2-ep2-dsv3-am 4 dsv3,amaux,lb1 ref-dsv3-am-lb1 AM_TP=2 AM_EP=2"
    "ep2-glm-am 2 glm,amaux,lb1 ref-glm-am-lb1 AM_EP=2" "ep2-qmoe-am 2 qmoe,amaux,lb1 ref-qmoe-am-lb1 AM_EP=2"
    "tp2-qmoe-am-ac 2 qmoe,amaux,ac ref-qmoe-am AM_TP=2"
    "ep2-dsv3-packed-bupd 2 dsv3,packed,bupd ref-dsv3-packed-bupd AM_EP=2"
    "cp2-dsv3-packed-bupd 2 dsv3,packed,bupd ref-dsv3-packed-bupd AM_CP=2"
    "pp2-dsv3-packed-bupd 2 dsv3,packed,bupd ref-dsv3-packed-bupd AM_PP=2"
    "ep2-dsv3-packed-am 2 dsv3,packed,amaux,lb1 ref-dsv3-packed-am-lb1 AM_EP=2"
    "cp2-dsv3-packed-am 2 dsv3,packed,amaux ref-dsv3-packed-am AM_CP=2"
    "tp2-dsv3-packed-am 2 dsv3,packed,amaux ref-dsv3-packed-am AM_TP=2"
    "ep2-oss-packed-am 2 oss,ossam,packed,lb1 ref-oss-packed-am-lb1 AM_EP=2"
    "pp2-oss-packed-am 2 oss,ossam,packed,mb2 ref-oss-packed-am-lb2 AM_PP=2"
    "cp2 2 long ref-long AM_CP=2" "cp4 4 long ref-long AM_CP=4" "cp2-ac 2 long,ac ref-long AM_CP=2"
    "cp2-tp2 4 long ref-long AM_CP=2 AM_TP=2" "cp2-tp2-sp 4 long,sp ref-long AM_CP=2 AM_TP=2"
    "cp2-pp2 4 long ref-long AM_CP=2 AM_PP=2" "cp4-pp2-gpipe 8 long,gpipe ref-long AM_CP=4 AM_PP=2"
    "cp2-dp2 4 long ref-long AM_CP=2" "cp4-dp2-ac 8 long,ac ref-long AM_CP=4"
    "cp2-hsdp 4 long,hsdp ref-long AM_CP=2" "cp2-hsdp-dp4 8 long,hsdp ref-long AM_CP=2"
    "cp2-tp2-pp2 8 long ref-long AM_CP=2 AM_TP=2 AM_PP=2" "cp2-mfsdp-z2-dp2 4 long,mz2 ref-long AM_CP=2"
    "cp2-mistral 2 mistral ref-mistral AM_CP=2" "cp2-qwen3-tp2 4 qwen3 ref-qwen3 AM_CP=2 AM_TP=2"
    "cp2-pp2-tied 4 tied ref-tied AM_CP=2 AM_PP=2"
    "cp2-packed 2 packed ref-packed AM_CP=2" "cp4-packed 4 packed ref-packed AM_CP=4"
    "cp2-tp2-packed 4 packed ref-packed AM_CP=2 AM_TP=2" "cp2-dp2-packed 4 packed ref-packed AM_CP=2"
    "cp2-tp2-sp-packed-ac 4 packed,sp,ac ref-packed AM_CP=2 AM_TP=2" "cp2-pp2-packed 4 packed ref-packed AM_CP=2 AM_PP=2"
    "dp2-packed 2 packed ref-packed" "tp2-pp2-packed 4 packed ref-packed AM_TP=2 AM_PP=2"
    "cp2-pneat 2 packed,neat ref-pneat AM_CP=2"
    "cp2-moe 2 moe ref-moe AM_CP=2" "cp2-ep2-moe 2 moe ref-moe AM_CP=2 AM_EP=2" "cp2-dp2-moe 4 moe ref-moe AM_CP=2"
    "cp2-tp2-moe 4 moe ref-moe AM_CP=2 AM_TP=2" "cp2-moe-aux 2 moe,aux ref-moe-aux AM_CP=2"
    "cp2-ep2-moe-aux 2 moe,aux ref-moe-aux AM_CP=2 AM_EP=2" "cp2-tp2-moe-aux-ac 4 moe,aux,ac ref-moe-aux AM_CP=2 AM_TP=2"
    "cp4-moe-aux 4 moe,aux ref-moe-aux AM_CP=4"
    "pp2-moe-aux 2 moe,aux,mb2 ref-moe-aux-lb2 AM_PP=2" "pp2-moe-aux-gpipe-ac 2 moe,aux,mb2,gpipe,ac ref-moe-aux-lb2 AM_PP=2"
    "pp2-il-m1-moe-aux 2 moe,aux,il,mb4 ref-moe-aux AM_PP=2" "tp2-pp2-moe-aux 4 moe,aux,mb2 ref-moe-aux-lb2 AM_TP=2 AM_PP=2"
    "cp2-pp2-moe-aux 4 moe,aux,mb2 ref-moe-aux-lb2 AM_CP=2 AM_PP=2"
    "cp2-pp2-ep2-moe-aux 4 moe,aux,mb2 ref-moe-aux-lb2 AM_CP=2 AM_PP=2 AM_EP=2"
    "cp2-gemma2 2 gemma2 ref-gemma2 AM_CP=2" "cp2-gemma3 2 gemma3 ref-gemma3 AM_CP=2"
    "cp4-gemma2-long 4 gemma2,long ref-gemma2-long AM_CP=4" "cp2-tp2-gemma3-ac 4 gemma3,ac ref-gemma3 AM_CP=2 AM_TP=2"
    "dp2-gemma2-packed 2 gemma2,packed ref-gemma2-packed" "cp2-gemma2-packed 2 gemma2,packed ref-gemma2-packed AM_CP=2"
    "cp2-gemma3-packed 2 gemma3,packed ref-gemma3-packed AM_CP=2")
[ -n "${AM_PARITY_ONLY:-}" ] && IFS=';' read -ra layouts <<<"$AM_PARITY_ONLY" # some layouts, to debug them
for layout in "${layouts[@]}"; do
    set -- $layout
    name=$1 n=$2 mods=$3 ref=$4
    shift 4
    if ! run "$name" "$n" "$mods" "$@"; then
        echo "FAIL: $name did not train"; sed 's/^/    /' "$work/out-$name"; fails=$((fails + 1)); continue
    fi
    trained+=("$name $n $*")
    [[ $name == *gemma*-packed* || $name == cp*-gemma* ]] && exact+=("$name") # the ring's and the packs' buffers
    [[ $name == *-il-l6* ]] && exact+=("$name") # the uneven stages' activations
    compare "$name" "$ref" "$loss_tol" "$norm_tol" "$weight_tol"
done
# packed sequences: step 1's loss is the mean over the packs' targets (label_tokens), fewer than
# the 16 x 256 rows (each document's last token is only a target; pads have none)
if [ -d "$work/logs-ref-packed" ]; then
    lt=$(grep -h '"type":"step"' "$work/logs-ref-packed"/*/rank-0.jsonl | head -n1 | sed -nE 's/.*"label_tokens":([0-9]+).*/\1/p')
    np=$(grep -h '"type":"packs"' "$work/logs-ref-packed"/*/rank-0.jsonl | sed -nE 's/.*"packs":([0-9]+).*/\1/p')
    check_memory "ref-packed: $np packs of the corpus's paragraphs; step 1 counts ${lt:-no} targets in 4096 rows" \
        "$([ -n "$lt" ] && [ -n "$np" ] && [ "$lt" -gt 2048 ] && [ "$lt" -lt 4096 ] && echo 1)"
fi
# bf16 mixed precision (docs/training.md): data, tensor (with sequence parallelism) and
# pipeline parallelism against one rank, all in bf16. Their activations are rounded to bf16
# after partial sums that each layout splits differently, so a layout may differ from one
# rank by about as much as bf16 differs from fp32: the tolerances are twice one rank's
# bf16-vs-fp32 differences (largest over the steps: loss, grad norm relative, weights).
bf16_tol=$(paste "$work/ref" "$work/ref-bf16" | awk '
    { d = $1 - $3; if (d < 0) d = -d; if (d > l) l = d; g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > n) n = g }
    END { printf "%.3g %.3g", 2 * l, 2 * n }')
"$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-ref/step-$steps/hf" "$work/ckpt-ref-bf16/step-$steps/hf" 1e9 \
    >"$work/wdiff-bf16-fp32" 2>&1
bf16_wtol=$(sed -nE 's/.*largest difference ([^ ]*) .*/\1/p' "$work/wdiff-bf16-fp32" | awk '{ printf "%.3g", 2 * $1 }')
if awk -v t="${bf16_tol%% *}" 'BEGIN { exit !(t > 1e-4) }'; then
    echo "ok: bf16 differs from fp32 on one rank (loss by up to $(echo "$bf16_tol" | awk '{ print $1 / 2 }')): bf16 layouts get $bf16_tol (loss, grad norm), weights $bf16_wtol"
    passes=$((passes + 1))
else
    echo "FAIL: one rank's bf16 run is not different from fp32 (loss tolerance $bf16_tol): is bf16 used?"
    fails=$((fails + 1))
fi
for layout in "dp2-bf16 2 bf16" "tp2-sp-bf16 2 bf16,sp AM_TP=2" "pp2-bf16 2 bf16 AM_PP=2" \
    "tp2-pp2-dp2-bf16 8 bf16,sp AM_TP=2 AM_PP=2" "dp4-rbf16 4 rbf16" "dp8-bf16-ac 8 bf16,lb2,ac" "ddp-dp2-bf16 2 bf16,ddp" \
    "hsdp-dp4-rbf16 4 hsdp,rbf16" "mfsdp-z1-dp2-rbf16 2 mz1,rbf16" "mfsdp-z2-dp2-rbf16 2 mz2,rbf16"; do
    set -- $layout
    # with AM_PARITY_ONLY, the bf16 layouts named in AM_PARITY_BF16 (space-separated) only
    [ -n "${AM_PARITY_ONLY:-}" ] && [[ " ${AM_PARITY_BF16:-} " != *" $1 "* ]] && continue
    name=$1 n=$2 mods=$3
    shift 3
    if ! run "$name" "$n" "$mods" "$@"; then
        echo "FAIL: $name did not train"; sed 's/^/    /' "$work/out-$name"; fails=$((fails + 1)); continue
    fi
    trained+=("$name $n $*")
    compare "$name" ref-bf16 "${bf16_tol%% *}" "${bf16_tol##* }" "$bf16_wtol"
done
# ring attention and packed sequences in bf16 (bf16 storage; scores, softmax statistics and
# the ring's running out, dq, dk, dv sums in fp32, each rounded once): cp 2, cp 2 x tp 2,
# packed at dp 2, packed x cp 2, a mixture of experts with the load-balancing loss at cp 2,
# Gemma 2 at cp 2 and packed at dp 2 (its scale and soft cap on the bf16 blocks), deepseek_v3
# with the selection-bias update at ep 2 (the biases fp32, the loads summed as in fp32) and with
# AutoModel's load-balancing loss at ep 2 (its statistics in fp32, local batches of 1), and
# deepseek_v3 at cp 2 (multi-head latent attention: the ring's k and dk buffers qk wide, v and
# dv v_head_dim wide, the fp32 running out / dq sum the wider), glm4_moe at tp 2 x ep 2 and cp 2
# (partial rotary), gpt_oss at tp 2 x ep 2, pp 2 and cp 2 (the sinks on bf16 scores) against
# one rank in bf16 on the same sequences, with the tolerances above taken from their own
# reference: twice one rank's bf16-vs-fp32 differences on sequences of 256 (ref-long), on the
# packs (ref-packed), with the experts (ref-moe-aux), with Gemma's (ref-gemma2,
# ref-gemma2-packed), with the update (ref-dsv3-bupd), deepseek_v3's (ref-dsv3-long),
# glm4_moe's and gpt_oss's (ref-glm, ref-glm-long, ref-oss, ref-oss-long).
# Each rank's whole allocation
# must equal am-plan's estimate to the byte (below: the ring's bf16 k, v blocks and fp32 sums).
bf16_tols() { # FP32REF BF16REF: "loss_tol norm_tol weight_tol", twice the bf16 run's distance from fp32
    local t w
    t=$(paste "$work/$1" "$work/$2" | awk '
        { d = $1 - $3; if (d < 0) d = -d; if (d > l) l = d; g = ($2 - $4) / $2; if (g < 0) g = -g; if (g > n) n = g }
        END { printf "%.3g %.3g", 2 * l, 2 * n }')
    "$AM_BUILDDIR/tests/train/ckpt_diff" "$work/ckpt-$1/step-$steps/hf" "$work/ckpt-$2/step-$steps/hf" 1e9         >"$work/wdiff-$2-fp32" 2>&1
    w=$(sed -nE 's/.*largest difference ([^ ]*) .*/\1/p' "$work/wdiff-$2-fp32" | awk '{ printf "%.3g", 2 * $1 }')
    echo "$t $w"
}
exact+=(ep2-glm tp2-glm pp2-glm fsdp2-dp2-glm fsdp2-dp4-glm tp2-ep2-glm cp2-glm) # the glm4_moe layouts above
exact+=(ep2-dsv3 tp2-dsv3 pp2-dsv3 fsdp2-dp2-dsv3 fsdp2-dp4-dsv3 tp2-ep2-dsv3 cp2-dsv3) # the deepseek_v3 layouts above
exact+=(ep2-oss tp2-oss pp2-oss fsdp2-dp2-oss fsdp2-dp4-oss tp2-ep2-oss cp2-oss tp2-oss-aux pp2-oss-aux) # the gpt_oss layouts above
exact+=(ep2-dsv3-bupd pp2-dsv3-bupd fsdp2-dp2-dsv3-bupd tp2-dsv3-bupd cp2-dsv3-bupd) # and with the bias update
exact+=(ep2-oss-am tp2-oss-am pp2-oss-am fsdp2-dp2-oss-am cp2-oss-am ac-oss-am) # AutoModel's load-balancing loss
exact+=(ep2-dsv3-am tp2-dsv3-am pp2-dsv3-am-ac fsdp2-dp2-dsv3-am cp2-dsv3-am tp2-ep2-dsv3-am ep2-glm-am ep2-qmoe-am)
exact+=(ep2-dsv3-packed-bupd cp2-dsv3-packed-bupd pp2-dsv3-packed-bupd ep2-dsv3-packed-am cp2-dsv3-packed-am) # and packed
exact+=(tp2-dsv3-packed-am ep2-oss-packed-am pp2-oss-packed-am)
exact+=(tp2-qmoe-am-ac)
# bf16_layouts "NAME RANKS CHANGES REF FREF [VAR=VALUE...]"...: each layout against its bf16
# reference REF, with the tolerances bf16_tols takes from REF and its fp32 run FREF
bf16_layouts() {
    local layout name n mods ref fref lt nt wt
    for layout; do
        set -- $layout
        [ -n "${AM_PARITY_ONLY:-}" ] && [[ " ${AM_PARITY_BF16:-} " != *" $1 "* ]] && continue
        name=$1 n=$2 mods=$3 ref=$4 fref=$5
        shift 5
        read -r lt nt wt <<<"$(bf16_tols "$fref" "$ref")"
        if ! awk -v t="$lt" 'BEGIN { exit !(t > 1e-4) }'; then
            echo "FAIL: $ref is not different from $fref (loss tolerance $lt): is bf16 used?"
            fails=$((fails + 1)); continue
        fi
        if ! run "$name" "$n" "$mods" "$@"; then
            echo "FAIL: $name did not train"; sed 's/^/    /' "$work/out-$name"; fails=$((fails + 1)); continue
        fi
        trained+=("$name $n $*")
        exact+=("$name")
        echo "    $name: tolerances from $ref against $fref: loss $lt, grad norm $nt, weights $wt"
        compare "$name" "$ref" "$lt" "$nt" "$wt"
    done
}
bf16_layouts "cp2-bf16 2 long,bf16 ref-long-bf16 ref-long AM_CP=2" \
    "cp2-tp2-bf16 4 long,bf16 ref-long-bf16 ref-long AM_CP=2 AM_TP=2" \
    "dp2-packed-bf16 2 packed,bf16 ref-packed-bf16 ref-packed" \
    "cp2-packed-bf16 2 packed,bf16 ref-packed-bf16 ref-packed AM_CP=2" \
    "cp2-moe-aux-bf16 2 moe,aux,bf16 ref-moe-aux-bf16 ref-moe-aux AM_CP=2" \
    "cp2-gemma2-bf16 2 gemma2,bf16 ref-gemma2-bf16 ref-gemma2 AM_CP=2" \
    "dp2-gemma2-packed-bf16 2 gemma2,packed,bf16 ref-gemma2-packed-bf16 ref-gemma2-packed" \
    "ep2-dsv3-bupd-bf16 2 dsv3,bupd,bf16 ref-dsv3-bupd-bf16 ref-dsv3-bupd AM_EP=2" \
    "ep2-dsv3-am-bf16 2 dsv3,amaux,lb1,bf16 ref-dsv3-am-lb1-bf16 ref-dsv3-am-lb1 AM_EP=2" \
    "cp2-dsv3-bf16 2 dsv3,long,bf16 ref-dsv3-long-bf16 ref-dsv3-long AM_CP=2" \
    "tp2-ep2-glm-bf16 4 glm,bf16 ref-glm-bf16 ref-glm AM_TP=2 AM_EP=2" \
    "cp2-glm-bf16 2 glm,long,bf16 ref-glm-long-bf16 ref-glm-long AM_CP=2" \
    "tp2-ep2-oss-bf16 4 oss,bf16 ref-oss-bf16 ref-oss AM_TP=2 AM_EP=2" \
    "pp2-oss-bf16 2 oss,bf16 ref-oss-bf16 ref-oss AM_PP=2" \
    "cp2-oss-bf16 2 oss,long,bf16 ref-oss-long-bf16 ref-oss-long AM_CP=2"
# bf16 storage (model.torch_dtype bfloat16, docs/training.md: bf16 master weights and AdamW
# moments, fp32 gradients rounded to bf16 in the step; fsdp2 keeps its gradient shards in bf16,
# each micro-batch's reduced shard rounded to bf16 and added in bf16, as FSDP2 does: at dp 2
# two micro-batches a step, four with local batches of 2 (lb2), reduced in bf16 (the mp_policy's
# default here: its compute dtype) or fp32 (rf32), where at ep 2 the experts' (ep_shard 1) fp32
# gradients are staged and added to their bf16 shards after each backward, also under 1F1B
# with pp 2; with HSDP each backward's reduced shard all-reduced over the replicas before it is
# rounded: at dp 4 with four micro-batches, and at ep 4 in fp32 where the experts are staged
# while the dense groups are all-reduced over the replicas; 2 replicas of one rank each run
# replicated, its fp32 gradients whole): data (fsdp2, ddp,
# HSDP, megatron_fsdp's
# ZeRO 1 and 2: the bf16 shards all-gathered into the bf16 masters), tensor (with sequence
# parallelism) and pipeline parallelism, context parallelism on sequences of 256, and
# deepseek_v3 at ep 2 and tp 2 x ep 2, glm4_moe at ep 2, gpt_oss at ep 2 and fsdp2 dp 4, against
# one rank with bf16 storage, with the tolerances of the bf16 layouts above taken from their own
# reference: twice one rank's bf16-storage run's distance from fp32 (ref, ref-long, ref-dsv3,
# ref-glm, ref-oss). A bf16 master moves only when an update
# reaches half its ulp, so a layout whose sums round differently can move an element one ulp
# where one rank does not: the weights' tolerance covers that (an ulp of 1, 0.0078, is below
# the bf16-storage run's own distance from fp32).
bf16_layouts "dp2-s16 2 bf16,s16 ref-s16 ref" "tp2-sp-s16 2 bf16,s16,sp ref-s16 ref AM_TP=2" \
    "pp2-s16 2 bf16,s16 ref-s16 ref AM_PP=2" "ddp-dp2-s16 2 bf16,s16,ddp ref-s16 ref" \
    "hsdp-dp4-s16 4 bf16,s16,hsdp ref-s16 ref" "mfsdp-z1-dp2-s16 2 bf16,s16,mz1 ref-s16 ref" \
    "mfsdp-z2-dp2-s16 2 bf16,s16,mz2 ref-s16 ref" "cp2-s16 2 long,bf16,s16 ref-long-s16 ref-long AM_CP=2" \
    "ep2-dsv3-s16 2 dsv3,bf16,s16 ref-dsv3-s16 ref-dsv3 AM_EP=2" \
    "tp2-ep2-dsv3-s16 4 dsv3,bf16,s16 ref-dsv3-s16 ref-dsv3 AM_TP=2 AM_EP=2" \
    "dp2-s16-lb2 2 bf16,s16,lb2 ref-s16 ref" "dp2-s16-rf32 2 bf16,s16,rf32 ref-s16 ref" \
    "ep2-dsv3-s16-rf32 2 dsv3,bf16,s16,rf32 ref-dsv3-s16 ref-dsv3 AM_EP=2" \
    "pp2-ep2-dsv3-s16-rf32 4 dsv3,bf16,s16,rf32 ref-dsv3-s16 ref-dsv3 AM_PP=2 AM_EP=2" \
    "hsdp-dp4-s16-lb2 4 bf16,s16,hsdp,lb2 ref-s16 ref" "hsdp-rep2-s16-rf32 2 bf16,s16,hsdp,rf32 ref-s16 ref" \
    "ep4-hsdp-dsv3-s16-rf32 4 dsv3,bf16,s16,hsdp,rf32 ref-dsv3-s16 ref-dsv3 AM_EP=4" \
    "ep2-glm-s16 2 glm,bf16,s16 ref-glm-s16 ref-glm AM_EP=2" "ep2-oss-s16 2 oss,bf16,s16 ref-oss-s16 ref-oss AM_EP=2" \
    "fsdp2-dp4-oss-s16 4 oss,bf16,s16 ref-oss-s16 ref-oss"
# the final checkpoint of a bf16-storage run is bf16 (torch_dtype bfloat16), as torch saves a
# bf16 model
if [ -d "$work/ckpt-ref-s16" ]; then
    got=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("torch_dtype"))' \
        "$work/ckpt-ref-s16/step-$steps/hf/config.json" 2>&1)
    hdr=$(head -c 4096 "$work/ckpt-ref-s16/step-$steps/hf/model.safetensors" | tr -d '\0' | grep -o '"dtype":"[A-Z0-9]*"' | sort -u | tr '\n' ' ')
    check_memory "ref-s16's Hugging Face checkpoint is bf16 (config: $got; tensors: $hdr)" \
        "$([ "$got" = bfloat16 ] && [ "$hdr" = '"dtype":"BF16" ' ] && echo 1)"
fi
# what the trainer allocated for weights, gradients and AdamW state is what am-plan counts
# (bf16: the fp32 masters and their bf16 copy; the gradients and their bf16 copy for the
# reduction over dp 2; bf16 storage: the bf16 masters alone, their moments in bf16)
if [ -z "${AM_PARITY_ONLY:-}" ]; then
    for name in ref ref-bf16 dp2-bf16 ref-moe ref-qwen2 ref-s16 ddp-dp2-s16; do
        n=1
        [ "$name" = dp2-bf16 ] || [ "$name" = ddp-dp2-s16 ] && n=2
        want=$("$AM_BUILDDIR/am-plan" "$work/$name.yaml" --gpus-per-node "$n" --json |
            sed -nE 's/.*"weights":([0-9.]+),"grads":([0-9.]+),"optimizer":([0-9.]+).*/\1 \2 \3/p' |
            awk '{ printf "%d %d %d", $1, $2, $3 }')
        got="$(memory "$work/logs-$name" 0 weights_bytes) $(memory "$work/logs-$name" 0 grads_bytes) $(memory "$work/logs-$name" 0 optimizer_bytes)"
        check_memory "$name: weights, gradients, optimizer bytes allocated ($got) are am-plan's ($want)" \
            "$([ "$got" = "$want" ] && echo 1)"
    done
fi
# fully sharded (fsdp2, dp > 1): what each rank allocated for weights (master shards and their
# compute copy), gradients (the reduced shards; ZeRO 1 the full-size ones too), AdamW state of
# the shards, the gathered groups and the per-group gradient buffers is what am-plan counts,
# byte for byte, on every rank (with expert parallelism the experts' shards are 1 / (dp / ep)
# of the rank's experts). Resident state (weights + gradients + optimizer state) shrinks as
# 1/dp.
plan_of() { # NAME RANKS [--set ...]: "weights grads optimizer gathered" from am-plan
    local name=$1 n=$2
    shift 2
    "$AM_BUILDDIR/am-plan" "$work/$name.yaml" --gpus-per-node "$n" --json "$@" |
        sed -nE 's/.*"memory_breakdown":\{"weights":([0-9.]+),"grads":([0-9.]+),"optimizer":([0-9.]+),"gathered_params":([0-9.]+),"grad_buffers":([0-9.]+).*/\1 \2 \3 \4 \5/p' |
        awk '{ printf "%d %d %d %d %d", $1, $2, $3, $4, $5 }'
}
if true; then # (with AM_PARITY_ONLY, the layouts that ran)
    for layout in "tp1-pp1-dp2-1f1b 2" "tp1-pp1-dp4-1f1b 4" "dp8 8" "dp8-ac 8" "dp2-bf16 2" "dp4-rbf16 4" \
        "dp8-bf16-ac 8" "dp2-tied 2" "dp2-keep 2" "hsdp-dp4 4" "hsdp-dp4-rbf16 4" "mfsdp-z1-dp2-rbf16 2" "mfsdp-z2-dp2-rbf16 2" \
        "mfsdp-z3-dp4 4" "dp2-qwen2 2" "mfsdp-z2-tp2-dp2 4 --set distributed.tp_size=2" "tp2-pp1-dp2-1f1b-sp 4 --set distributed.tp_size=2 --set distributed.sequence_parallel=true" \
        "ep2-moe 2 --set distributed.ep_size=2" "ep4-moe 4 --set distributed.ep_size=4" \
        "ep2-dp4-moe 4 --set distributed.ep_size=2" "ep4-dp8-moe 8 --set distributed.ep_size=4" \
        "tp2-dp4-ep2-moe 8 --set distributed.tp_size=2 --set distributed.ep_size=2" \
        "ep2-hsdp-moe 4 --set distributed.ep_size=2" "ep4-hsdp-moe 4 --set distributed.ep_size=4" \
        "ep2-hsdp4-moe 8 --set distributed.ep_size=2" \
        "cp2-hsdp 4 --set distributed.cp_size=2" "cp2-hsdp-dp4 8 --set distributed.cp_size=2" \
        "dp2-s16 2" "hsdp-dp4-s16 4" "mfsdp-z1-dp2-s16 2" "mfsdp-z2-dp2-s16 2" "ep2-dsv3-s16 2 --set distributed.ep_size=2" \
        "dp2-s16-lb2 2" "dp2-s16-rf32 2" "ep2-dsv3-s16-rf32 2 --set distributed.ep_size=2" \
        "hsdp-dp4-s16-lb2 4" "hsdp-rep2-s16-rf32 2" "ep4-hsdp-dsv3-s16-rf32 4 --set distributed.ep_size=4"; do
        set -- $layout
        name=$1 n=$2
        shift 2
        [ -d "$work/logs-$name" ] || continue
        read -r ww wg wo wga wgb <<<"$(plan_of "$name" "$n" "$@")"
        for r in $(seq 0 $((n - 1))); do
            got="$(memory "$work/logs-$name" $r weights_bytes) $(memory "$work/logs-$name" $r grads_bytes) $(memory "$work/logs-$name" $r optimizer_bytes) $(memory "$work/logs-$name" $r gathered_bytes) $(memory "$work/logs-$name" $r grad_buffers_bytes)"
            if [ "$got" != "$ww $wg $wo $wga $wgb" ]; then
                check_memory "$name rank $r: weights, gradients, optimizer, gathered, gradient buffer bytes ($got) are am-plan's ($ww $wg $wo $wga $wgb)" 0
                continue 2
            fi
        done
        check_memory "$name: every rank's weights, gradients, optimizer, gathered, gradient buffer bytes are am-plan's ($ww $wg $wo $wga $wgb)" 1
    done
    # ep 2 on 2 ranks (ep_shard 1, fp32 reduction): the experts' groups accumulate in their
    # shards (train/grad_sync.h), so the gradient buffers (two, of a dense group's span, and
    # their receive shards) are below one experts group's fp32 span (gathered: four of it, in
    # fp32); ep 2 x dp 4 (ep_shard 2) keeps four buffers of the experts' span
    if [ -d "$work/logs-ep2-moe" ]; then
        gb=$(memory "$work/logs-ep2-moe" 0 grad_buffers_bytes) ga=$(memory "$work/logs-ep2-moe" 0 gathered_bytes)
        check_memory "ep2-moe: no gradient buffer for the experts (ep_shard 1): $gb bytes of buffers, below one experts group's $((ga / 4))" \
            "$([ "$gb" -gt 0 ] && [ "$gb" -lt $((ga / 4)) ] && echo 1)"
    fi
    if [ -d "$work/logs-ep2-dp4-moe" ]; then
        gb=$(memory "$work/logs-ep2-dp4-moe" 0 grad_buffers_bytes) ga=$(memory "$work/logs-ep2-dp4-moe" 0 gathered_bytes)
        check_memory "ep2-dp4-moe: four gradient buffers of the experts' span (ep_shard 2): $gb bytes, at least $ga" \
            "$([ "$gb" -ge "$ga" ] && echo 1)"
    fi
    all=1
    for name in ref tp1-pp1-dp2-1f1b tp1-pp1-dp4-1f1b dp8 ddp-dp2; do [ -d "$work/logs-$name" ] || all=0; done
fi
if [ "$all" = 1 ]; then
    resident() { echo $(( $(memory "$work/logs-$1" 0 weights_bytes) + $(memory "$work/logs-$1" 0 grads_bytes) + $(memory "$work/logs-$1" 0 optimizer_bytes) )); }
    r1=$(resident ref) r2=$(resident tp1-pp1-dp2-1f1b) r4=$(resident tp1-pp1-dp4-1f1b) r8=$(resident dp8)
    check_memory "weights + gradients + optimizer state per rank shrink as 1/dp_shard: $r1 $r2 $r4 $r8 bytes for 1 2 4 8" \
        "$(awk -v a="$r1" -v b="$r2" -v c="$r4" -v d="$r8" 'BEGIN { print (b <= a / 2 + 4096 && c <= a / 4 + 4096 && d <= a / 8 + 4096) }')"
    got="$(memory "$work/logs-ddp-dp2" 0 sharded) $(memory "$work/logs-tp1-pp1-dp2-1f1b" 0 sharded)"
    check_memory "ddp keeps replicas, fsdp2 shards (sharded: $got)" "$([ "$got" = "false true" ] && echo 1)"
fi
# activations follow the schedule: rank r of 1F1B keeps pp - r micro-batches, gpipe all 4;
# activation checkpointing keeps less than half (each layer's input and one layer's work)
pp4=tp1-pp4-dp1-1f1b pp4g=tp1-pp4-dp1-gpipe
if [ -z "${AM_PARITY_ONLY:-}" ]; then
    got=$(for r in 0 1 2 3; do echo -n "$(memory "$work/logs-$pp4" $r slots)/$(memory "$work/logs-$pp4" $r peak_micro) "; done)
    check_memory "pp 4 1f1b keeps 4 3 2 1 micro-batches on ranks 0-3 (slots/peak: $got)" \
        "$([ "$got" = "4/4 3/3 2/2 1/1 " ] && echo 1)"
    got=$(for r in 0 1 2 3; do echo -n "$(memory "$work/logs-$pp4g" $r slots) "; done)
    check_memory "pp 4 gpipe keeps all 4 micro-batches on every rank ($got)" "$([ "$got" = "4 4 4 4 " ] && echo 1)"
    a=$(memory "$work/logs-$pp4" 0 act_bytes) b=$(memory "$work/logs-$pp4" 3 act_bytes)
    check_memory "pp 4 1f1b: rank 0 allocates more activation memory than rank 3 ($a > $b bytes)" \
        "$([ "$a" -gt "$b" ] && echo 1)"
    a=$(memory "$work/logs-ref" 0 act_bytes) b=$(memory "$work/logs-ac" 0 act_bytes)
    check_memory "activation checkpointing: $b bytes of activations against $a" \
        "$([ $((2 * b)) -lt "$a" ] && echo 1)"
fi
# every rank's whole allocation (weights, gradients, optimizer state, gathered groups, gradient
# buffers, activations with the model's scratch, pipeline buffers) against am-plan's estimate
# for its own pipeline rank (memory_per_pp_rank: the ranks of a stage hold the same; less the
# CUDA kernels' scratch, kernel_scratch, which the CPU's kernels do not allocate), within 5%;
# the worst ratio of the layout is printed
for layout in "${trained[@]}"; do
    set -- $layout
    name=$1 n=$2
    shift 2
    sets=()
    for v in "$@"; do
        case $v in
        AM_TP=*) sets+=(--set "distributed.tp_size=${v#AM_TP=}") ;;
        AM_PP=*) sets+=(--set "distributed.pp_size=${v#AM_PP=}") ;;
        AM_EP=*) sets+=(--set "distributed.ep_size=${v#AM_EP=}") ;;
        AM_CP=*) sets+=(--set "distributed.cp_size=${v#AM_CP=}") ;;
        esac
    done
    wants=($("$AM_BUILDDIR/am-plan" "$work/$name.yaml" --gpus-per-node "$n" --json "${sets[@]}" |
        sed -E 's/.*"memory_per_pp_rank"://' |
        grep -oE '"kernel_scratch":[0-9.e+]+,"pipeline_buffers":[0-9.e+]+,"alltoall_buffers":[0-9.e+]+,"pp_rank":[0-9]+,"total":[0-9.e+]+' |
        sed -E 's/"kernel_scratch":([0-9.e+]+),.*"total":([0-9.e+]+)/\1 \2/' | awk '{ printf "%.0f\n", $2 - $1 }'))
    worst= wr=1 equal=0 detail=
    for r in $(seq 0 $((n - 1))); do
        t=0
        for key in weights_bytes grads_bytes optimizer_bytes gathered_bytes grad_buffers_bytes act_bytes pipe_bytes \
            expert_rows_bytes; do
            t=$((t + $(memory "$work/logs-$name" "$r" $key)))
        done
        pp=$(grep -h '"coords":{"pp":' "$work/logs-$name"/*/rank-"$r".jsonl | sed -E 's/.*"coords":\{"pp":([0-9]+).*/\1/')
        want=${wants[$pp]:-0}
        ratio=$(awk -v g="$t" -v w="$want" 'BEGIN { if (w > 0) printf "%.4f", g / w; else print "none" }')
        [ "$(awk -v g="$t" -v w="$want" 'BEGIN { print (g == w) }')" = 1 ] && equal=$((equal + 1))
        if [ "$ratio" = none ] || awk -v r="$ratio" -v w="$wr" 'BEGIN { d = r - 1; e = w - 1; exit !((d < 0 ? -d : d) >= (e < 0 ? -e : e)) }'; then
            worst=$r wr=$ratio detail="rank $r (pp $pp) allocated $t bytes, am-plan estimates $want for pp rank $pp"
        fi
    done
    need=0
    [[ " ${exact[*]} " == *" $name "* ]] && need=$n
    check_memory "$name: every rank against its pp rank's estimate, $equal of $n equal to the byte; worst: $detail (record/plan $wr, within 5%)" \
        "$(awk -v r="$wr" -v e="$equal" -v need="$need" 'BEGIN { print (r != "none" && r >= 0.95 && r <= 1.05 && e >= need) }')"
done
# context parallelism: each rank's activations (saved tensors and scratch) fall as 1/cp; the
# ring's buffers (the k, v blocks and the dk, dv sums: 10 x tokens x kv width here, and the
# positions) add a few percent
if [ -z "${AM_PARITY_ONLY:-}" ] || [ -d "$work/logs-cp4" ]; then
    a1=$(memory "$work/logs-ref-long" 0 act_bytes) a2=$(memory "$work/logs-cp2" 0 act_bytes)
    a4=$(memory "$work/logs-cp4" 0 act_bytes)
    check_memory "activation bytes per rank fall as 1/cp: $a1 $a2 $a4 at cp 1 2 4 (times cp: within 10% of cp 1's)" \
        "$(awk -v a="$a1" -v b="$a2" -v c="$a4" 'BEGIN { x = 2 * b / a; y = 4 * c / a; print (x >= 1 && x <= 1.1 && y >= 1 && y <= 1.1) }')"
fi
# what am-train cannot run is refused by every rank before training, with the reason
refuse() { # NAME RECIPE WANT [VAR=VALUE...]
    local name=$1 recipe=$2 want=$3
    shift 3
    (cd "$work" && env "$@" AM_LOG_DIR="$work/logs-$name" "$AM_BUILDDIR/am-launch" --nproc 1 "$recipe" \
        >"$work/out-$name" 2>&1)
    local rc=$?
    if [ "$rc" = 1 ] && grep -qxF "$want" "$work/out-$name"; then
        echo "ok: $name is refused: $want"; passes=$((passes + 1))
    else
        echo "FAIL: $name ended with $rc, want 1 and: $want"; sed 's/^/    /' "$work/out-$name"; fails=$((fails + 1))
    fi
}
# (what the recipe alone decides, am-train refuses with am-plan's and sbatch's messages:
# tests/recipe/test-refusals.sh; here what only the rank can see, its device)
refuse device "$work/base.yaml" "am-train: rank 0: error: AM_DEVICE=gpu: not a device (cpu or cuda)" AM_DEVICE=gpu
# expert parallelism: the all-to-all's send buffer am-train allocated (the rank's own slots)
# is what am-plan counts
if [ -d "$work/logs-ep2-moe" ]; then
    want=$("$AM_BUILDDIR/am-plan" "$work/ep2-moe.yaml" --gpus-per-node 2 --set distributed.ep_size=2 --json |
        sed -nE 's/.*"alltoall_buffers":([0-9.]+).*/\1/p' | awk '{ printf "%d", $1 }')
    got=$(memory "$work/logs-ep2-moe" 0 alltoall_bytes)
    check_memory "ep2-moe: all-to-all buffers allocated ($got bytes) are am-plan's ($want)" \
        "$([ -n "$got" ] && [ "$got" -gt 0 ] && [ "$got" = "$want" ] && echo 1)"
fi
# expert parallelism: the rows the experts receive are sized to the loads (moe.h). At the start
# each rank holds am-plan's balanced load to the byte (expert_rows_bytes, apart from the fixed
# part, which equals the rest of the plan to the byte); after each step exactly what the rows
# it received needed: the saved rows of the most rows one micro-batch's MoE layers received so
# far (ep_rows_max; never below the balanced L x S) times 4 + (C + 3 I) x dtype bytes, and the
# work rows of the most one layer received (ep_layer_rows_max; never below S) times
# (3 C + 3 I) x dtype bytes, S = micro-batch tokens x top_k; with one micro-batch a step,
# ep_rows_max is the step's ep_tokens_in. The layouts of one pipeline stage (one slot a rank).
for layout in "${trained[@]}"; do
    set -- $layout
    name=$1 n=$2
    shift 2
    [[ " $* " == *" AM_EP="* ]] && [[ " $* " != *" AM_PP="* ]] && [[ " $* " != *" AM_CP="* ]] || continue
    sets=()
    for v in "$@"; do
        case $v in
        AM_TP=*) sets+=(--set "distributed.tp_size=${v#AM_TP=}") ;;
        AM_EP=*) sets+=(--set "distributed.ep_size=${v#AM_EP=}") ;;
        esac
    done
    json=$("$AM_BUILDDIR/am-plan" "$work/$name.yaml" --gpus-per-node "$n" --json "${sets[@]}")
    plan_rows=$(sed -nE 's/.*"memory_breakdown":\{[^}]*"expert_rows":([0-9.e+]+).*/\1/p' <<<"$json" | awk '{ printf "%.0f", $1 }')
    plan_fixed=$(sed -nE 's/.*"memory_breakdown":\{[^}]*"kernel_scratch":([0-9.e+]+),[^}]*"total":([0-9.e+]+),"expert_rows":([0-9.e+]+).*/\1 \2 \3/p' <<<"$json" |
        awk '{ printf "%.0f", $2 - $1 - $3 }')
    mbs=$(sed -nE 's/.*"micro_batch_size":([0-9]+).*/\1/p' <<<"$json")
    sl=$(sed -nE 's/.*"seq_length":([0-9]+).*/\1/p' <<<"$json")
    one=$(sed -nE 's/.*"micro_batches":([0-9]+),"grad_accum_steps":([0-9]+).*/\1 \2/p' <<<"$json")
    cfg() { sed -nE "s/^ *$1: *([0-9]+).*/\1/p" "$work/$name.yaml" | head -n1; }
    C=$(cfg hidden_size) k=$(cfg num_experts_per_tok) I=$(cfg moe_intermediate_size)
    [ -n "$I" ] || I=$(cfg intermediate_size)
    S=$((mbs * sl * k)) bad=
    for r in $(seq 0 $((n - 1))); do
        es=4
        grep -h '"type":"memory"' "$work/logs-$name"/*/rank-"$r".jsonl | grep -qF '"compute_dtype":"bfloat16"' && es=2
        saved=$((4 + (C + 3 * I) * es)) wrow=$(((3 * C + 3 * I) * es))
        b0=$(memory "$work/logs-$name" $r expert_rows_bytes)
        fixed=0
        for key in weights_bytes grads_bytes optimizer_bytes gathered_bytes grad_buffers_bytes act_bytes pipe_bytes; do
            fixed=$((fixed + $(memory "$work/logs-$name" "$r" $key)))
        done
        [ "$b0" = "$plan_rows" ] && [ "$fixed" = "$plan_fixed" ] ||
            bad="$bad; rank $r holds $b0 bytes of expert rows and $fixed fixed at the start, am-plan $plan_rows and $plan_fixed"
        L=$(((b0 - S * wrow) / saved / S))
        bad=$bad$(grep -h '"type":"step"' "$work/logs-$name"/*/rank-"$r".jsonl |
            sed -E 's/.*"ep_tokens_in":([0-9]+),"ep_rows_max":([0-9]+),"ep_layer_rows_max":([0-9]+),"expert_rows_bytes":([0-9]+).*/\1 \2 \3 \4/' |
            awk -v r="$r" -v LS=$((L * S)) -v S="$S" -v saved="$saved" -v wrow="$wrow" -v one="$one" '
                NF != 4 { print "; rank " r ": a step record without the rows"; exit }
                { if ($2 > hs) hs = $2; if ($3 > hl) hl = $3
                  want = (hs > LS ? hs : LS) * saved + (hl > S ? hl : S) * wrow
                  if ($4 != want) { printf "; rank %s step %d holds %s bytes, the rows need %d", r, NR, $4, want; exit }
                  if (one == "1 1" && $1 != $2) { printf "; rank %s step %d: ep_rows_max %s, ep_tokens_in %s", r, NR, $2, $1; exit } }')
    done
    check_memory "$name: expert rows at the start are am-plan's balanced load ($plan_rows bytes, the rest $plan_fixed), then on every rank and step what the rows received need (saved ${saved:-?} bytes a row above $((L * S)) rows, work ${wrow:-?} above $S)${bad:+:$bad}" \
        "$([ -z "$bad" ] && [ "${plan_rows:-0}" -gt 0 ] && echo 1)"
done
# the loss falls: the last step's loss is below the first's
first=$(head -n1 "$work/ref" | cut -d' ' -f1) last=$(tail -n1 "$work/ref" | cut -d' ' -f1)
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }'; then
    echo "ok: loss falls from $first to $last"; passes=$((passes + 1))
else
    echo "FAIL: loss did not fall: $first -> $last"; fails=$((fails + 1))
fi
echo "parity: $passes passed, $fails failed"
[ "$fails" = 0 ]
