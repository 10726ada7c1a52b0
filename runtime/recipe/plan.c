/* plan.c - mesh, groups, pipeline stages, memory and FLOPs (plan.h). */
#include "plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pp_schedule.h"

/* ---- mesh ---------------------------------------------------------------------------- */

void am_plan_coords(const struct am_plan *p, int rank, struct am_coords *c)
{
    int r = rank;
    c->tp = r % p->tp, r /= p->tp;
    c->cp = r % p->cp, r /= p->cp;
    c->dp_shard = r % p->dp_shard, r /= p->dp_shard;
    c->dp_replicate = r % p->dp_replicate, r /= p->dp_replicate;
    c->pp = r;
    int dpcp = (c->dp_replicate * p->dp_shard + c->dp_shard) * p->cp + c->cp;
    c->ep = dpcp % p->ep;
    c->ep_shard = dpcp / p->ep;
}

int am_plan_rank(const struct am_plan *p, const struct am_coords *c)
{
    return (((c->pp * p->dp_replicate + c->dp_replicate) * p->dp_shard + c->dp_shard) * p->cp + c->cp) * p->tp +
           c->tp;
}

/* Which coordinates may differ inside a group of kind g; the others must match. */
static bool same_group(const struct am_plan *p, enum am_group g, const struct am_coords *a, const struct am_coords *b)
{
    (void)p;
    bool pp = a->pp == b->pp, tp = a->tp == b->tp, cp = a->cp == b->cp;
    bool rep = a->dp_replicate == b->dp_replicate, shard = a->dp_shard == b->dp_shard;
    switch (g) {
    case AM_GROUP_TP:
        return pp && rep && shard && cp;
    case AM_GROUP_CP:
        return pp && rep && shard && tp;
    case AM_GROUP_PP:
        return rep && shard && cp && tp;
    case AM_GROUP_DP:
        return pp && cp && tp;
    case AM_GROUP_DP_SHARD: /* dp_shard x cp (AutoModel's dp_shard_cp): the ranks fsdp2 shards over */
        return pp && rep && tp;
    case AM_GROUP_DP_REPLICATE:
        return pp && shard && cp && tp;
    case AM_GROUP_DP_CP:
        return pp && tp;
    case AM_GROUP_EP:
        return pp && tp && a->ep_shard == b->ep_shard;
    case AM_GROUP_EP_SHARD:
        return pp && tp && a->ep == b->ep;
    case AM_NGROUPS:
        break;
    }
    return false;
}

int am_plan_group(const struct am_plan *p, enum am_group g, int rank, int *members)
{
    struct am_coords me, other;
    int n = 0;
    am_plan_coords(p, rank, &me);
    for (int r = 0; r < p->world; r++) {
        am_plan_coords(p, r, &other);
        if (same_group(p, g, &me, &other))
            members[n++] = r;
    }
    return n;
}

const char *am_group_name(enum am_group g)
{
    static const char *const names[] = {"tp", "cp", "pp", "dp", "dp_shard", "dp_replicate", "dp_cp", "ep",
                                        "ep_shard"};
    return g < AM_NGROUPS ? names[g] : "?";
}

/* ---- pipeline stages ----------------------------------------------------------------- */

static int virtual_stages(const struct am_recipe *r)
{
    int pp = r->dist.pp, lps = r->dist.pipeline.layers_per_stage;
    long L = r->model.num_hidden_layers;
    if (pp == 1 || r->dist.pipeline.schedule != AM_PP_INTERLEAVED_1F1B)
        return 1;
    long stages = lps ? (L + lps - 1) / lps : 2L * pp;
    if (stages % pp) /* validated: rounding is allowed */
        stages = r->dist.pipeline.round_virtual == AM_ROUND_UP ? (stages / pp + 1) * pp : stages / pp * pp;
    return (int)(stages / pp);
}

static int build_stages(const struct am_recipe *r, struct am_plan *p)
{
    p->virtual_stages = virtual_stages(r);
    p->n_stages = p->pp * p->virtual_stages;
    p->stages = calloc((size_t)p->n_stages, sizeof(*p->stages));
    if (!p->stages)
        return -1;
    /* AutoModel's split (generate_hf_model_split): every stage num_hidden_layers / n_stages
     * layers, the first num_hidden_layers % n_stages one more (validate.c: n_stages <= layers) */
    int per = (int)(r->model.num_hidden_layers / p->n_stages);
    int extra = (int)(r->model.num_hidden_layers % p->n_stages);
    for (int s = 0, first = 0; s < p->n_stages; s++) {
        int n = per + (s < extra);
        p->stages[s] = (struct am_stage){.pp_rank = s % p->pp, .first_layer = first, .n_layers = n,
                                         .embedding = s == 0, .head = s == p->n_stages - 1};
        first += n;
    }
    return 0;
}

/* ---- memory -------------------------------------------------------------------------- */

/* Bytes of one buffer of n elements of size es, as the model carves them (64-byte aligned). */
static double carved(double n, double es) { return (double)(((long long)(n * es) + 63) / 64 * 64); }

/* A MoE layer's tensors per token (in compute-dtype elements), kept per micro-batch slot and
 * MoE layer whether or not the dense part is recomputed (runtime/model/moe.c). With expert
 * parallelism the rows a rank's experts receive (the permuted input, gate, up and product, and
 * where each goes) depend on the loads: they are apart (expert_rows_bytes); the counts (an i32
 * per expert, and those received) are apart too. */
static double moe_elems_per_token(const struct am_recipe *r, const struct am_plan *p)
{
    const struct am_model_config *m = &r->model;
    if (m->num_experts <= 0)
        return 0;
    double h = (double)m->hidden_size;
    double k = (double)m->num_experts_per_tok, E = (double)m->num_experts, cs = am_dtype_size(r->compute_dtype);
    return E + k * (h + (p->ep > 1 ? 0 : h + 3 * (double)m->moe_intermediate_size)) + (E + 3 * k) * 4 / cs;
}

/* Expert parallelism: the buffers sized to the loads (moe.c, moe.h), for `rows` rows a MoE
 * layer: each slot's saved rows of its MoE layers (an i32, the permuted input and the gate, up
 * and product a row) and the work rows of one layer (the two all-to-all buffers and the
 * permuted input's gradient, the gradients of the product, gate and up, with LoRA on the
 * experts three of its rank) */
static double expert_rows_bytes(const struct am_recipe *r, const struct am_plan *p, int moe_layer_slots, double rows)
{
    const struct am_model_config *m = &r->model;
    if (p->ep < 2 || m->num_experts <= 0)
        return 0;
    double h = (double)m->hidden_size, Im = (double)m->moe_intermediate_size, cs = am_dtype_size(r->compute_dtype);
    double lora = r->peft.enabled && r->peft.experts ? 3 * (double)r->peft.experts_dim : 0;
    return moe_layer_slots * rows * (4 + (h + 3 * Im) * cs) + rows * (3 * h + 3 * Im + lora) * cs;
}

/* The MoE layers of stage s. */
static int stage_moe_layers(const struct am_recipe *r, const struct am_stage *st)
{
    int n = 0;
    for (int l = st->first_layer; r->model.num_experts > 0 && l < st->first_layer + st->n_layers; l++)
        n += am_model_layer_is_moe(&r->model, l);
    return n;
}

/* Elements saved for backward per token of one layer on one tp rank but its MLP's (every
 * layer's the same; see docs/recipes.md). */
static double act_elems_per_token(const struct am_recipe *r, const struct am_plan *p)
{
    const struct am_model_config *m = &r->model;
    double tp = p->tp, h = (double)m->hidden_size;
    /* the rank's heads and kv heads (one when tp exceeds the kv heads); a head's width in q and k,
     * and in v and the attention's output (multi-head latent attention: qk_nope + qk_rope and
     * v_head_dim; runtime/model/mla.c) */
    double heads = (double)(m->num_attention_heads / p->tp);
    double kv_heads = m->num_key_value_heads >= p->tp ? (double)(m->num_key_value_heads / p->tp) : 1.0;
    double qkd = (double)am_model_qk_head_dim(m), vd = (double)am_model_v_head_dim(m);
    /* norm inputs and outputs, and the two norms' inverse rms (fp32) */
    double f32 = 4 / am_dtype_size(r->compute_dtype);
    double replicated = 4 * h + 2 * f32;
    if (m->gemma) /* Gemma: the inputs of the norms after attention and after the MLP, and their rstd */
        replicated += 2 * h + 2 * f32;
    if (r->dist.sequence_parallel)
        replicated /= tp;
    /* q, k, v and the attention's output */
    double att = heads * qkd + kv_heads * qkd + kv_heads * vd + heads * vd;
    /* q and k before their per-head norms, and the norms' inverse rms (fp32) */
    double qk_norm = m->qk_norm ? heads * qkd + kv_heads * qkd + (heads + kv_heads) * f32 : 0;
    /* LoRA: each adapter's x · Aᵀ (dim values per token; a row-parallel layer's summed over tp)
     * but the MLP's (mlp_elems_per_token) */
    double lora = 0;
    for (int t = 0; r->peft.enabled && t < AM_LORA_HEAD; t++)
        if (t != AM_LORA_GATE && t != AM_LORA_UP && t != AM_LORA_DOWN)
            lora += (r->peft.targets >> t & 1u) ? (double)r->peft.dim : 0;
    /* multi-head latent attention (runtime/model/mla.c): q_a_proj's output before and after its
     * norm, the compressed kv before and after its norm, and the norms' inverse rms (fp32) */
    double mla = !m->mla ? 0 : (m->q_lora_rank > 0 ? 2 * (double)m->q_lora_rank + f32 : 0) +
                                   2 * (double)m->kv_lora_rank + f32;
    /* the attention's log-sum-exp per head (fp32) */
    return replicated + att + heads * f32 + qk_norm + lora + mla;
}

/* The width of the tp rank's share of layer l's dense MLP (am_model_layer_mlp_width: a dense
 * layer's intermediate_size, a MoE layer's shared experts' width, 0 in a MoE layer without
 * them). */
static double mlp_width(const struct am_recipe *r, const struct am_plan *p, long l)
{
    return (double)(am_model_layer_mlp_width(&r->model, l) / p->tp);
}

/* The MLP's elements saved for backward per token of a layer whose dense MLP is w wide on the
 * tp rank: its gate, up and product, and with LoRA on gate_proj, up_proj or down_proj their
 * adapters' x · Aᵀ; nothing without an MLP (the routed experts' tensors are
 * moe_elems_per_token's). */
static double mlp_elems_per_token(const struct am_recipe *r, double w)
{
    if (w <= 0)
        return 0;
    double lora = 0;
    for (int t = AM_LORA_GATE; r->peft.enabled && t <= AM_LORA_DOWN; t++)
        lora += (r->peft.targets >> t & 1u) ? (double)r->peft.dim : 0;
    return 3 * w + lora;
}

/* Micro-batches whose activations pp rank k holds at its peak, in units of its layers: as the
 * executor allocates them, each chunk's slots (pp_schedule.h: the most micro-batches the
 * chunk holds at once) of the chunk's layers (its stage's: they differ by one where the
 * layers do not split evenly). For gpipe and 1f1b that is
 * the schedule's peak; for interleaved1f1b it can be more (the chunks peak at different
 * times). The schedule exists (validate.c: n_micro >= pp for gpipe and 1f1b; whole rounds for
 * interleaved1f1b, am_pipe_round) and has at most 2 * AM_PLAN_MAX_PIPE_PASSES actions (am_plan_build).
 * The layers' MLPs differ by kind (a dense layer's, a MoE layer's shared experts' or none): rs
 * gets their elements per token over the slots and the widest of the rank's MLPs.
 * Returns -1 when out of memory. */
struct rank_slots {
    int total, first, last; /* over the rank's chunks; of its first chunk; of its last */
    int moe_layer_slots;    /* over the chunks, slots x the chunk's MoE layers */
    int moe_layers;         /* over the chunks, the MoE layers */
    double mlp_slot_elems;  /* over the chunks, slots x the chunk's layers' MLP elements per token */
    double mlp_max;         /* the widest MLP of the rank's layers (mlp_width) */
};

static double in_flight_layers(const struct am_recipe *r, const struct am_plan *p, int k, struct rank_slots *rs)
{
    int v = p->virtual_stages, n_micro = (int)p->n_microbatches;
    struct am_pipe_action *actions = malloc(2 * (size_t)n_micro * (size_t)v * sizeof(*actions));
    if (!actions)
        return -1;
    int n = am_pipe_schedule(r->dist.pipeline.schedule, p->pp, v, n_micro, k, actions);
    int slots = 0;
    double slot_layers = 0;
    for (int c = 0; c < v; c++) {
        int sc = am_pipe_slots(actions, n, c);
        if (sc < 1)
            sc = 1; /* the model gives every chunk one slot at least */
        slots += sc;
        const struct am_stage *st = &p->stages[c * p->pp + k];
        slot_layers += (double)sc * st->n_layers;
        for (int l = st->first_layer; l < st->first_layer + st->n_layers; l++) {
            double w = mlp_width(r, p, l);
            rs->mlp_slot_elems += sc * mlp_elems_per_token(r, w);
            rs->mlp_max = w > rs->mlp_max ? w : rs->mlp_max;
        }
        rs->moe_layer_slots += sc * stage_moe_layers(r, &p->stages[c * p->pp + k]);
        rs->moe_layers += stage_moe_layers(r, &p->stages[c * p->pp + k]);
        if (c == 0)
            rs->first = sc;
        if (c == v - 1)
            rs->last = sc;
    }
    rs->total = slots;
    free(actions);
    return slot_layers;
}

/* The buffers the model allocates beside the layers' saved tensors (runtime/model/model.c,
 * layout_acts; moe.c, layout), exactly: per micro-batch slot the first stage's token ids and
 * the last stage's targets, final norm input and output, its inverse rms and the cross
 * entropy's running max and sum; shared by all the slots the residual stream and its
 * gradient, the head's input gradient, the rotary tables, the cross entropy's target logits
 * (and with tp > 1 the shards' max), the grouped-query key/value gradient sums when tp exceeds
 * the key/value heads, the backward's work buffers (hidden, query, attention, key, value, the
 * MLP's three as wide as the rank's widest MLP, qk_norm's key; Gemma's post norm rows and Gemma 3's second pair of rotary
 * tables), with sequence parallelism the gathered stream and a rows'
 * buffer, with context parallelism the ring's buffers (T: the rank's rows of a sequence, whose
 * positions the rotary tables hold), with packed sequences their rotary tables and documents;
 * and for a mixture of experts, per slot the router's counts, probability sums, auxiliary
 * loss and count of targets (the last two in one buffer; with AutoModel's load-balancing loss
 * also each MoE layer's loads and score sums), shared the router's and the
 * experts' gradient buffers. N: tokens of a micro-batch, R: its rows of the residual stream
 * on this rank (N / tp with sequence parallelism). */
static double scratch_bytes(const struct am_recipe *r, const struct am_plan *p, bool emb, bool head,
                            const struct rank_slots *rs)
{
    const struct am_model_config *m = &r->model;
    double tp = p->tp, cs = am_dtype_size(r->compute_dtype);
    bool sp = r->dist.sequence_parallel && p->tp > 1;
    double N = (double)p->microbatch_size * (double)p->seq_length / p->cp, R = sp ? N / tp : N;
    double C = (double)m->hidden_size, D = (double)m->head_dim, T = (double)p->seq_length / p->cp;
    double Hl = (double)(m->num_attention_heads / p->tp);
    double KVl = m->num_key_value_heads >= p->tp ? (double)(m->num_key_value_heads / p->tp) : 1.0;
    double KV = KVl * D;
    double I = rs->mlp_max; /* the widest MLP of the rank's layers */
    /* q's, k's, v's and the attention output's widths (multi-head latent attention: q and k at
     * qk_nope + qk_rope a head, v and the output at v_head_dim) */
    double qkd = (double)am_model_qk_head_dim(m), vd = (double)am_model_v_head_dim(m);
    double Qw = Hl * qkd, Kw = KVl * qkd, Vw = KVl * vd, Ow = Hl * vd;
    double b = 0;
    if (emb)
        b += rs->first * carved(N, 4);
    if (head)
        b += rs->last * (carved(N, 4) + carved(R * C, cs) + carved(N * C, cs) + carved(R, 4) + 2 * carved(N, 4));
    double RH = (double)(am_model_rotary_dim(m) / 2); /* the rotary tables' width */
    b += 2 * carved(R * C, cs) + carved(N * C, cs) + 2 * carved(T * RH, 4) + carved(N, 4);
    if (p->tp > 1)
        b += carved(N, 4);
    if (p->tp > m->num_key_value_heads)
        b += carved(2 * (double)m->num_key_value_heads * D * (C + (m->qkv_bias ? 1 : 0)), 4);
    b += carved(N * C, cs) + carved(N * Qw, cs) + carved(N * Ow, cs) + carved(N * Kw, cs) + carved(N * Vw, cs) +
         carved(N * 3 * I, cs);
    if (m->qk_norm)
        b += carved(N * KV, cs);
    if (m->gemma) /* a post norm's output and its input's gradient */
        b += carved(R * C, cs);
    if (m->mla) { /* multi-head latent attention's work buffer (mla.c, am_mla_scratch_elems): q, kv_a's
                   * and kv_b's outputs, the gradients of the compressed kv and of q_a's output before
                   * and after their norms */
        double dn = (double)m->qk_nope_head_dim, dr = (double)m->qk_rope_head_dim, dv = (double)m->v_head_dim;
        double kvr = (double)m->kv_lora_rank;
        b += carved(N * (Hl * (dn + dr) + kvr + dr + Hl * (dn + dv) + 2 * kvr + 2 * (double)m->q_lora_rank), cs);
    }
    if (m->rope_local_base_freq > 0) /* Gemma 3: the sliding layers' rotary tables */
        b += 2 * carved(T * (D / 2), 4);
    if (sp)
        b += carved(N * C, cs) + carved(R * C, cs);
    if (p->cp > 1) /* ring attention (runtime/model/ring.h): every rank's positions, two k and v blocks
                    * arriving, two travelling dk and dv sums and one step's own terms (fp32), each at k's or
                    * v's width, and in bf16 the fp32 running out / dq sum (one buffer, the wider) */
        b += carved((double)p->seq_length, 4) + 2 * (carved(N * Kw, cs) + carved(N * Vw, cs)) +
             3 * (carved(N * Kw, 4) + carved(N * Vw, 4)) + (cs != 4 ? carved(N * (Qw > Ow ? Qw : Ow), 4) : 0);
    if (r->packed_sequence_size > 0) /* packed sequences (runtime/model/packed.h): the rotary tables of the
                                      * whole sequence and of the micro-batch's rows (Gemma 3: two pairs of
                                      * each), the rank's rows' positions, per slot each row's document start
                                      * and rotary position */
        b += (m->rope_local_base_freq > 0 ? 2 : 1) *
                 (2 * carved((double)p->seq_length * RH, 4) + 2 * carved(N * RH, 4)) +
             carved(T, 4) + rs->total * 2 * carved(N, 4);
    if (r->peft.enabled) { /* LoRA (model.c): an adapter's output and its gradient, as wide as the widest
                            * projection of the rank, and x · Aᵀ's gradient */
        double wide = Qw > C ? Qw : C;
        wide = I > wide ? I : wide;
        if (m->mla) { /* multi-head latent attention: q_a's output, kv_a's and kv_b's (mla.c) */
            double kvw = (double)(m->kv_lora_rank + m->qk_rope_head_dim);
            double kvb = Hl * (double)(m->qk_nope_head_dim + m->v_head_dim), qr = (double)m->q_lora_rank;
            wide = qr > wide ? qr : wide;
            wide = kvw > wide ? kvw : wide;
            wide = kvb > wide ? kvb : wide;
        }
        b += 2 * carved(N * wide, cs) + carved(N * (double)r->peft.dim, cs);
    }
    if (m->num_experts > 0) {
        double E = (double)m->num_experts, k = (double)m->num_experts_per_tok, S = N * k;
        double Im = (double)m->moe_intermediate_size;
        b += rs->total * (2 * carved(E, 4) + carved(2, 8));
        /* the dlogits, dwts and dyp work buffers, at ep 1 also the rows' (dxp, da, dg, du): with ep >
         * 1 these are sized to the loads (expert_rows_bytes) */
        b += carved(N * E, cs) + carved(N * k, 4) + carved(S * C, cs);
        if (p->ep == 1)
            b += carved(S * C, cs) + 3 * carved(S * Im, cs);
        if (m->aux_loss_coeff > 0) /* AutoModel's load-balancing loss: each MoE layer's loads and score sums
                                    * per slot (moe.c) */
            b += rs->moe_layer_slots * carved(2 * E, 4);
        if (m->sigmoid_router) /* glm4_moe: each MoE layer's e_score_correction_bias (fp32) */
            b += rs->moe_layers * carved(E, 4);
        if (m->sigmoid_router && m->gate_bias_update_factor > 0 && rs->moe_layers > 0) /* their update's loads */
            b += carved(rs->moe_layers * E, 8);
        if (r->peft.enabled && r->peft.experts && p->ep == 1) /* the experts' adapters (moe.c): x · Aᵀ of gate
                                                               * and up and of down, recomputed in the
                                                               * backward, and its gradient */
            b += 3 * carved(S * (double)r->peft.experts_dim, cs);
    }
    return b;
}

/* The CUDA kernels' device scratch (kernels/cuda/cuda_impl.h): one buffer, grown to what the
 * largest call of a step asks for and kept, each piece of a call 256-byte aligned. Its largest
 * users at the model's shapes, whichever asks most:
 *   - the head's cross-entropy (kernels/cuda/crossentropy.cu), on the last stage: rows in chunks of
 *     Rc = min(N, 4096, max(64, 2^24 / C)), the vocabulary shard in tiles of
 *     VC = min(V / tp, 2^24 / Rc rounded down to 64): the fp32 logits tile [Rc, VC] (rows of VC
 *     rounded up to 8), with bf16 compute the bf16 dlogits tile and the fp32 dx tile [Rc, C]
 *     (the model's head gradient is fp32, so never the whole of a bf16 dw widened to fp32), and
 *     with LoRA on lm_head in bf16 the fp32 du tile [Rc, r];
 *   - the attention's backward on a stage with layers: cuDNN's (bf16, head size 64 or 128, no
 *     soft cap): an fp32 row sum [N, H], the fp32 dQ accumulator and bf16 dq, dk and dv (cuDNN's
 *     own workspace beside them is cuDNN's to size: not counted); the own kernels' and the
 *     ring's: the fp32 row sum alone.
 * The rest is smaller (RMSNorm's weight gradient: 64 fp32 rows of C; the embedding's sort: 16
 * bytes a token and cub's storage; sum_squares: 8 KiB). On the CPU the kernels take none of
 * it (their workspace holds widened bf16 operands: not counted). N: tokens of a micro-batch
 * (over cp), H and KV: the rank's query and key/value heads. */
static double rup256(long long bytes) { return (double)((bytes + 255) / 256 * 256); }

static double kernel_scratch_bytes(const struct am_recipe *r, const struct am_plan *p, bool head, int layers)
{
    const struct am_model_config *m = &r->model;
    long long N = (long long)p->microbatch_size * p->seq_length / p->cp, C = m->hidden_size > 0 ? m->hidden_size : 1;
    bool bf = r->compute_dtype == AM_BF16;
    double b = 0;
    if (head && N > 0) {
        const long long tile_max = 1LL << 24; /* logits: a tile of 64 MiB of fp32 */
        long long rc = tile_max / C;
        rc = rc < 64 ? 64 : rc > 4096 ? 4096 : rc;
        rc = N < rc ? N : rc;
        long long V = m->vocab_size / p->tp, vc = tile_max / rc / 64 * 64;
        vc = vc < 64 ? 64 : vc;
        vc = V < vc ? V : vc;
        long long tile = rc * ((vc + 7) / 8 * 8);
        double ce = rup256(tile * 4) + (bf ? rup256(tile * 2) + rup256(rc * C * 4) : 0);
        if (bf && r->peft.enabled && (r->peft.targets >> AM_LORA_HEAD & 1u)) /* LoRA on lm_head: the fp32 du tile */
            ce += rup256(rc * r->peft.dim * 4);
        b = ce > b ? ce : b;
    }
    if (layers > 0 && N > 0) {
        long long D = m->head_dim, H = m->num_attention_heads / p->tp;
        long long KV = m->num_key_value_heads >= p->tp ? m->num_key_value_heads / p->tp : 1;
        double attn = rup256(N * H * 4);
        if (bf && (D == 64 || D == 128) && m->attn_logit_softcapping <= 0 && !m->gemma)
            attn += rup256(N * H * D * 4) + rup256(N * H * D * 2) + 2 * rup256(N * KV * D * 2);
        b = attn > b ? attn : b;
    }
    return b;
}

/* The ZeRO stage am-train runs for a recipe (am_plan.zero_stage): fsdp2 shards weights,
 * gradients and optimizer state over dp_shard (ZeRO-3, train/fsdp.h) when there is more than
 * one shard (HSDP: within each replica group, the shards' gradients all-reduced over the
 * replicas); megatron_fsdp its zero_dp_strategy over dp * cp; every other case keeps a full
 * replica on each rank and all-reduces the gradients (ddp). LoRA: stage 3 shards the frozen
 * base's weights as it shards any weights (train/dp.h; the adapters whole on every rank, their
 * gradients all-reduced); below it nothing is sharded (the base has no gradients or optimizer
 * state, the adapters are not sharded): 0. */
static int trainer_zero_stage(const struct am_recipe *r, const struct am_plan *p)
{
    int zero = 0;
    if (r->dist.strategy == AM_MEGATRON_FSDP && p->dp * p->cp > 1)
        zero = r->dist.zero_dp_strategy; /* over dp * cp (validated: no HSDP) */
    else if (r->dist.strategy == AM_FSDP2 && p->dp_shard * p->cp > 1)
        zero = 3;
    return r->peft.enabled && zero < 3 ? 0 : zero;
}

/* fsdp2 as am-train shards (train/fsdp.h): each group (the embedding, each layer, the final
 * norm with the head) padded to a multiple of D elements, a flat shard of 1/D of it per rank. */
struct flat_shards {
    long long D, shard, slab, max_span;
    bool f32;                       /* the gradients reduced in fp32 (reduce_dtype) */
    bool g16_replicas;              /* bf16 gradient shards with HSDP's replicas */
    long long buf_span, buf_shard;  /* of the groups that take a gradient buffer: the largest span and shard
                                     * (experts: over fewer ranks) */
    long long direct_span;          /* of those that accumulate in their shard: the largest span */
};

static long long lcm(long long a, long long b)
{
    long long x = a, y = b;
    while (y) {
        long long t = x % y;
        x = y;
        y = t;
    }
    return a / x * b;
}

/* A group of elems parameters, padded to a multiple of D and sharded over d ranks (D for the
 * dense groups; for the experts with expert parallelism the ranks holding the same experts,
 * padded to a multiple of both: with HSDP d need not divide D), replicated over HSDP's replicas
 * or not. Whether it takes a gradient buffer (from stage 2): unless d is one rank and the
 * reduction fp32, when its gradients accumulate in its shard (train/grad_sync.h), but for bf16
 * shards whose group has replicas. */
static bool add_group_over(struct flat_shards *f, double elems, long long d, bool replicated)
{
    long long n = (long long)elems, pad = lcm(f->D, d), span = (n + pad - 1) / pad * pad;
    f->shard += span / d;
    f->slab += span;
    if (span > f->max_span)
        f->max_span = span;
    if (d == 1 && f->f32 && !(f->g16_replicas && replicated)) {
        if (span > f->direct_span)
            f->direct_span = span;
        return false;
    }
    if (span > f->buf_span)
        f->buf_span = span;
    if (span / d > f->buf_shard)
        f->buf_shard = span / d;
    return true;
}

static bool add_group(struct flat_shards *f, double elems) { return add_group_over(f, elems, f->D, true); }

/* LoRA's trainable parameters on one tensor-parallel rank: of layer l (head false) or of the
 * head. A column-parallel base layer (q, k, v, gate, up, the head) splits B by rows and keeps A
 * whole; a row-parallel one (o, down) splits A by columns and keeps B whole. A DeepSeekMoE MoE
 * layer's MLP projections are its shared experts' (n_shared_experts x moe_intermediate_size). */
static double lora_rank_params(const struct am_recipe *r, const struct am_plan *p, bool head, long l)
{
    const struct am_model_config *m = &r->model;
    if (!r->peft.enabled)
        return 0;
    double tp = p->tp, h = (double)m->hidden_size, q = (double)m->num_attention_heads * (double)m->head_dim;
    double kv_rank = (m->num_key_value_heads >= p->tp ? (double)m->num_key_value_heads / tp : 1.0) *
                     (double)m->head_dim;
    double I = (double)m->intermediate_size, d = (double)r->peft.dim, n = 0;
    if (!head && m->num_experts > 0 && am_model_layer_is_moe(m, l))
        I = (double)(m->n_shared_experts * m->moe_intermediate_size);
    double H = (double)m->num_attention_heads, qr = (double)m->q_lora_rank, kvr = (double)m->kv_lora_rank;
    double dn = (double)m->qk_nope_head_dim, dr = (double)m->qk_rope_head_dim, dv = (double)m->v_head_dim;
    /* multi-head latent attention: q_b_proj (q_proj) and kv_b_proj split by heads as
     * column-parallel layers, o_proj as a row-parallel one, q_a_proj and kv_a_proj_with_mqa
     * replicated (their adapters whole) */
    double in_out[AM_LORA_NTARGETS][2] = {
        {h, q / tp}, {h, kv_rank}, {h, kv_rank}, {q / tp, h}, {h, I / tp}, {h, I / tp}, {I / tp, h},
        {h, qr}, {h, kvr + dr}, {kvr, H * (dn + dv) / tp}, {h, (double)m->vocab_size / tp}};
    if (m->mla) {
        in_out[AM_LORA_Q][0] = qr > 0 ? qr : h, in_out[AM_LORA_Q][1] = H * (dn + dr) / tp;
        in_out[AM_LORA_O][0] = H * dv / tp;
    }
    for (int t = head ? AM_LORA_HEAD : 0; t < (head ? AM_LORA_NTARGETS : AM_LORA_HEAD); t++)
        if ((r->peft.targets & (1u << t)) && !(t >= AM_LORA_GATE && t <= AM_LORA_DOWN && I <= 0))
            n += d * (in_out[t][0] + in_out[t][1]);
    return n;
}

/* Fills out for pp rank k. Returns 0, or -1 when out of memory. */
static int memory_of_rank(const struct am_recipe *r, const struct am_plan *p, int k, struct am_memory *out)
{
    const struct am_model_config *m = &r->model;
    const struct am_param_count *pc = &p->params;
    double tp = p->tp, h = (double)m->hidden_size, hd = (double)m->head_dim;
    double q = (double)m->num_attention_heads * hd;
    double kv_rank = (m->num_key_value_heads >= p->tp ? (double)m->num_key_value_heads / tp : 1.0) * hd;
    double attn = 2 * h * q / tp + 2 * h * kv_rank + (m->qk_norm ? 2 * hd : 0) +
                  (m->qkv_bias ? q / tp + 2 * kv_rank : 0) /* qwen2's q, k, v biases: split as their rows */
                  + (m->o_bias ? h : 0) + (m->gpt_oss ? (double)m->num_attention_heads / tp : 0); /* gpt_oss: o's bias
                                                                              whole, the sinks split with the heads */
    if (m->mla) { /* multi-head latent attention: q_b_proj (q_proj), kv_b_proj and o_proj split by heads,
                   * q_a_proj, kv_a_proj_with_mqa and their norms whole (runtime/model/model.h) */
        double nh = (double)m->num_attention_heads, qr = (double)m->q_lora_rank, kvr = (double)m->kv_lora_rank;
        double qk = (double)(m->qk_nope_head_dim + m->qk_rope_head_dim), vd = (double)m->v_head_dim;
        attn = (qr > 0 ? h * qr + qr + qr * nh * qk / tp : h * nh * qk / tp) +
               h * (kvr + (double)m->qk_rope_head_dim) + kvr + kvr * nh * ((double)m->qk_nope_head_dim + vd) / tp +
               nh * vd * h / tp;
    }
    /* a layer's parameters but the experts (dense), and its experts: a MoE model's dense
     * layers (qwen3_moe's mlp_only_layers) have the MLP instead of the router and experts,
     * counted per layer of the rank (their share differs between stages) */
    double mlp = 3 * h * (double)m->intermediate_size / tp, router = 0, experts = 0;
    if (m->num_experts > 0) { /* the router, with glm4_moe's shared experts (split over tp as an MLP) */
        router = h * (double)m->num_experts + 3 * h * (double)(m->n_shared_experts * m->moe_intermediate_size) / tp;
        experts = (double)m->num_experts * 3 * h * (double)m->moe_intermediate_size / p->ep;
        if (m->gpt_oss) { /* the router's bias; the experts' biases (gate and up [I], down [C]) */
            router += (double)m->num_experts;
            experts += (double)m->num_experts * (2 * (double)m->moe_intermediate_size + h) / p->ep;
        }
    }
    double dense = 0, dense_params = 0, expert_params = 0; /* dense + experts: the largest layer */
    int layers = 0;
    bool emb = false, head = false;
    for (int s = 0; s < p->n_stages; s++) {
        if (p->stages[s].pp_rank != k)
            continue;
        layers += p->stages[s].n_layers;
        emb |= p->stages[s].embedding;
        head |= p->stages[s].head;
        for (int l = p->stages[s].first_layer; l < p->stages[s].first_layer + p->stages[s].n_layers; l++) {
            bool moe = m->num_experts > 0 && am_model_layer_is_moe(m, l);
            double d = attn + pc->norms_per_layer + (moe ? router : mlp), e = moe ? experts : 0;
            dense_params += d;
            expert_params += e;
            if (d + e > dense)
                dense = d + e;
        }
    }
    double experts_of_layer = experts;
    experts = 0; /* dense holds the largest layer whole */
    if (emb)
        dense_params += pc->embedding / tp;
    if (head)
        dense_params += pc->final_norm + (m->tie_word_embeddings && emb ? 0 : pc->embedding / tp);

    /* bytes per parameter, as am-train allocates them: master weights in the storage dtype and
     * Adam's two moments in theirs (torch's AdamW: both model.torch_dtype, as torch keeps
     * parameters and AdamW's state: 4 + 8 in fp32, 2 + 4 in bf16; FusedAdam: the masters in
     * master_weight_dtype with master_weights, each moment in its exp_avg(_sq)_dtype), fp32
     * gradients (4; fsdp2's bf16 shards 2, below); with a compute dtype other than the storage's
     * (mixed precision over fp32 masters) a copy of the weights in it (+2 B for bf16), and with a
     * bf16 reduce_dtype the gradients' copy that the data-parallel all-reduce sums (+2 B, only when
     * there is more than one data-parallel rank). FusedAdam's store_param_remainders keeps the
     * fp32 master as the bf16 parameter (2) and a 16-bit remainder, counted with the moments
     * (+2 B: optim.h). */
    double cs = am_dtype_size(r->compute_dtype), ss = am_dtype_size(r->optim.master_dtype);
    double ms = (double)am_dtype_size(r->optim.moment_dtype[0]) + am_dtype_size(r->optim.moment_dtype[1]) +
                (r->optim.split_master ? 2 : 0);
    double wb = ss + (cs != ss ? cs : 0);
    double gb = 4 + (p->dp > 1 && am_dtype_size(r->reduce_dtype) < 4 ? am_dtype_size(r->reduce_dtype) : 0);
    /* the ranks each strategy's sharding spans; what it shards is p->zero_stage (nothing today) */
    double shard = 1, expert_shard = 1;
    int zero = p->zero_stage;
    if (r->dist.strategy == AM_FSDP2) {
        shard = (double)p->dp_shard * p->cp;
        expert_shard = (double)p->ep_shard; /* with HSDP too: across the replica groups (AutoModel's ep_shard) */
    } else if (r->dist.strategy == AM_MEGATRON_FSDP) {
        shard = expert_shard = (double)p->dp * p->cp;
    }
    double wshard = zero >= 3 ? shard : 1, gshard = zero >= 2 ? shard : 1, oshard = zero >= 1 ? shard : 1;
    double ewshard = zero >= 3 ? expert_shard : 1, egshard = zero >= 2 ? expert_shard : 1,
           eoshard = zero >= 1 ? expert_shard : 1;
    out->pp_rank = k;
    out->grad_buffers = 0;
    out->params = dense_params + expert_params;
    out->weights = wb * (dense_params / wshard + expert_params / ewshard);
    out->grads = gb * (dense_params / gshard + expert_params / egshard);
    out->optimizer = ms * (dense_params / oshard + expert_params / eoshard);
    /* ZeRO-3 gathers each layer before use; the next one is prefetched */
    out->gathered = zero >= 3 && layers ? 2 * cs * (dense + experts) : 0;
    if (zero >= 1 && r->dist.strategy != AM_DDP) {
        /* exactly what am-train allocates: master shards (and their compute copy; below stage
         * 3 the full masters and their compute copy instead, all-gathered after each step),
         * the gradients (below), Adam's moments
         * of the shards, and from stage 3 two gathered groups (three when the head shares the
         * embedding; four with MoE layers: a layer and its experts, and the next two) */
        double glp = am_dtype_size(r->reduce_dtype) < 4 ? am_dtype_size(r->reduce_dtype) : 0;
        bool g16 = r->grad_shard_dtype == AM_BF16;
        struct flat_shards f = {.D = (long long)shard, .f32 = glp == 0, .g16_replicas = g16 && p->dp_replicate > 1};
        int moe_layers = 0, buffered_experts = 0; /* the MoE layers, and those whose experts take a buffer */
        bool buffered = false;                    /* any group takes one */
        if (emb)
            buffered |= add_group(&f, pc->embedding / tp);
        for (int s = 0; s < p->n_stages; s++)
            for (int l = 0; p->stages[s].pp_rank == k && l < p->stages[s].n_layers; l++) {
                bool moe = m->num_experts > 0 && am_model_layer_is_moe(m, p->stages[s].first_layer + l);
                buffered |= add_group(&f, attn + pc->norms_per_layer + (moe ? router : mlp));
                if (moe) { /* a MoE layer's experts: a group of their own, gathered with the layer */
                    bool b = add_group_over(&f, experts_of_layer, (long long)expert_shard, p->ep == 1);
                    buffered |= b;
                    buffered_experts += b;
                    moe_layers++;
                }
            }
        if (head)
            buffered |= add_group(&f, pc->final_norm + (m->tie_word_embeddings && emb ? 0 : pc->embedding / tp));
        /* LoRA's frozen base (stage 3) in mixed precision: its shards in the compute dtype alone */
        double swb = r->peft.enabled && cs != ss ? cs : wb;
        out->weights = zero >= 3 ? swb * (double)f.shard : wb * (double)f.slab + ss * (double)f.shard;
        /* stage 1: the full-size gradients (and their reduce_dtype copy) and the shards; from
         * stage 2 (train/grad_sync.h) the shards and a few per-group buffers of the largest span
         * of the groups that take one (two; three when the head shares the embedding; four with
         * MoE layers whose experts take one; one more for a tied embedding split over two
         * stages; none when no group takes one), each with its reduce_dtype copy and its
         * receive shard (grad_buffers), and with HSDP in bf16 the shards' copy all-reduced over
         * the replicas. A group sharded over one rank (the experts with ep_shard 1) with an fp32
         * reduction takes none: its gradients accumulate in its shard.
         * fsdp2 with bf16 parameters (model.torch_dtype bfloat16, also under FusedAdam's fp32
         * masters) keeps the shards in bf16, as FSDP2 keeps a sharded gradient in the parameter's
         * dtype (2 B a parameter, not 4), and those groups then stage each backward's fp32
         * gradients in one buffer of the largest one's span, with its bf16 copy (4 + 2 B, in
         * grad_buffers); with HSDP each backward's reduced shard is all-reduced over the replicas
         * in its receive shard before it is rounded (no copy of the shards; a group over one rank
         * with replicas takes a buffer: train/grad_sync.h). megatron_fsdp keeps fp32 shards. */
        if (zero >= 2) {
            double nb = !buffered ? 0
                                  : (buffered_experts ? 4 : m->tie_word_embeddings && emb && head ? 3 : 2) +
                                        (m->tie_word_embeddings && p->pp > 1 && (emb || head) ? 1 : 0);
            out->grads = (g16 ? 2 : 4) * (double)f.shard +
                         (glp && p->dp_replicate > 1 && !g16 ? glp * (double)f.shard : 0);
            out->grad_buffers = nb * (double)f.buf_span * (4 + glp) + nb * (double)f.buf_shard * (glp ? glp : 4) +
                                (g16 ? (4 + 2) * (double)f.direct_span : 0);
        } else {
            out->grads = (4 + glp) * (double)f.slab + 4 * (double)f.shard;
        }
        out->optimizer = ms * (double)f.shard;
        int slots = !r->dist.reshard_after_forward ? (emb ? 1 : 0) + layers + moe_layers + (head ? 1 : 0)
                    : moe_layers ? 4 : m->tie_word_embeddings && emb && head ? 3 : 2;
        out->gathered = zero >= 3 ? slots * cs * (double)f.max_span : 0;
    }

    double tokens = (double)(p->pp > 1 ? p->microbatch_size : p->local_batch) * (double)p->seq_length / p->cp;
    double layer_but_mlp = tokens * act_elems_per_token(r, p) * cs;
    struct rank_slots rs = {0};
    double flight = in_flight_layers(r, p, k, &rs);
    if (flight < 0)
        return -1;
    if (r->dist.activation_checkpointing) {
        double saved = tokens * h * cs / (r->dist.sequence_parallel ? tp : 1);
        /* each layer's input per slot, one layer's other tensors shared (its MLP the rank's widest) */
        double work = layer_but_mlp + tokens * mlp_elems_per_token(r, rs.mlp_max) * cs;
        out->activations = flight * saved + (layers ? work - saved : 0);
    } else {
        out->activations = flight * layer_but_mlp + tokens * rs.mlp_slot_elems * cs;
    }
    out->activations += rs.moe_layer_slots * tokens * moe_elems_per_token(r, p) * cs;
    if (m->num_experts > 0) /* each slot's counts per expert, and with ep those received from the ep ranks */
        out->activations += rs.moe_layer_slots * (p->ep > 1 ? 2 : 1) * carved((double)m->num_experts, 4);
    /* the executor's send buffers each way (a ring of one per slot; with interleaving one per
     * micro-batch and chunk) and one receive buffer (pipeline.h) */
    double sends = p->virtual_stages == 1 ? flight / layers : (double)p->virtual_stages * (double)p->n_microbatches;
    /* with the load-balancing loss its statistics follow each hidden state (f32 [2 E + 1]) */
    double trailer = m->num_experts > 0 && am_model_hf_aux(m) && am_model_moe_layers(m) > 0
                         ? (2 * (double)m->num_experts + 1) * 4 : 0;
    out->p2p = p->pp == 1 ? 0 : (1 + 2 * sends) * (tokens * h * cs / (r->dist.sequence_parallel ? tp : 1) + trailer);
    out->scratch = scratch_bytes(r, p, emb, head, &rs);
    out->kernel_scratch = kernel_scratch_bytes(r, p, head, layers);
    /* the all-to-all's send buffer (moe.c): the rank's own slots, 64-byte aligned as allocated;
     * the rows received are sized to the loads: planned at the balanced load, S rows a MoE layer
     * on every rank, as AutoModel and Megatron plan (their worst, every slot of the ep group
     * routed to this rank's experts: ep x S) */
    out->alltoall = out->expert_rows = out->expert_rows_worst = 0;
    if (p->ep > 1 && m->num_experts > 0) {
        double S = (double)p->microbatch_size * (double)p->seq_length / p->cp * (double)m->num_experts_per_tok;
        out->alltoall = carved(S * h, cs);
        out->expert_rows = expert_rows_bytes(r, p, rs.moe_layer_slots, S);
        out->expert_rows_worst = expert_rows_bytes(r, p, rs.moe_layer_slots, S * p->ep);
    }
    if (r->peft.enabled) {
        /* LoRA: the base weights frozen (held as above: whole, or from stage 3 the shards and the
         * gathered groups; without gradients, their buffers or optimizer state); the adapters,
         * replicated on every data-parallel rank (their gradients all-reduced), have master
         * weights (and their compute copy), gradients (and the reduce_dtype copy) and Adam's
         * moments */
        double ad = head ? lora_rank_params(r, p, true, 0) : 0, ad_layers = 0;
        for (int s = 0; s < p->n_stages; s++)
            for (int l = 0; p->stages[s].pp_rank == k && l < p->stages[s].n_layers; l++)
                ad_layers += lora_rank_params(r, p, false, p->stages[s].first_layer + l);
        ad += ad_layers;
        if (r->peft.experts) { /* the adapters of the rank's experts (ep's share; whole on every tp rank), in
                                * a group of their own after the others (moe.h) */
            double moe_here = 0;
            for (int s = 0; s < p->n_stages; s++)
                for (int l = 0; p->stages[s].pp_rank == k && l < p->stages[s].n_layers; l++)
                    moe_here += am_model_layer_is_moe(m, p->stages[s].first_layer + l);
            ad += moe_here * (double)m->num_experts / p->ep * (double)r->peft.experts_dim *
                  (2 * h + 3 * (double)m->moe_intermediate_size);
        }
        /* their reduce_dtype copy where they are all-reduced: over dp x cp */
        double lgb = 4 + (p->dp * p->cp > 1 && am_dtype_size(r->reduce_dtype) < 4 ? am_dtype_size(r->reduce_dtype) : 0);
        out->adapter_params = ad;
        out->grad_buffers = 0;
        out->grads = lgb * ad;
        out->optimizer = ms * ad;
        out->weights += wb * ad;
    }
    out->total = out->weights + out->grads + out->grad_buffers + out->optimizer + out->gathered + out->activations +
                 out->scratch + out->kernel_scratch + out->p2p + out->alltoall + out->expert_rows;
    return 0;
}

/* ---- the plan ------------------------------------------------------------------------ */

void am_plan_free(struct am_plan *p)
{
    free(p->stages);
    free(p->mem_pp);
    p->stages = NULL;
    p->mem_pp = NULL;
}

static int out_of_memory(const struct am_recipe *r, struct am_errors *err)
{
    am_errorf(err, NULL, "%s: out of memory while planning", r->file);
    return -1;
}

int am_plan_build(const struct am_recipe *r, const struct am_world *w, struct am_plan *p, struct am_errors *err)
{
    memset(p, 0, sizeof(*p));
    if (am_validate(r, w, err) > 0 || r->model.num_hidden_layers <= 0)
        return -1;
    p->world = w->size;
    p->tp = r->dist.tp;
    p->pp = r->dist.pp;
    p->cp = r->dist.cp;
    p->ep = r->dist.ep;
    p->dp = w->size / (p->tp * p->pp * p->cp);
    p->dp_replicate = r->dist.dp_replicate > 1 ? r->dist.dp_replicate : 1;
    p->dp_shard = p->dp / p->dp_replicate;
    p->ep_shard = p->dp * p->cp / p->ep;
    if (build_stages(r, p) < 0)
        return out_of_memory(r, err);
    p->global_batch = r->steps.global_batch;
    p->local_batch = r->steps.local_batch;
    p->grad_accum = p->global_batch / (p->local_batch * p->dp);
    p->microbatch_size = p->pp > 1 ? r->dist.pipeline.microbatch_size : p->local_batch;
    p->n_microbatches = p->local_batch / p->microbatch_size;
    p->seq_length = am_recipe_seq_length(r, &p->seq_length_assumed);
    am_model_params(&r->model, &p->params);
    p->zero_stage = trainer_zero_stage(r, p);

    if ((double)p->n_microbatches * p->virtual_stages > AM_PLAN_MAX_PIPE_PASSES) {
        struct am_pos pos = {.file = r->file};
        am_errorf(err, &pos, "the pipeline schedule runs %.0f forward passes per rank and step (micro-batches %ld x "
                  "virtual stages %d), more than the %d am can plan (use a larger "
                  "distributed.pipeline.pp_microbatch_size or a smaller step_scheduler.local_batch_size)",
                  (double)p->n_microbatches * p->virtual_stages, p->n_microbatches, p->virtual_stages,
                  AM_PLAN_MAX_PIPE_PASSES);
        return -1;
    }
    free(p->mem_pp);
    if (!(p->mem_pp = calloc((size_t)p->pp, sizeof(*p->mem_pp))))
        return out_of_memory(r, err);
    for (int k = 0; k < p->pp; k++) {
        struct am_memory *m = &p->mem_pp[k];
        if (memory_of_rank(r, p, k, m) < 0)
            return out_of_memory(r, err);
        if (k == 0 || m->total > p->mem.total)
            p->mem = *m;
    }
    const struct am_model_config *m = &r->model;
    double attn_width = (double)m->num_attention_heads * (double)m->head_dim;
    if (m->mla) /* multi-head latent attention: scores over qk_nope + qk_rope, outputs over v_head_dim */
        attn_width = (double)m->num_attention_heads *
                     ((double)(m->qk_nope_head_dim + m->qk_rope_head_dim) + (double)m->v_head_dim) / 2;
    p->tokens_per_step = (double)p->global_batch * (double)p->seq_length;
    /* PaLM (Chowdhery et al. 2022, appendix B): 6N + 12*L*H*Q*T per token */
    /* LoRA: the frozen base computes no weight gradients (4N: forward and the input
     * gradients), the adapters all three (6 per adapter parameter) */
    double matmul = 6 * p->params.active_per_token;
    if (r->peft.enabled)
        matmul = 4 * p->params.active_per_token +
                 6 * (am_lora_layers_params(r) + am_lora_head_params(r) +
                      (r->peft.experts ? am_lora_expert_params(r, false) * (double)m->num_experts_per_tok /
                                             (double)m->num_experts : 0));
    p->flops_per_step = p->tokens_per_step * (matmul +
                                              12.0 * (double)m->num_hidden_layers * attn_width * (double)p->seq_length);
    return 0;
}

const char *am_format_bytes(double n, char *buf, size_t len)
{
    const double gib = 1024.0 * 1024 * 1024;
    if (n >= gib)
        snprintf(buf, len, "%.1f GiB", n / gib);
    else
        snprintf(buf, len, "%.1f MiB", n / (1024.0 * 1024));
    return buf;
}

/* ---- what would fit ------------------------------------------------------------------ */

struct knob {
    char text[96];
    double total;
};

static void try_knob(const struct am_recipe *variant, const struct am_world *w, const char *text,
                     struct knob *out, int *n)
{
    struct am_errors scratch;
    struct am_plan p;
    am_errors_init(&scratch);
    if (am_plan_build(variant, w, &p, &scratch) == 0 && p.mem.total <= w->gpu_mem) {
        snprintf(out[*n].text, sizeof(out[*n].text), "%s", text);
        out[*n].total = p.mem.total;
        (*n)++;
    }
    am_plan_free(&p);
    am_errors_free(&scratch);
}

int am_plan_check_memory(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                         struct am_errors *err)
{
    if (w->gpu_mem <= 0 || p->mem.total <= w->gpu_mem)
        return 0;
    struct knob fits[8];
    int n = 0;
    char text[96];
    struct am_recipe v;
    /* fully sharded data parallelism over every data-parallel rank (fsdp2, dp_shard = dp)
     * where the recipe keeps full replicas */
    if (p->zero_stage == 0 && p->dp > 1) {
        v = *r;
        v.dist.strategy = AM_FSDP2;
        v.dist.dp_replicate = 0;
        try_knob(&v, w, r->dist.strategy == AM_FSDP2 ? "distributed.dp_replicate_size=1" : "distributed.strategy=fsdp2",
                 fits, &n);
    }
    if (!r->dist.activation_checkpointing) {
        v = *r;
        v.dist.activation_checkpointing = true;
        try_knob(&v, w, "distributed.activation_checkpointing=true", fits, &n);
    }
    if (r->dist.tp > 1 && !r->dist.sequence_parallel) {
        v = *r;
        v.dist.sequence_parallel = true;
        try_knob(&v, w, "distributed.sequence_parallel=true", fits, &n);
    }
    for (int f = 2; f <= 8; f *= 2) {
        v = *r;
        v.dist.pp = r->dist.pp * f;
        v.dist.dp = 0;
        snprintf(text, sizeof(text), "distributed.pp_size=%d", v.dist.pp);
        int before = n;
        try_knob(&v, w, text, fits, &n);
        if (n > before)
            break;
    }
    if (r->dist.strategy != AM_DDP) {
        v = *r;
        v.dist.tp = r->dist.tp * 2;
        v.dist.dp = 0;
        snprintf(text, sizeof(text), "distributed.tp_size=%d", v.dist.tp);
        try_knob(&v, w, text, fits, &n);
    }
    char list[8 * 128] = "", a[32], b[32], c[32], d[32];
    for (int i = 0; i < n; i++) {
        size_t l = strlen(list);
        snprintf(list + l, sizeof(list) - l, "%s%s (%s)", i ? ", " : "", fits[i].text,
                 am_format_bytes(fits[i].total, a, sizeof(a)));
    }
    struct am_pos pos = {.file = r->file};
    am_errorf(err, &pos, "estimated memory per GPU %s exceeds the GPU's %s by %s; %s%s",
              am_format_bytes(p->mem.total, b, sizeof(b)), am_format_bytes(w->gpu_mem, c, sizeof(c)),
              am_format_bytes(p->mem.total - w->gpu_mem, d, sizeof(d)),
              n ? "it fits with " : "no single change of strategy, activation_checkpointing, sequence_parallel, "
              "pp_size or tp_size makes it fit (use more GPUs or a smaller local_batch_size)", list);
    return -1;
}
