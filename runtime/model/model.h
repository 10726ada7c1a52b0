/* model.h - a Llama-style decoder (llama; mistral with its sliding window; qwen2 with the
 * biases of its q, k, v projections; qwen3 with its per-head q/k norms; mixtral and qwen3_moe
 * with their experts, moe.h; gpt_oss with its attention sinks, q, k, v, o biases and biased
 * experts, moe.h) on one rank's shard.
 *
 * The model is written once over the kernel table (kernels/kernels.h) and tensors that carry
 * their device and dtype. A rank holds:
 *   - the layers of its pipeline stages (one chunk of consecutive layers, or several with an
 *     interleaved schedule), plus the embedding on the first stage and the final norm and
 *     output head on the last;
 *   - its tensor-parallel slice of each matrix (Megatron's split): q, k, v, gate and up by
 *     output rows (column-parallel; Qwen2's q, k, v biases with those rows), o and down by
 *     input columns (row-parallel), the embedding and head by vocabulary rows; norms whole.
 *     With fewer kv heads than tp ranks each rank holds the one kv head its query heads use.
 * With tp > 1 the model calls the tp communicator where Megatron's f/g operators stand
 * (an all-reduce after the row-parallel matmuls and the embedding, one in backward before
 * the column-parallel inputs); with tp = 1 it calls nothing. With sequence parallelism the
 * residual stream, the norms and their inputs are split by token rows over the tp ranks,
 * and the all-reduces become an all-gather before each column-parallel block and a
 * reduce-scatter after each row-parallel one (their conjugates in backward); the norms'
 * weight gradients are then summed over tp in am_model_finish_grads. Qwen3's q and k norms
 * (one weight of head_dim shared by all heads) are held whole by every tp rank, which
 * normalises its own heads: their gradients are summed over tp there too.
 *
 * Gemma 2 and Gemma 3 (cfg.gemma) run the same stream with their own layer: the embedding
 * times sqrt(hidden_size), RMSNorm with the weight 1 + w everywhere, the row-parallel outputs
 * of attention and MLP reduced over tp (or reduce-scattered to the rank's rows) and normalised
 * (post_attn_norm, post_mlp_norm) before they are added to the stream, GeGLU, the attention
 * scaled by query_pre_attn_scalar ** -0.5 and soft-capped, the final logits soft-capped.
 *
 * With pipeline parallelism the schedule (pipeline.h) runs each chunk's forward and backward
 * for micro-batches kept in slots, and moves the hidden states between stages itself. With
 * activation checkpointing a slot keeps only each layer's input; backward recomputes the
 * layer's forward (collectives included) just before its backward, bit for bit the same.
 *
 * LoRA (sh.lora_r > 0, lora.h): each projection named in sh.lora_targets gains an adapter,
 * y += (lora_alpha / lora_r) * B (A x). The A and B of all the rank's layers form one group of
 * their own, the last (AM_PG_LORA, "lora": one contiguous span of the slabs, what an optimizer
 * of the adapters alone steps), named as transformers' modules are
 * ("model.layers.N.self_attn.q_proj.lora_A.weight"), split over tp with the base layer as
 * lora.h says (the partial one summed over tp with the other partial gradients in
 * am_model_group_finish). The backward does not signal the group (grad_ready): its gradients
 * are final after the step's last backward, like a tied group's; its weights are used by every
 * layer's forward and backward without a group_use call (keep it whole on every rank: it is
 * never padded to group_align).
 * The base is frozen: no base parameter has gradient memory (its g.data is NULL; the gradient
 * slab holds the adapters' group alone, grad_off and grad_elems; the other groups are frozen;
 * fully sharded data parallelism shards their weights and gathers them through group_use as it
 * does trainable groups', am_model_drop_weights keeping the adapters)
 * and the backward computes no base gradient (the projections', norms', biases', embedding's
 * and head's weight-gradient kernels are skipped). am_model_load_hf leaves the adapters alone;
 * am_model_load_peft reads them from a peft adapter directory. With tp above the kv heads, k
 * and v adapters are refused. Mixture-of-experts layers get adapters on attention, and with
 * sh.lora_experts on each expert's projections (moe.h), in a second group after "lora":
 * "lora.experts" (AM_PG_LORA, AM_SHARD_EXPERT: each ep rank's experts' adapters, reduced over
 * the expert-data-parallel group as the experts are).
 * Adapter dropout (lora_drop, lora.h): set by am_model_set_lora_dropout, drawn in the forwards
 * and backwards of training (am_model_forward, am_model_step; never am_model_loss) from the
 * global index of each row's sequence (am_model_set_batch_seq and am_model_set_micro, before
 * a micro-batch's forward; kept with its slot for the backward) and its position in the whole
 * sequence.
 * LoRA on lm_head (AM_LORA_HEAD in sh.lora_targets): an adapter on the head's output, in the
 * "lora" group on the last stage (named "lm_head.lora_A.weight", tied or not: the embedding
 * is untouched); the cross-entropy adds s · (hf · Aᵀ) · Bᵀ to each tile of logits (kernels.h's
 * ce_stats_lora, ce_backward_lora: the logits are never stored whole), B split over tp by the
 * vocabulary with the head, A whole (its gradient partial in tp). No adapter dropout on it.
 *
 * Parameters and their gradients live in two slabs (one allocation each) so that the
 * optimizer walks one array. Parameter i is params[i] (value, gradient, Hugging Face name,
 * how it is split). The parameters form groups, consecutive in params[] and in the slabs:
 * the embedding, each decoder layer, the final norm with the head. A group is the unit of
 * gradient synchronisation and of sharding (am_pgroup.shard: how its gradients are reduced,
 * which the trainer's grad_sync.c dispatches on): the backward tells the trainer when a
 * group's gradients are final (grad_ready), so that their reduction over the data-parallel
 * ranks overlaps the backward of the layers before it.
 *
 * The model does no arithmetic on the host: every operation on activations and gradients is
 * a kernel or a collective on device memory. What the host needs once per step (the loss,
 * the gradient norm) accumulates in device scalars, read together by am_model_read_scalars.
 */
#ifndef AM_MODEL_H
#define AM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "kernels.h"
#include "model_config.h"
#include "progress.h"
#include "tensor.h"

/* How a parameter is split over tp: its full shape is shape[0] x shape[1] where split. */
enum am_split { AM_SPLIT_NONE, AM_SPLIT_ROWS, AM_SPLIT_COLS };

struct am_param {
    struct am_tensor w, g;  /* the master value, in the storage dtype (m->store_dt), and its fp32
                               gradient; read and write w through am_param_read / am_param_write */
    struct am_tensor wc;    /* the value the kernels compute with: w itself, or its copy in the
                               compute dtype (mixed precision), refreshed by am_model_begin_step */
    char name[96];          /* Hugging Face name */
    size_t slab_off;        /* where it starts in the slabs (elements), wherever g points now */
    enum am_split split;
    int64_t full_rows, full_cols; /* the unsplit shape (cols 0 for vectors) */
    int64_t row0, col0;     /* where this rank's slice starts in the full tensor */
    int copies_in_tp;       /* tp ranks holding this same tensor: 1 when split, tp for norms,
                               tp / kv heads for a kv projection shared by several ranks */
    bool partial_in_tp;     /* each tp rank computes part of its gradient (a norm with sequence
                               parallelism, the q/k norms over the rank's own heads): summed
                               over tp in am_model_finish_grads */
};

/* A pipeline stage on this rank: layers first_layer .. first_layer + n_layers - 1, with
 * activation slots for `slots` micro-batches at once (0 means 1). */
struct am_chunk {
    int first_layer, n_layers;
    int slots;
};

#define AM_MAX_CHUNKS 64
#define AM_MODEL_JOB_MAX 2 /* the trainer's i64 values in the device scalars (scalars.job_max) */

struct am_model_shard {
    int tp, tp_rank;
    bool sequence_parallel; /* the residual stream split over tp by token rows (Megatron's SP) */
    bool recompute;         /* activation checkpointing: keep each layer's input only and
                               recompute the layer's forward in its backward */
    int n_chunks;           /* pipeline stages held by this rank, in model order: 1, or the
                               virtual stages of an interleaved schedule */
    struct am_chunk chunks[AM_MAX_CHUNKS];
    bool first_stage, last_stage; /* chunk 0 starts with the embedding; the last chunk ends
                                     with the final norm, the head and the loss */
    int ep, ep_rank;              /* expert parallelism: the MoE layers' experts split over ep
                                     ranks (moe.h); 0 or 1: every expert here */
    enum am_dtype compute;        /* weights and activations in forward and backward: AM_F32
                                     (the default), or AM_BF16 (mixed precision: a bf16 copy of
                                     fp32 master weights, or the bf16 masters themselves) */
    enum am_dtype storage;        /* the master weights (model.torch_dtype, as torch holds the
                                     parameters): AM_F32 (the default) or AM_BF16; gradients are
                                     fp32 either way. Equal to compute: the kernels read the
                                     masters, no copy */
    enum am_dtype params;         /* the parameters' dtype the recipe's users hold (model.torch_dtype)
                                     where the masters are kept apart from them (FusedAdam's
                                     master_weights: bf16 parameters, fp32 masters): AM_BF16 makes
                                     the HF save bf16; AM_F32 (the default): the storage's */
    int lora_r;                   /* LoRA (lora.h): the rank of the adapters on the lora_targets
                                     projections; 0: none */
    float lora_alpha;             /* their scale is lora_alpha / lora_r */
    unsigned lora_targets;        /* bits 1u << enum am_lora_target (model_config.h): a layer's projections,
                                   * and AM_LORA_HEAD for lm_head's adapter (the last stage's) */
    bool lora_experts;            /* LoRA on a mixture of experts' experts too (moe.h), with lora_r > 0 */
    int lora_experts_r;           /* their rank (AutoModel's moe_rank_scaling: lora_r / num_experts_per_tok);
                                     0: lora_r. Their scale is lora_alpha / this rank */
    int group_align;              /* fully sharded data parallelism over this many ranks: each
                                     group's span of the slabs padded with zeros to a multiple of
                                     it, so that it splits into equal flat shards (0 or 1: none) */
    int expert_align;             /* the experts' groups' instead (expert parallelism, sharded:
                                     a multiple of group_align and of the expert-data-parallel
                                     group's size, which with HSDP need not divide it); 0:
                                     group_align */
};

/* The projections of a layer that can carry a LoRA adapter (the order of recipe.h's am_lora_target). */

/* The shard of a rank that holds all n_layers layers as one stage. */
static inline struct am_model_shard am_model_shard_whole(int tp, int tp_rank, int n_layers)
{
    return (struct am_model_shard){.tp = tp, .tp_rank = tp_rank, .n_chunks = 1, .chunks = {{0, n_layers, 1}},
                                   .first_stage = true, .last_stage = true};
}

/* Saved activations of one layer for one micro-batch, sized for the layer's kind: gate, up and
 * act as wide as its dense MLP (a MoE layer's shared experts; none without them: empty, as the
 * MLP's LoRA x · Aᵀ), v and att at v's head width (multi-head latent attention: v_head_dim).
 * With recompute only x_in is the micro-batch's own; the other tensors are one work set shared
 * by every layer, its MLP's as wide as the rank's widest (layer.c views them at each layer's). */
struct am_layer_acts {
    struct am_tensor x_in, h1, rstd1, q, k, v, att, lse, x_mid, h2, rstd2, gate, up, act;
    struct am_tensor q_raw, k_raw, rstd_q, rstd_k; /* qk_norm: q, k before their norms, and the norms' rstd
                                                      per head row */
    struct am_tensor lora_t[AM_LORA_NPROJ];         /* LoRA: each adapter's x · Aᵀ [N, r] */
    struct am_tensor o_att, rstd_oa, o_mlp, rstd_om; /* Gemma: the inputs of the norms after attention and
                                                        after the MLP (the row-parallel outputs, reduced over
                                                        tp: this rank's rows of the stream), and their rstd */
    struct am_tensor qa, qa_n, rstd_qa, ckv, ckv_n, rstd_kv; /* multi-head latent attention (mla.c): q_a_proj's
                                                               output [N, q_lora_rank] before and after its
                                                               norm (q_lora_rank > 0), the compressed kv
                                                               [N, kv_lora_rank] before and after its norm,
                                                               and the norms' rstd */
};

/* One micro-batch in flight on one chunk: the activations of the chunk's layers and, on the
 * chunks that have them, its tokens (the embedding's backward), the final norm's input and
 * output, and the softmax statistics of the loss. */
struct am_slot {
    struct am_layer_acts *acts; /* by layer of the chunk */
    struct am_tensor tokens, targets, xf, hf, rstdf, ce_m, ce_s;
    int64_t batch;
    int64_t seq0;   /* adapter dropout: the global index of its first sequence (am_model_set_batch_seq) */
    bool fused; /* the head's gradients were computed in forward (ce_fused) */
};

struct am_layer {
    struct am_param *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down;
    struct am_param *q_norm, *k_norm; /* qk_norm (Qwen3): RMSNorm over each head of q and k; else NULL */
    struct am_param *bq, *bk, *bv;    /* qkv_bias (Qwen2): the q, k, v projections' biases, split over tp
                                         with their rows (a kv head's held whole); else NULL */
    int64_t window;                   /* sliding window of its attention (0: none) */
    int group; /* its parameter group */
    struct am_moe_layer *moe;         /* a mixture-of-experts layer's router and experts (moe.h),
                                         in place of w_gate, w_up, w_down; else NULL */
    struct am_param *post_attn_norm, *post_mlp_norm; /* Gemma: the norms of the attention's and the MLP's
                                                        outputs (mlp_norm is then pre_feedforward_layernorm);
                                                        else NULL */
    bool local_rope;                  /* Gemma 3's sliding layers: the rope tables of rope_local_base_freq */
    struct am_param *lora_a[AM_LORA_NPROJ], *lora_b[AM_LORA_NPROJ]; /* LoRA (lora.h): each adapted projection's
                                                                        A and B, in the layer's group; else NULL */
    /* multi-head latent attention (deepseek_v3, mla.c): q_a_proj and q_a_layernorm (NULL when
     * q_lora_rank is null: wq is then q_proj, else q_b_proj), kv_a_proj_with_mqa,
     * kv_a_layernorm and kv_b_proj; wk and wv are NULL. q_b_proj (q_proj) and kv_b_proj are
     * split over tp by heads (column-parallel), o_proj by its input columns; q_a_proj,
     * kv_a_proj_with_mqa and the two norms are whole on every tp rank, their gradients
     * partial (each rank's heads') and summed over tp. */
    struct am_param *wq_a, *q_a_norm, *wkv_a, *kv_a_norm, *wkv_b;
    /* gpt_oss: o_proj's bias [C] (whole on every tp rank, added by tp rank 0 alone before the
     * row-parallel sum; its gradient the same on each) and the attention sinks [H] (one logit per
     * head, split over tp with the heads; kernels.h, attention_sink_*); else NULL */
    struct am_param *bo, *sinks;
};

/* How a parameter group is kept across the data-parallel ranks: replicated (every rank holds
 * all of it and all-reduces its gradients: ddp, ZeRO stage 1); sharded (fully sharded data
 * parallelism, fsdp.h: ZeRO stages 2 and 3) and expert (reduced over the expert-data group). */
enum am_shard { AM_SHARD_REPLICATED, AM_SHARD_SHARDED, AM_SHARD_EXPERT };

enum am_pgroup_kind { AM_PG_EMBED, AM_PG_LAYER, AM_PG_HEAD, AM_PG_EXPERTS /* a MoE layer's experts (moe.h) */,
                      AM_PG_LORA /* LoRA: the adapters of all the rank's layers, the last group (and the
                                    experts' adapters, the group after it: moe.h) */ };

struct am_pgroup {
    char name[32];           /* "embed", "layers.3", "head" (final norm and output head) */
    enum am_pgroup_kind kind;
    int layer;               /* AM_PG_LAYER, AM_PG_EXPERTS: the layer's local index */
    int first, n;            /* params[first .. first + n) */
    size_t offset, n_elems;  /* where it starts in the slabs, and its parameters' elements */
    size_t span;             /* its span of the slabs: n_elems padded to a multiple of group_align (experts: expert_align) */
    size_t shard_offset, shard_elems; /* sharded: its flat shard (span / ranks elements) in the
                                         trainer's shard slabs; set by the trainer */
    bool frozen;             /* LoRA: a group of the frozen base (no gradient memory, g.data NULL;
                                nothing to reduce or step) */
    bool tied;               /* holds a copy of a tied embedding split over two pipeline stages:
                                final only after am_model_finish_tied, never signalled */
    enum am_shard shard;     /* set by the trainer (AM_SHARD_REPLICATED by default) */
    struct am_comm *comm;    /* the group it is reduced over (sharded: the group its shards span,
                                all-gathered and reduce-scattered over; with expert parallelism
                                the experts' expert-data-parallel group); set by the trainer */
    struct am_comm *replicate; /* sharded with replicas (HSDP): the group its shards are then
                                  all-reduced over, or NULL (the experts' with expert
                                  parallelism: their group spans the replicas); set by the
                                  trainer */
};

/* The step's values the host reads (am_model_read_scalars). */
struct am_model_values {
    double loss_sum;    /* Σ token losses: this rank's, or over dp and pp after am_model_reduce_loss */
    double sumsq;       /* the squared gradient norm (am_model_grad_sumsq) */
    double local_sumsq; /* Σ g² this rank added to scalars.local_sumsq before any data-parallel sum */
};

/* Where the model is in its step, for a report of a device failure (an allocation that fails
 * names the phase and the layer): set by the forward and the backward as they go, by the
 * trainer for what it runs around them. */
enum am_model_phase { AM_PHASE_SETUP, AM_PHASE_FORWARD, AM_PHASE_BACKWARD, AM_PHASE_GRAD_SYNC, AM_PHASE_OPTIMIZER };
#define AM_WHERE_EMBEDDING (-1) /* layer: the embedding */
#define AM_WHERE_HEAD (-2)      /* layer: the head (final norm, output projection, loss) */
#define AM_WHERE_NONE (-3)
struct am_model_where {
    enum am_model_phase phase;
    int layer;                  /* global layer index, or one of AM_WHERE_* */
};
const char *am_model_phase_name(enum am_model_phase p);

/* The trainer's hooks into the passes, installed once (am_model_set_hooks); each is called
 * with arg first, and NULL means none. Non-zero from a hook fails the pass with its message. */
struct am_model_hooks {
    /* Called before group's weights are read: before its forward, and before its backward
     * (which starts with the recompute under activation checkpointing); backward says which.
     * The head's group is used for the tied embedding too when head == embed. Fully sharded
     * data parallelism gathers the group's weights there and points their wc at them. NULL:
     * the weights are always where init put them. */
    int (*group_use)(void *arg, int group, bool backward, char *err, size_t err_len);
    /* Called before a pass writes group's gradients (the head's, then the embedding's it
     * shares, in the backward or already in the forward that fuses the loss's gradient; a
     * layer's, then its experts'; the embedding's), so that a trainer that keeps
     * gradients in per-group buffers (sharded gradients, grad_sync.h) points the group's g
     * there first. NULL: the gradients are the slab's. */
    int (*grad_use)(void *arg, int group, char *err, size_t err_len);
    /* Called when a group's gradients are final: while the model's grads_final is set (the
     * pipeline sets it for each chunk's last backward of the step), after the group's last
     * backward kernel; with grads_each_pass after every backward of the group. A tied group
     * is never signalled. */
    int (*grad_ready)(void *arg, int group, char *err, size_t err_len);
    bool grads_each_pass;
    void *arg;
};

/* LoRA's adapter dropout (am_model_set_lora_dropout, am_model_set_batch_seq) */
struct am_lora_dropout {
    double p;                /* 0: none (the kernels draw with it as a float) */
    bool pre;                /* on the adapters' input ("pre"), else on their output ("post") */
    uint64_t seed;
    int64_t base, seq_step;  /* the first sequence (global index) of micro-batch 0 of the run, and the step between
                                sequences (am_model_set_batch_seq) */
    int64_t seq0;            /* the next forward's first sequence (am_model_set_micro) */
    bool on;                 /* in the pass being run: a training pass with p > 0 */
    int64_t cur_seq0;        /* the first sequence of the slot being run */
};

struct am_model {
    struct am_model_config cfg;
    struct am_model_where where;
    struct am_model_shard sh;
    const struct am_dev *dev; /* where the model lives and its kernels run */
    const struct am_kernels *K; /* dev->k */
    struct am_progress *load_bar; /* am_model_load_hf's progress line (its `on` says whether it shows), or NULL */
    struct am_comm *tp_comm; /* NULL when tp = 1 */
    struct am_comm *pp_comm; /* NULL without pipeline parallelism: the tied embedding's two copies */
    struct am_comm *ep_comm; /* the expert-parallel group (moe.h), set by the trainer; NULL at ep 1 */

    int64_t heads, kv_heads, head_dim, inter; /* this rank's shard */
    int64_t vocab_start, vocab_shard;
    int64_t kv_head0;                          /* first kv head this rank holds */
    int n_layers;                              /* on this rank, all chunks */
    int chunk_base[AM_MAX_CHUNKS];             /* local index of each chunk's first layer */
    int slot_base[AM_MAX_CHUNKS];              /* index in slots of each chunk's first slot */

    struct am_param *params;
    int n_params;
    struct am_pgroup *groups;
    int n_groups;
    struct am_model_hooks hooks; /* the trainer's (am_model_set_hooks); none after am_model_init */
    bool grads_final; /* set by the pipeline around each chunk's last backward of the step (grad_ready) */
    /* device scalars: loss and sumsq (f64 accumulators), local_sumsq (the trainer's), the
     * fp32 sums over ranks of loss and sumsq, an i32 flag (all_finite), and the trainer's
     * AM_MODEL_JOB_MAX i64 values it reduces by their maximum over the job each step, an
     * all-reduce's send and receive buffers (job_max[0], job_max[1]) */
    struct {
        struct am_tensor loss, sumsq, local_sumsq, loss_f, sumsq_f, flag, job_max[2];
    } scalars;
    void *scalar_mem;
    bool loss_reduced, sumsq_reduced; /* the f32 sums are the values to read */
    void *param_mem, *grad_mem; /* masters (store_dt) and fp32 gradients */
    void *param_lp_mem;         /* the compute copy of the weights (act_dt != store_dt), or NULL */
    size_t param_off;           /* param_mem (and param_lp_mem) hold slab elements [param_off, slab_elems): all
                                   of them (0), or with LoRA's base sharded (am_model_drop_weights) the
                                   adapters' group alone (grad_off) */
    enum am_dtype act_dt;       /* compute dtype: the weights' copy and the activations */
    enum am_dtype store_dt;     /* the masters' dtype (sh.storage) */
    enum am_dtype save_dt;      /* the HF save's: bf16 with sh.params or sh.storage bf16, else fp32 */
    size_t n_elems; /* parameters on this rank (all of them, in elements) */
    size_t slab_elems; /* the slabs' length: n_elems plus each group's padding (group_align) */
    size_t grad_off, grad_elems; /* the gradient slab (grad_mem) holds slab elements [grad_off, grad_off +
                                    grad_elems): all of them, or with LoRA the adapters' group alone */

    struct am_param *embed, *final_norm, *head; /* head == embed when tied and on the same rank */
    struct am_param *head_lora_a, *head_lora_b; /* LoRA on lm_head (last stage; NULL: none): A [r, C] whole,
                                                 * B [vocab_shard, r] split with the head's rows */
    struct am_layer *layers;
    struct am_moe *moe; /* the mixture-of-experts layers' state (moe.h); NULL for a dense model */
    struct am_cp *cp;   /* context parallelism (ring.h, am_cp_init): the ring; NULL at cp 1 */
    struct am_packed *pk; /* packed sequences (packed.h, am_packed_init): documents that do not attend
                             to one another, rotary positions per document; NULL: one per sequence */

    /* activations: n_slots (all chunks') micro-batches of up to max_tokens tokens */
    int64_t max_tokens, seq_len;
    int n_slots;
    struct am_slot *slots;           /* chunk c's slot s is slots[slot_base[c] + s] */
    struct am_layer_acts *acts_mem;  /* every slot's layers, n_acts of them */
    size_t n_acts;
    void *act_mem;
    size_t act_bytes; /* the activation memory allocated (saved tensors and scratch) */
    struct am_tensor x, dx, dhf, cos, sin, ce_t;
    struct am_tensor scratch_q, scratch_kv_k, scratch_kv_v, scratch_c, scratch_mlp, scratch_att;
    struct am_tensor scratch_kn; /* qk_norm: the gradient of k before its norm */
    struct am_tensor scratch_mla; /* multi-head latent attention: its projections' outputs and their
                                     gradients (mla.c, am_mla_scratch_elems) */
    struct am_tensor gathered, scratch_rows; /* sequence parallelism: [N, C] all-gathered, [N/tp, C] */
    struct am_tensor ce_M;                   /* tp > 1: the combined max logit of each token */
    struct am_tensor kv_sum;                 /* kv heads shared by tp ranks: every kv head's k and v
                                                gradients (no data otherwise) */
    struct am_tensor cos_local, sin_local;   /* Gemma 3: the sliding layers' rope tables */
    struct am_tensor scratch_post;           /* Gemma: [R, C], a post norm's output, and its input's gradient */
    struct am_tensor lora_u, lora_du, lora_dt; /* LoRA: [N, widest output], twice, and [N, r] */
    struct am_lora_dropout lora_drop;          /* LoRA's adapter dropout (p 0: none) */
    const int32_t *pack_fill, *pack_fill_next; /* packed sequences: the rows each sequence's documents fill
                                                  (am_model_set_pack_fill; NULL: all of them) */
};

/* LoRA's adapter dropout: probability p (0: none) on the adapters' input (pre) or output,
 * drawn from seed (lora.h). */
static inline void am_model_set_lora_dropout(struct am_model *m, double p, bool pre, uint64_t seed)
{
    m->lora_drop.p = p;
    m->lora_drop.pre = pre;
    m->lora_drop.seed = seed;
}

/* The global index of the first sequence of micro-batch 0 of the next run of micro-batches,
 * and the step from one sequence to the next (the trainer's: step * global_batch + k * dp +
 * dp rank for its k-th sequence, dataset.h). Only adapter dropout reads it; default 0, 1. */
static inline void am_model_set_batch_seq(struct am_model *m, int64_t seq0, int64_t seq_step)
{
    m->lora_drop.base = m->lora_drop.seq0 = seq0;
    m->lora_drop.seq_step = seq_step;
}

/* The next forward is of micro-batch `micro` of that run, each of `batch` sequences (the
 * pipeline's call; without it, micro-batch 0). */
static inline void am_model_set_micro(struct am_model *m, int64_t micro, int64_t batch)
{
    m->lora_drop.seq0 = m->lora_drop.base + micro * batch * m->lora_drop.seq_step;
    if (m->pack_fill)
        m->pack_fill_next = m->pack_fill + micro * batch;
}

/* Packed sequences: for each sequence of the next run of micro-batches (host [micro-batches x
 * batch], kept by the caller until their backwards), the rows its documents fill before its
 * pads (pack.h's am_packs_rows), for the MoE gate's statistics that leave the pads out
 * (moe.h); am_model_set_micro picks a micro-batch's. NULL (the default): no pads. */
static inline void am_model_set_pack_fill(struct am_model *m, const int32_t *fill)
{
    m->pack_fill = m->pack_fill_next = fill;
}

/* Installs the trainer's hooks (after am_model_init, which clears them). */
static inline void am_model_set_hooks(struct am_model *m, const struct am_model_hooks *h) { m->hooks = *h; }

/* Builds the shard's parameters (zeroed) and activation buffers for each chunk's slots of
 * micro-batches of up to batch x seq_len tokens. tp_comm: the tensor-parallel group (tp > 1); pp_comm: the
 * pipeline group (NULL without pipeline parallelism), over which the two copies of a tied
 * embedding on the first and the last stage are kept equal. Returns 0, or -1 with a message. */
int am_model_init(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                  const struct am_dev *dev, struct am_comm *tp_comm, struct am_comm *pp_comm, int64_t batch,
                  int64_t seq_len, char *err, size_t err_len);
void am_model_free(struct am_model *m);

/* Random initialisation as transformers does it: linear and embedding weights from
 * N(0, initializer_range), norm weights 1. Each element is a function of (seed, name,
 * index in the full tensor), so every layout of tp and pp initialises the same model. 0, or -1
 * out of host memory (a parameter's values pass through it; the model is then not usable). */
int am_model_init_weights(struct am_model *m, uint64_t seed);

/* Every parameter's value rounded to bf16 (nearest even), kept in the storage's dtype: fp32
 * masters beside bf16 parameters begin as those parameters (FusedAdam's master_weights).
 * 0, or -1 out of host memory (a parameter's values pass through it). */
int am_model_round_to_bf16(struct am_model *m);

/* LoRA: whether p is an adapter's A or B. */
bool am_model_is_lora(const struct am_param *p);

/* LoRA's adapters as peft and AutoModel start them: B zero; A kaiming-uniform with a = sqrt(5)
 * (bound 1 / sqrt(in), kaiming true: peft's) or xavier-normal (std sqrt(2 / (in + r)):
 * AutoModel's default). Each element a function of (seed, name, index in the full tensor), as
 * am_model_init_weights, which leaves the adapters alone. 0, or -1 out of host memory. */
int am_model_init_lora(struct am_model *m, uint64_t seed, bool kaiming);

/* Elements of the hidden state one pipeline stage hands the next for a micro-batch of
 * `batch` sequences: its rows of the residual stream (all tokens, or its 1/tp with sequence
 * parallelism) times hidden_size. */
size_t am_model_hidden_elems(const struct am_model *m, int64_t batch);
/* Bytes that travel after that hidden state, and after its gradient: with a mixture of
 * experts' load-balancing loss its statistics (moe.h, am_moe_pipe_bytes), else 0. x_in,
 * x_out, dy and dx below hold them right after the hidden state's elements. */
size_t am_model_pipe_trailer_bytes(const struct am_model *m);

/* Pipeline pieces: the forward of one chunk for the micro-batch kept in the chunk's `slot`
 * (0 <= slot < the chunk's slots; the slot's activations stay until its backward). tokens and targets are host int32
 * arrays of batch x seq_len (a target < 0 is ignored): tokens are read by the chunk with the
 * embedding, targets by the chunk with the head. starts: with packed sequences (packed.h) the
 * host int32 array of batch x seq_len document starts, read by every chunk; NULL otherwise. x_in (device memory, am_model_hidden_elems)
 * is the previous stage's output, on every chunk but the first stage's; x_out receives this
 * chunk's output on every chunk but the last stage's. The last stage adds the micro-batch's
 * token losses to the loss scalar; dloss_scale is the gradient of the total loss with respect
 * to that sum (1 / tokens of the global batch gives the global mean). */
int am_model_forward(struct am_model *m, int chunk, int slot, int64_t batch, const int32_t *tokens,
                     const int32_t *targets, const int32_t *starts, const void *x_in, void *x_out, float dloss_scale,
                     char *err, size_t err_len);
/* Its backward: dy is the gradient of the chunk's output (from the next stage; ignored on the
 * last stage, where it starts from the loss), dx receives the gradient of x_in (not on the
 * first stage). Parameter gradients accumulate. */
int am_model_backward(struct am_model *m, int chunk, int slot, const void *dy, void *dx, float dloss_scale,
                      char *err, size_t err_len);

/* The whole model on one rank (one chunk with embedding and head): forward and backward of
 * one micro-batch in slot 0 (starts as am_model_forward's). Returns the sum of its token losses
 * in *loss_sum (reading the loss scalar, which it zeroes first: a host sync, for tests and
 * tools). */
int am_model_step(struct am_model *m, const int32_t *tokens, const int32_t *targets, const int32_t *starts,
                  int64_t batch, float dloss_scale, double *loss_sum, char *err, size_t err_len);

/* Forward only, the whole model on one rank: returns the summed token loss (as am_model_step). */
int am_model_loss(struct am_model *m, const int32_t *tokens, const int32_t *targets, const int32_t *starts,
                  int64_t batch, double *loss_sum, char *err, size_t err_len);

/* The start of a step: zeroes the gradients and the loss scalar, and refreshes the compute
 * copy of the weights from the masters (mixed precision). */
void am_model_begin_step(struct am_model *m);
/* The compute copy of the weights from the masters (am_model_begin_step does it; after
 * writing masters outside a step, a load for instance, call it before a forward). */
void am_model_cast_weights(struct am_model *m);

/* Parameter p's master values [at, at + n) (elements from p's start, row-major; a run may go on
 * into the parameters after p in the slab) from or to fp32 host memory: written rounded to the
 * storage dtype (nearest even, as torch's .to(bfloat16)), read widened (exact). The one way
 * the loaders, the initialisation and the savers touch p->w. */
void am_param_write(const struct am_model *m, const struct am_param *p, const float *host, size_t at, size_t n);
void am_param_read(const struct am_model *m, const struct am_param *p, float *host, size_t at, size_t n);

/* Completing the gradients of one optimizer step, after its last micro-batch, once:
 * am_model_group_finish sums across the tp ranks what they computed separately in group g
 * (the kv heads they share; the norms, with sequence parallelism): collective over tp.
 * am_model_finish_tied adds up the two copies of a tied embedding on the first and the last
 * pipeline stage: collective between those ranks. am_model_finish_grads does both for every
 * group (tied first). */
int am_model_group_finish(struct am_model *m, int group, char *err, size_t err_len);
int am_model_finish_tied(struct am_model *m, char *err, size_t err_len);
int am_model_finish_grads(struct am_model *m, char *err, size_t err_len);

/* The squared L2 norm of all of the model's gradients (one replica of it), into the sumsq
 * scalar: sharded parameters summed over tp and pp, replicated ones (norms; kv heads shared by
 * several tp ranks; the tied embedding's copy on the last stage) counted once. Collective over
 * the tp group, then the pp group. -1 with a message on a comm error. */
int am_model_grad_sumsq(struct am_model *m, char *err, size_t err_len);

/* The same norm from gradient shards (fully sharded data parallelism): the reduced gradients
 * (dtype dt: fp32, or bf16 as torch takes the norm of bf16 gradients: squares and sum in double,
 * sum_squares) are rank `rank` of `ranks`'s flat shard of each group (shards + the group's
 * shard_offset, its elements [offset + rank * shard_elems, + shard_elems) of the padded span; a
 * group with a comm set, its rank in it instead: the experts' with expert parallelism). Each
 * parameter's part of the shard counted as am_model_grad_sumsq counts it; summed over tp, pp and
 * the shard group dp (dp_shard x cp: the ep groups x the expert-data-parallel groups, so each
 * expert counted once). replicas: HSDP's replica group when the experts' shards span it (expert
 * parallelism with HSDP: dp_shard holds only some of them), else NULL; then every group but the
 * experts' is counted 1 / replicas (each replica holds the same shards) and the sum taken over it
 * too. */
int am_model_grad_sumsq_shards(struct am_model *m, const void *shards, enum am_dtype dt, int rank, struct am_comm *dp,
                               struct am_comm *replicas, char *err, size_t err_len);

/* Frees the full fp32 masters and their compute copy (fully sharded data parallelism keeps
 * them in shards and gathers each group before use, group_use); p->w.data becomes NULL
 * (point it at a gathered copy to save a checkpoint). With LoRA the adapters' group stays:
 * copied into slabs of its own (param_mem from param_off = grad_off), the frozen base's
 * weights alone dropped. Returns 0, or -1 when out of memory for that copy (nothing dropped). */
int am_model_drop_weights(struct am_model *m);

/* Frees the gradient slab (a trainer that keeps gradients in per-group buffers points each
 * group's g there through grad_use); p->g.data becomes NULL. */
void am_model_drop_grads(struct am_model *m);

/* The other group whose parameters group g's passes read and write: the embedding for the
 * head's group when the head is the embedding on this rank, a mixture-of-experts layer's
 * experts for its layer's group; -1 for any other. */
int am_model_group_also(const struct am_model *m, int group);

/* The loss scalar summed over the data-parallel group dp (NULL: none) and the pp group. */
int am_model_reduce_loss(struct am_model *m, struct am_comm *dp, char *err, size_t err_len);

/* One read of the device scalars (waits for the device). */
void am_model_read_scalars(struct am_model *m, struct am_model_values *v);

/* The device scalar that am_model_read_scalars reads as the squared gradient norm (sumsq:
 * AM_F64, or the AM_F32 sum over tp and pp ranks once reduced), for kernels that use the
 * norm on the device (the optimizer's clipping). */
const struct am_tensor *am_model_sumsq(const struct am_model *m);

/* True for the last stage's copy of a tied embedding held by another rank (the first stage
 * holds the tensor itself): it is saved, and counted in norms, once, by the first stage. */
bool am_model_is_tied_copy(const struct am_model *m, const struct am_param *p);

/* The index of a parameter by Hugging Face name, or -1. */
int am_model_find(const struct am_model *m, const char *name);

#endif
