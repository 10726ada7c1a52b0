/* moe.c - the mixture-of-experts block (moe.h) over the kernel table. */
#include "moe.h"
#include "model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "log.h"
#include "packed.h"
#include "ring.h"
#include "util.h"

/* One MoE layer's saved tensors for one micro-batch. */
struct moe_acts {
    struct am_tensor logits, probs, idx, wts, pos, counts, xp, g, u, act, yp;
    int64_t *hcount; /* the host's copy of counts */
    /* expert parallelism (ep > 1): the all-to-all's rows to and from each ep rank, the rows of
     * each local expert, the received rows' places in local-expert order (pos2, [R] i32) and
     * the per-(source rank, local expert) counts as received (rcounts, [ep, El] i32) */
    int64_t *send_rows, *recv_rows, *lcount, *rc;
    int64_t recv_total;
    struct am_tensor pos2, rcounts;
    /* ep > 1: xp, g, u, act and pos2 are recv_total rows of the slot's pool (moe_slot) from row
     * r0, held for the micro-batch of the slot's generation gen */
    int64_t r0, held;
    unsigned gen;
    struct am_tensor am_stats; /* AutoModel's load-balancing loss: the layer's [load E | score sums E] f32 of
                                  the micro-batch (summed over cp), kept from its forward for the backward */
    int slot;        /* the model's slot whose micro-batch these are */
    bool moe;        /* the layer has experts (dense layers' entries are unused) */
};

struct moe_slot {
    struct am_tensor cnt, psum, aux; /* load-balancing statistics [E] f32, and aux (one f64) */
    struct am_tensor valid;          /* cp > 1: the micro-batch's tokens with a target, summed over the cp
                                        group (one i64, beside aux in its 64 bytes) */
    float aux_scale;                 /* the gradient of the loss with respect to Σ cnt·psum terms */
    /* ep > 1: the saved expert rows of the slot's micro-batch (moe.h): one allocation of cap rows,
     * as [cap] i32 (pos2), [cap, C] (xp), [cap, I] three times (g, u, act), each MoE layer's rows
     * a run of them from its r0; used rows so far in the micro-batch; gen counts the micro-batches */
    char *pool;
    int64_t cap, used, plan_rows;
    unsigned gen;
};

struct am_moe {
    int64_t E, k, I, C;
    int ep, ep_rank;         /* the expert-parallel group's size and this rank's place in it */
    int64_t El, e0;          /* the experts held here: El of them from global index e0 */
    struct am_tensor t1, t2, ts; /* ep > 1: the all-to-all's buffers, [R, C] twice (the work rows) and [S, C] */
    char *work;              /* ep > 1: the work rows (moe.h), work_cap rows of work_row bytes: t1, t2, dxp
                                [., C], da, dg, du [., I], with LoRA on the experts lt, ltd, ldt [., r] */
    int64_t work_cap;
    size_t saved_row, work_row; /* ep > 1: the bytes of one saved row and of one work row */
    int64_t max_S;           /* micro-batch tokens x top_k: the balanced load of a MoE layer */
    int64_t step_rows_max;   /* ep > 1: the most rows one slot's MoE layers received for a micro-batch
                                over the step */
    int64_t step_layer_max;  /* ep > 1: the most rows one MoE layer received over the step */
    bool fail_growth;        /* ep > 1: the next saved rows' growth is due and fails (am_moe_fail_growth) */
    size_t *cnt_sz;          /* ep > 1: counts and displacements for am_alltoallv, 4 x ep */
    bool renorm, aux_on;
    bool sigmoid;            /* glm4_moe's router (moe.h) */
    bool update;             /* the selection bias is updated (gate_bias_update_factor > 0) */
    float factor;            /* deepseek_v3: gate_bias_update_factor, as AutoModel's fp32 product takes it */
    int n_local;             /* the MoE layers held by this rank (every chunk's) */
    int64_t *layer_loads;    /* factor > 0: tokens per expert of each held layer over the step, by
                                the model's layer index [n_layers, E] (dense layers' rows unused) */
    struct am_tensor loads;  /* factor > 0: the held MoE layers' loads in order, [n_local E] i64, for
                                the sum over dp x cp (am_moe_bias_loads) */
    int64_t *sum_host;       /* factor > 0: the summed loads as downloaded, [n_local E] */
    float *bias_host;        /* factor > 0: a bias as downloaded, [E] */
    int32_t *idx_host;       /* factor > 0: a micro-batch's choices as downloaded, [max_tokens k], for the loads
                                of packed sequences' rows that are no pad */
    int n_group, topk_group;
    float scale;             /* routed_scaling_factor */
    double coef;
    bool am_aux;             /* AutoModel's load-balancing loss (aux_loss_coeff > 0; moe.h) */
    double am_coef;          /* aux_loss_coeff */
    double am_div;           /* dp x micro-batches of a step per rank (am_moe_set_aux_div) */
    int n_moe;               /* the model's MoE layers */
    struct moe_acts *acts;   /* by index into m->acts_mem */
    struct moe_slot *slots;  /* by the model's slot index */
    struct am_tensor dlogits, dwts, dyp, da, dg, du, dxp; /* backward scratch */
    struct am_tensor lt, ltd, ldt; /* LoRA on the experts: x · Aᵀ, a · A_dᵀ and their gradient, [R, r] */
    float lscale;                  /* their scale, lora_alpha / their rank (experts_r) */
    void *mem;
    int64_t *host;           /* every hcount */
    int32_t *h32;            /* the counts as downloaded */
    int64_t *step_counts;    /* tokens per expert over the step */
    int64_t *ep_host;        /* ep > 1: every acts entry's send_rows, recv_rows, lcount, rc */
    int last_slot;
    double a2a_s;            /* seconds in the all-to-alls over the step */
    double dispatch_s;       /* seconds in the routed block outside the experts over the step (moe.h) */
    double experts_s;        /* seconds in the experts over the step (moe.h) */
    int64_t step_recv;       /* ep > 1: token rows this rank's experts received over the step */
};

int am_moe_check(const struct am_model_config *cfg, const struct am_model_shard *sh, char *err, size_t err_len)
{
    if (cfg->num_experts <= 0)
        return 0;
    if (sh->tp > 1 && sh->sequence_parallel)
        return am_fail(err, err_len, "model: %s with sequence parallelism: the experts are replicated over the "
                       "tensor-parallel ranks and take every token, not a rank's share (set "
                       "distributed.sequence_parallel: false)", cfg->model_type);
    if (sh->ep > 1 && cfg->num_experts % sh->ep)
        return am_fail(err, err_len, "model: ep_size %d does not divide %s's %d experts: each ep rank holds "
                       "num_experts / ep_size of them (use an ep_size that divides %d)", sh->ep, cfg->model_type,
                       (int)cfg->num_experts, (int)cfg->num_experts);
    if (cfg->aux_loss_coeff > 0 && am_model_hf_aux(cfg))
        return am_fail(err, err_len, "model: %s with both load-balancing losses, transformers' (output_router_logits) "
                       "and AutoModel's (aux_loss_coeff %g): a model computes one of them (set output_router_logits: "
                       "false, or moe_overrides.aux_loss_coeff: 0)", cfg->model_type, cfg->aux_loss_coeff);
    if (cfg->n_shared_experts > 0 && (cfg->n_shared_experts * cfg->moe_intermediate_size) % sh->tp)
        return am_fail(err, err_len, "model: tp_size %d does not divide the shared experts' width %ld (n_shared_experts "
                       "x moe_intermediate_size), which tp splits as an MLP (use a tp_size that divides it)", sh->tp,
                       cfg->n_shared_experts * cfg->moe_intermediate_size);
    return 0;
}

int am_moe_extra_params(const struct am_model_config *cfg, int n_layers)
{
    return cfg->num_experts > 0 ? n_layers * (int)((cfg->gpt_oss ? 6 : 3) * cfg->num_experts + 2) : 0;
}

void am_moe_layer_params(struct am_model *m, int l, struct am_layer *L)
{
    const struct am_model_config *c = &m->cfg;
    bool mixtral = strcmp(c->model_type, "mixtral") == 0;
    int64_t C = c->hidden_size, E = c->num_experts, I = c->moe_intermediate_size;
    int ep = m->sh.ep > 1 ? m->sh.ep : 1;
    int64_t El = E / ep, e0 = (int64_t)m->sh.ep_rank * El;
    const char *blk = mixtral ? "block_sparse_moe" : "mlp";
    const char *kind[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj", mixtral ? "w2" : "down_proj"};
    char n[128];
    L->moe = calloc(1, sizeof(*L->moe));
    if (!L->moe)
        return; /* am_moe_init reports it */
    snprintf(n, sizeof(n), "model.layers.%d.%s.%s.weight", l, blk, c->gpt_oss ? "router" : "gate");
    L->moe->router = am_model_add_param(m, n, E, C, AM_SPLIT_NONE, E, C, 0, 0);
    if (c->gpt_oss) {
        snprintf(n, sizeof(n), "model.layers.%d.%s.router.bias", l, blk);
        L->moe->router_b = am_model_add_param(m, n, E, 0, AM_SPLIT_NONE, E, 0, 0, 0);
    }
    if (c->sigmoid_router)
        snprintf(L->moe->bias_name, sizeof(L->moe->bias_name), "model.layers.%d.%s.gate.e_score_correction_bias", l,
                 blk);
    snprintf(n, sizeof(n), "layers.%d.experts", l);
    L->moe->experts_group = m->n_groups;
    am_model_begin_group(m, AM_PG_EXPERTS, (int)(L - m->layers), n);
    m->groups[m->n_groups - 1].shard = AM_SHARD_EXPERT;
    struct am_param **first[3] = {&L->moe->w1, &L->moe->w3, &L->moe->w2};
    for (int w = 0; w < 3; w++)
        for (int64_t e = 0; e < El; e++) {
            snprintf(n, sizeof(n), "model.layers.%d.%s.experts.%lld.%s.weight", l, blk, (long long)(e0 + e), kind[w]);
            int64_t rows = w == 2 ? C : I, cols = w == 2 ? I : C;
            struct am_param *p = am_model_add_param(m, n, rows, cols, AM_SPLIT_NONE, rows, cols, 0, 0);
            if (e == 0)
                *first[w] = p;
        }
    struct am_param **bias[3] = {&L->moe->b1, &L->moe->b3, &L->moe->b2};
    for (int w = 0; c->gpt_oss && w < 3; w++) /* gpt_oss: each expert's biases, after the matrices */
        for (int64_t e = 0; e < El; e++) {
            snprintf(n, sizeof(n), "model.layers.%d.%s.experts.%lld.%s.bias", l, blk, (long long)(e0 + e), kind[w]);
            int64_t len = w == 2 ? C : I;
            struct am_param *p = am_model_add_param(m, n, len, 0, AM_SPLIT_NONE, len, 0, 0, 0);
            if (e == 0)
                *bias[w] = p;
        }
}

/* the rank of the experts' adapters (moe.h) */
static int experts_r(const struct am_model *m)
{
    return m->sh.lora_experts_r > 0 ? m->sh.lora_experts_r : m->sh.lora_r;
}

void am_moe_lora_params(struct am_model *m, int l, struct am_layer *L)
{
    struct am_moe_layer *X = L->moe;
    if (!X || m->sh.lora_r < 1)
        return;
    const struct am_model_config *c = &m->cfg;
    bool mixtral = strcmp(c->model_type, "mixtral") == 0;
    int64_t C = c->hidden_size, I = c->moe_intermediate_size, r = experts_r(m);
    int ep = m->sh.ep > 1 ? m->sh.ep : 1;
    int64_t El = c->num_experts / ep, e0 = (int64_t)m->sh.ep_rank * El;
    const char *blk = mixtral ? "block_sparse_moe" : "mlp";
    const char *kind[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj", mixtral ? "w2" : "down_proj"};
    const struct {
        struct am_param **first;
        int kind;
        const char *ab;
        int64_t rows, cols;
    } runs[5] = {{&X->la, 0, "lora_A", r, C}, {&X->lbg, 0, "lora_B", I, r}, {&X->lbu, 1, "lora_B", I, r},
                 {&X->lda, 2, "lora_A", r, I}, {&X->ldb, 2, "lora_B", C, r}};
    char n[128];
    for (int k = 0; k < 5; k++)
        for (int64_t e = 0; e < El; e++) {
            snprintf(n, sizeof(n), "model.layers.%d.%s.experts.%lld.%s.%s.weight", l, blk, (long long)(e0 + e),
                     kind[runs[k].kind], runs[k].ab);
            struct am_param *p = am_model_add_param(m, n, runs[k].rows, runs[k].cols, AM_SPLIT_NONE, runs[k].rows,
                                                    runs[k].cols, 0, 0);
            if (e == 0)
                *runs[k].first = p;
        }
}

/* the next tensor of a slab at *off of base (NULL: only measures) */
static struct am_tensor carve(char *base, size_t *off, enum am_device dev, enum am_dtype dt, int64_t d0, int64_t d1)
{
    struct am_tensor t = am_tensor_view(base ? base + *off : NULL, dev, dt, d0, d1, 0, 0);
    *off += (am_tensor_bytes(&t) + 63) & ~(size_t)63;
    return t;
}

static size_t layout(struct am_model *m, struct am_moe *M, char *base)
{
    enum am_device dev = m->K->device;
    enum am_dtype dt = m->act_dt;
    int64_t N = m->max_tokens, E = M->E, k = M->k, S = N * k, I = M->I, C = M->C;
    size_t off = 0;
    for (size_t i = 0; i < m->n_acts; i++) {
        struct moe_acts *A = &M->acts[i];
        if (!A->moe)
            continue;
        A->logits = carve(base, &off, dev, dt, N, E);
        A->probs = carve(base, &off, dev, AM_F32, N, E);
        A->idx = carve(base, &off, dev, AM_I32, N, k);
        A->wts = carve(base, &off, dev, AM_F32, N, k);
        A->pos = carve(base, &off, dev, AM_I32, N, k);
        A->counts = carve(base, &off, dev, AM_I32, E, 0);
        if (M->ep == 1) { /* with ep > 1 in the slot's pool, sized to the rows received */
            A->xp = carve(base, &off, dev, dt, S, C);
            A->g = carve(base, &off, dev, dt, S, I);
            A->u = carve(base, &off, dev, dt, S, I);
            A->act = carve(base, &off, dev, dt, S, I);
        }
        A->yp = carve(base, &off, dev, dt, S, C);
        if (M->am_aux)
            A->am_stats = carve(base, &off, dev, AM_F32, 2 * E, 0);
        if (M->ep > 1)
            A->rcounts = carve(base, &off, dev, AM_I32, (int64_t)M->ep * M->El, 0);
    }
    for (int s = 0; s < m->n_slots; s++) {
        M->slots[s].cnt = carve(base, &off, dev, AM_F32, E, 0);
        M->slots[s].psum = carve(base, &off, dev, AM_F32, E, 0);
        struct am_tensor av = carve(base, &off, dev, AM_F64, 2, 0); /* aux, and valid in the second 8 bytes */
        M->slots[s].aux = am_tensor_view(av.data, dev, AM_F64, 1, 0, 0, 0);
        M->slots[s].valid = am_tensor_view(av.data ? (char *)av.data + 8 : NULL, dev, AM_I64, 1, 0, 0, 0);
    }
    for (int l = 0; M->sigmoid && l < m->n_layers; l++) /* the selection biases */
        if (m->layers[l].moe)
            m->layers[l].moe->bias = carve(base, &off, dev, AM_F32, E, 0);
    if (M->update) /* the selection-bias update's loads */
        M->loads = carve(base, &off, dev, AM_I64, (int64_t)M->n_local * E, 0);
    M->dlogits = carve(base, &off, dev, dt, N, E);
    M->dwts = carve(base, &off, dev, AM_F32, N, k);
    M->dyp = carve(base, &off, dev, dt, S, C);
    if (M->ep == 1) { /* with ep > 1 the work rows (work_views) */
        M->da = carve(base, &off, dev, dt, S, I);
        M->dg = carve(base, &off, dev, dt, S, I);
        M->du = carve(base, &off, dev, dt, S, I);
        M->dxp = carve(base, &off, dev, dt, S, C);
        if (m->sh.lora_r > 0 && m->sh.lora_experts) {
            M->lt = carve(base, &off, dev, dt, S, experts_r(m));
            M->ltd = carve(base, &off, dev, dt, S, experts_r(m));
            M->ldt = carve(base, &off, dev, dt, S, experts_r(m));
        }
    } else {
        M->ts = carve(base, &off, dev, dt, S, C);
    }
    return off;
}

/* ---- expert parallelism: the rows received, sized to the loads (moe.h) ------------------- */

/* n rows of w columns at p (1-D without w), of that many dimensions even with no rows */
static struct am_tensor rows_at(char *p, enum am_device dev, enum am_dtype dt, int64_t n, int64_t w)
{
    struct am_tensor t = am_tensor_view(p, dev, dt, 1, w, 0, 0);
    t.shape[0] = n;
    return t;
}

/* entry A's saved rows, where its slot's pool holds them now */
static void saved_views(struct am_model *m, const struct moe_slot *Sl, struct moe_acts *A)
{
    const struct am_moe *M = m->moe;
    enum am_device dev = m->K->device;
    enum am_dtype dt = m->act_dt;
    size_t es = am_dtype_size(dt), cap = (size_t)Sl->cap, r0 = (size_t)A->r0;
    int64_t R = A->held, C = M->C, I = M->I;
    char *b = Sl->pool;
    A->pos2 = rows_at(b + r0 * 4, dev, AM_I32, R, 0);
    b += cap * 4;
    A->xp = rows_at(b + r0 * (size_t)C * es, dev, dt, R, C);
    b += cap * (size_t)C * es;
    A->g = rows_at(b + r0 * (size_t)I * es, dev, dt, R, I);
    b += cap * (size_t)I * es;
    A->u = rows_at(b + r0 * (size_t)I * es, dev, dt, R, I);
    b += cap * (size_t)I * es;
    A->act = rows_at(b + r0 * (size_t)I * es, dev, dt, R, I);
}

/* the work rows' tensors, work_cap rows each */
static void work_views(struct am_model *m)
{
    struct am_moe *M = m->moe;
    enum am_device dev = m->K->device;
    enum am_dtype dt = m->act_dt;
    int64_t n = M->work_cap, C = M->C, I = M->I, r = experts_r(m);
    size_t off = 0;
    char *b = M->work;
    struct am_tensor *t[9] = {&M->t1, &M->t2, &M->dxp, &M->da, &M->dg, &M->du, &M->lt, &M->ltd, &M->ldt};
    int64_t w[9] = {C, C, C, I, I, I, r, r, r};
    int nt = m->sh.lora_r > 0 && m->sh.lora_experts ? 9 : 6;
    for (int i = 0; i < nt; i++) {
        *t[i] = rows_at(b + off, dev, dt, n, w[i]);
        off += (size_t)(n * w[i]) * am_dtype_size(dt);
    }
}

/* The most rows a layer's experts received grew past what the buffers hold and the device has
 * no more: the layer, the rows, what am-plan assumed and what to change. */
static int rows_oom(struct am_model *m, const char *what, int64_t R, int64_t held, int64_t plan, size_t bytes, char *err,
                    size_t err_len)
{
    return am_fail(err, err_len, "model: layer %d: this rank's experts received %lld rows, making %s %lld rows where "
                   "am-plan assumed %lld at the balanced load (micro-batch tokens x num_experts_per_tok = %lld rows a "
                   "MoE layer); growing them to %zu bytes failed: the device is out of memory (balance the routing: "
                   "router_aux_loss_coef, gate_bias_update_factor; or give each rank fewer tokens: a smaller "
                   "local_batch_size or pp_microbatch_size, or more GPUs)", m->where.layer, (long long)R, what,
                   (long long)held, (long long)plan, (long long)m->moe->max_S, bytes);
}

/* Slot Sl's pool grown to need rows: the rows of its micro-batch so far copied over, the
 * entries holding them pointed at their new place. */
static int pool_grow(struct am_model *m, int slot, int64_t need, int64_t R, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    struct moe_slot *Sl = &M->slots[slot];
    /* AM_FAULT kind=expert-rows-oom: a size no device has, so that the allocation fails for real */
    size_t bytes = M->fail_growth ? (size_t)1 << 62 : (size_t)need * M->saved_row;
    M->fail_growth = false;
    char *b = m->K->alloc(m->dev, bytes);
    if (!b)
        return rows_oom(m, "the saved expert rows of its micro-batch's MoE layers", R, Sl->used + R, Sl->plan_rows,
                        bytes, err, err_len);
    struct moe_slot old = *Sl;
    Sl->pool = b;
    Sl->cap = need;
    for (size_t i = 0; i < m->n_acts; i++) {
        struct moe_acts *A = &M->acts[i];
        if (!A->moe || A->slot != slot || A->gen != Sl->gen || A->held < 0)
            continue;
        struct moe_acts was = *A;
        saved_views(m, &old, &was);
        saved_views(m, Sl, A);
        if (A->held == 0)
            continue;
        m->K->copy(m->dev, &A->pos2, &was.pos2);
        m->K->copy(m->dev, &A->xp, &was.xp);
        m->K->copy(m->dev, &A->g, &was.g);
        m->K->copy(m->dev, &A->u, &was.u);
        m->K->copy(m->dev, &A->act, &was.act);
    }
    if (old.pool)
        m->K->free(m->dev, old.pool);
    return 0;
}

/* Entry A's R saved rows from its slot's pool: its micro-batch's next R rows (grown when
 * needed), or a recomputed forward's own again. */
static int saved_rows(struct am_model *m, struct moe_acts *A, int64_t R, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    struct moe_slot *Sl = &M->slots[A->slot];
    if (A->gen == Sl->gen && A->held >= 0) { /* recomputed in the backward: the same rows */
        if (A->held != R)
            return am_fail(err, err_len, "model: layer %d: the recomputed forward's experts received %lld rows, its "
                           "forward %lld (the routing must repeat)", m->where.layer, (long long)R, (long long)A->held);
        return 0;
    }
    if ((Sl->used + R > Sl->cap || M->fail_growth) && pool_grow(m, A->slot, Sl->used + R, R, err, err_len) < 0)
        return -1;
    A->r0 = Sl->used;
    A->held = R;
    A->gen = Sl->gen;
    Sl->used += R;
    saved_views(m, Sl, A);
    if (Sl->used > M->step_rows_max)
        M->step_rows_max = Sl->used;
    if (R > M->step_layer_max)
        M->step_layer_max = R;
    return 0;
}

/* The work rows for R rows received (grown when needed; nothing in them outlives a call). */
static int work_rows(struct am_model *m, int64_t R, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    if (R <= M->work_cap)
        return 0;
    size_t bytes = (size_t)R * M->work_row;
    if (M->work)
        m->K->free(m->dev, M->work);
    M->work = m->K->alloc(m->dev, bytes);
    if (!M->work) {
        M->work_cap = 0;
        return rows_oom(m, "the work rows of a MoE layer", R, R, M->max_S, bytes, err, err_len);
    }
    M->work_cap = R;
    work_views(m);
    return 0;
}

/* The pools at the plan's balanced load: each slot's the S rows of each of its MoE layers, the
 * work rows S (moe.h). */
static int pools_init(struct am_model *m, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    size_t es = am_dtype_size(m->act_dt);
    int64_t S = m->max_tokens * M->k;
    M->max_S = S;
    M->saved_row = 4 + (size_t)(M->C + 3 * M->I) * es;
    M->work_row = (size_t)(3 * M->C + 3 * M->I + (m->sh.lora_r > 0 && m->sh.lora_experts ? 3 * experts_r(m) : 0)) * es;
    for (size_t i = 0; i < m->n_acts; i++)
        if (M->acts[i].moe)
            M->slots[M->acts[i].slot].plan_rows += S;
    for (int s = 0; s < m->n_slots; s++) {
        struct moe_slot *Sl = &M->slots[s];
        Sl->cap = Sl->plan_rows;
        if (Sl->cap > 0 && !(Sl->pool = m->K->alloc(m->dev, (size_t)Sl->cap * M->saved_row)))
            return am_fail(err, err_len, "model: out of memory for the experts' saved rows (%zu bytes)",
                           (size_t)Sl->cap * M->saved_row);
    }
    M->work_cap = S;
    if (!(M->work = m->K->alloc(m->dev, (size_t)S * M->work_row)))
        return am_fail(err, err_len, "model: out of memory for the experts' work rows (%zu bytes)",
                       (size_t)S * M->work_row);
    work_views(m);
    return 0;
}

size_t am_moe_rows_bytes(const struct am_model *m)
{
    const struct am_moe *M = m->moe;
    if (!M || M->ep < 2)
        return 0;
    size_t b = (size_t)M->work_cap * M->work_row;
    for (int s = 0; s < m->n_slots; s++)
        b += (size_t)M->slots[s].cap * M->saved_row;
    return b;
}

static struct am_tensor experts_view(const struct am_tensor *first, enum am_dtype dt, int64_t E)
{
    return am_tensor_view(first->data, first->device, dt, E, first->shape[0], first->shape[1], 0);
}

int am_moe_init(struct am_model *m, char *err, size_t err_len)
{
    const struct am_model_config *c = &m->cfg;
    if (c->num_experts <= 0)
        return 0;
    struct am_moe *M = calloc(1, sizeof(*M));
    if (!M)
        return am_fail(err, err_len, "model: out of memory for the mixture-of-experts state");
    m->moe = M;
    M->E = c->num_experts;
    M->k = c->num_experts_per_tok;
    M->I = c->moe_intermediate_size;
    M->C = c->hidden_size;
    M->ep = m->sh.ep > 1 ? m->sh.ep : 1;
    M->ep_rank = M->ep > 1 ? m->sh.ep_rank : 0;
    M->El = M->E / M->ep;
    M->e0 = (int64_t)M->ep_rank * M->El;
    M->renorm = strcmp(c->model_type, "mixtral") == 0 || c->norm_topk_prob;
    M->sigmoid = c->sigmoid_router;
    M->n_group = (int)c->n_group;
    M->topk_group = (int)c->topk_group;
    M->scale = (float)c->routed_scaling_factor;
    M->aux_on = am_model_hf_aux(c);
    M->coef = c->router_aux_loss_coef;
    M->am_aux = c->aux_loss_coeff > 0;
    M->am_coef = c->aux_loss_coeff;
    M->am_div = 1.0;
    M->n_moe = (int)am_model_moe_layers(c);
    M->update = M->sigmoid && c->gate_bias_update_factor > 0;
    M->factor = (float)c->gate_bias_update_factor;
    for (int l = 0; l < m->n_layers; l++)
        M->n_local += m->layers[l].moe != NULL;
    M->acts = calloc(m->n_acts + 1, sizeof(*M->acts));
    M->slots = calloc((size_t)m->n_slots, sizeof(*M->slots));
    M->step_counts = calloc((size_t)M->E, sizeof(*M->step_counts));
    if (M->update) {
        M->layer_loads = calloc((size_t)m->n_layers * (size_t)M->E, sizeof(int64_t));
        M->sum_host = calloc((size_t)M->n_local * (size_t)M->E + 1, sizeof(int64_t));
        M->bias_host = calloc((size_t)M->E, sizeof(float));
        M->idx_host = calloc((size_t)(m->max_tokens * M->k), sizeof(int32_t));
    }
    M->h32 = calloc((size_t)M->E + (M->ep > 1 ? (size_t)(m->max_tokens * M->k * M->ep) : 0), sizeof(*M->h32));
    M->host = calloc((m->n_acts + 1) * (size_t)M->E, sizeof(*M->host));
    size_t per_ep = M->ep > 1 ? (size_t)(2 * M->ep + M->El + M->ep * M->El) : 0;
    M->ep_host = per_ep ? calloc((m->n_acts + 1) * per_ep, sizeof(int64_t)) : NULL;
    M->cnt_sz = M->ep > 1 ? calloc(4 * (size_t)M->ep, sizeof(size_t)) : NULL;
    if (!M->acts || !M->slots || !M->step_counts || !M->h32 || !M->host || (per_ep && (!M->ep_host || !M->cnt_sz)) ||
        (M->update && (!M->layer_loads || !M->sum_host || !M->bias_host || !M->idx_host)))
        return am_fail(err, err_len, "model: out of memory for the mixture-of-experts state");
    for (int ch = 0; ch < m->sh.n_chunks; ch++)
        for (int l = 0; l < m->sh.chunks[ch].n_layers; l++)
            if (am_model_layer_is_moe(c, m->sh.chunks[ch].first_layer + l) && !m->layers[m->chunk_base[ch] + l].moe)
                return am_fail(err, err_len, "model: out of memory for the mixture-of-experts layers");
    /* which acts entries are MoE layers', and of which slot */
    for (int ch = 0; ch < m->sh.n_chunks; ch++)
        for (int s = 0; s < m->sh.chunks[ch].slots; s++) {
            struct am_slot *S = &m->slots[m->slot_base[ch] + s];
            for (int l = 0; l < m->sh.chunks[ch].n_layers; l++) {
                size_t i = (size_t)(&S->acts[l] - m->acts_mem);
                M->acts[i].moe = m->layers[m->chunk_base[ch] + l].moe != NULL;
                M->acts[i].slot = m->slot_base[ch] + s;
                M->acts[i].hcount = M->host + i * (size_t)M->E;
                if (per_ep) {
                    int64_t *b = M->ep_host + i * per_ep;
                    M->acts[i].send_rows = b;
                    M->acts[i].recv_rows = b + M->ep;
                    M->acts[i].lcount = b + 2 * M->ep;
                    M->acts[i].rc = b + 2 * M->ep + M->El;
                }
            }
        }
    size_t bytes = layout(m, M, NULL);
    M->mem = m->K->alloc(m->dev, bytes);
    if (!M->mem)
        return am_fail(err, err_len, "model: out of memory for the experts' activations (%zu bytes)", bytes);
    layout(m, M, M->mem);
    m->act_bytes += bytes;
    for (size_t i = 0; i < m->n_acts; i++)
        M->acts[i].held = -1;
    if (M->ep > 1 && pools_init(m, err, err_len) < 0)
        return -1;
    for (int l = 0; M->sigmoid && l < m->n_layers; l++)
        if (m->layers[l].moe)
            m->K->zero(m->dev, &m->layers[l].moe->bias);
    for (int l = 0; l < m->n_layers; l++) {
        struct am_moe_layer *X = m->layers[l].moe;
        if (!X)
            continue;
        X->W1 = experts_view(&X->w1->wc, m->act_dt, M->El);
        X->W3 = experts_view(&X->w3->wc, m->act_dt, M->El);
        X->W2 = experts_view(&X->w2->wc, m->act_dt, M->El);
        X->G1 = experts_view(&X->w1->g, AM_F32, M->El);
        X->G3 = experts_view(&X->w3->g, AM_F32, M->El);
        X->G2 = experts_view(&X->w2->g, AM_F32, M->El);
        if (X->la) {
            X->LA = experts_view(&X->la->wc, m->act_dt, M->El);
            X->LBG = experts_view(&X->lbg->wc, m->act_dt, M->El);
            X->LBU = experts_view(&X->lbu->wc, m->act_dt, M->El);
            X->LDA = experts_view(&X->lda->wc, m->act_dt, M->El);
            X->LDB = experts_view(&X->ldb->wc, m->act_dt, M->El);
            X->GLA = experts_view(&X->la->g, AM_F32, M->El);
            X->GLBG = experts_view(&X->lbg->g, AM_F32, M->El);
            X->GLBU = experts_view(&X->lbu->g, AM_F32, M->El);
            X->GLDA = experts_view(&X->lda->g, AM_F32, M->El);
            X->GLDB = experts_view(&X->ldb->g, AM_F32, M->El);
        }
    }
    M->lscale = m->sh.lora_r > 0 ? m->sh.lora_alpha / (float)experts_r(m) : 0.0f;
    return 0;
}

void am_moe_free(struct am_model *m)
{
    for (int l = 0; m->layers && l < m->n_layers; l++) {
        free(m->layers[l].moe);
        m->layers[l].moe = NULL;
    }
    struct am_moe *M = m->moe;
    if (!M)
        return;
    if (M->mem)
        m->K->free(m->dev, M->mem);
    for (int s = 0; M->slots && s < m->n_slots; s++)
        if (M->slots[s].pool)
            m->K->free(m->dev, M->slots[s].pool);
    if (M->work)
        m->K->free(m->dev, M->work);
    free(M->acts);
    free(M->slots);
    free(M->step_counts);
    free(M->layer_loads);
    free(M->sum_host);
    free(M->bias_host);
    free(M->idx_host);
    free(M->h32);
    free(M->host);
    free(M->ep_host);
    free(M->cnt_sz);
    free(M);
    m->moe = NULL;
}

static struct am_tensor rows(const struct am_tensor *t, int64_t n)
{
    struct am_tensor v = *t;
    v.shape[0] = n;
    return v;
}

/* Rows lo .. hi of t (a view) */
static struct am_tensor span(const struct am_tensor *t, int64_t lo, int64_t hi)
{
    struct am_tensor v = *t;
    v.data = (char *)t->data + lo * t->shape[1] * (int64_t)am_dtype_size(t->dtype);
    v.shape[0] = hi - lo;
    return v;
}

/* The runs of a micro-batch's rows that AutoModel's gate counts (its token_mask), for slot's B
 * sequences of N rows: with packed sequences those that are no pad (packed.h), else all of
 * them, one run (*runs then names all, filled). Returns their count. */
static int64_t gate_runs(const struct am_model *m, int slot, int64_t N, int64_t all[2], const int64_t **runs)
{
    if (m->pk)
        return am_packed_runs(m, slot, N / m->seq_len, runs);
    all[0] = 0;
    all[1] = N;
    *runs = all;
    return 1;
}

static struct moe_acts *acts_of(struct am_model *m, const struct am_layer_acts *a)
{
    return &m->moe->acts[a - m->acts_mem];
}

/* An experts' compute copies as one [E, ...] tensor, where the first of them is now: fully
 * sharded data parallelism gathers a layer's experts into a buffer before each use (fsdp.h). */
static struct am_tensor weights_now(const struct am_tensor *view, const struct am_param *first)
{
    struct am_tensor t = *view;
    t.data = first->wc.data;
    return t;
}

/* Expert parallelism: the rows of each ep rank's experts go to that rank (the slots sorted by
 * global expert are grouped by destination rank, then by its local expert: Megatron's
 * all-to-all token dispatcher's order), the receiver regroups what it got from each source by
 * local expert, runs its experts, and the results go back the same way. */

/* rows of C elements from send (grouped by destination) to recv (grouped by source) */
static int a2a_rows(struct am_model *m, const struct am_tensor *send, const int64_t *out, struct am_tensor *recv,
                    const int64_t *in, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    size_t *sc = M->cnt_sz, *sd = sc + M->ep, *rcn = sd + M->ep, *rd = rcn + M->ep, so = 0, ro = 0;
    for (int r = 0; r < M->ep; r++) {
        sc[r] = (size_t)(out[r] * M->C), sd[r] = so, so += sc[r];
        rcn[r] = (size_t)(in[r] * M->C), rd[r] = ro, ro += rcn[r];
    }
    double t0 = am_mono_time();
    int rc = am_alltoallv(m->ep_comm, send->data, sc, sd, recv->data, rcn, rd, send->dtype, err, err_len);
    M->a2a_s += am_mono_time() - t0;
    return rc;
}

/* The counts: each rank's per-expert counts for the experts of every other rank, then the rows
 * to send and receive, the local experts' rows and where each received row goes (pos2). */
static int exchange_counts(struct am_model *m, struct moe_acts *A, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    int ep = M->ep;
    int64_t El = M->El;
    size_t *sc = M->cnt_sz, *sd = sc + ep, *rcn = sd + ep, *rd = rcn + ep;
    for (int r = 0; r < ep; r++)
        sc[r] = rcn[r] = (size_t)El, sd[r] = rd[r] = (size_t)(r * El);
    double t0 = am_mono_time();
    if (am_alltoallv(m->ep_comm, A->counts.data, sc, sd, A->rcounts.data, rcn, rd, AM_I32, err, err_len) < 0)
        return -1;
    M->a2a_s += am_mono_time() - t0;
    m->K->download(m->dev, M->h32, A->rcounts.data, (size_t)(ep * El) * sizeof(int32_t));
    A->recv_total = 0;
    for (int64_t e = 0; e < El; e++)
        A->lcount[e] = 0;
    for (int r = 0; r < ep; r++) {
        A->send_rows[r] = A->recv_rows[r] = 0;
        for (int64_t e = 0; e < El; e++) {
            A->send_rows[r] += A->hcount[r * El + e];
            A->rc[r * El + e] = M->h32[r * El + e];
            A->recv_rows[r] += A->rc[r * El + e];
            A->lcount[e] += A->rc[r * El + e];
        }
        A->recv_total += A->recv_rows[r];
    }
    int32_t *hp = M->h32 + M->E;
    int64_t cur[El > 0 ? El : 1], o = 0, row = 0;
    for (int64_t e = 0; e < El; e++)
        cur[e] = o, o += A->lcount[e];
    for (int r = 0; r < ep; r++)
        for (int64_t e = 0; e < El; e++)
            for (int64_t i = 0; i < A->rc[r * El + e]; i++)
                hp[row++] = (int32_t)cur[e]++;
    return 0; /* pos2 is uploaded where the rows are held (forward_ep) */
}

/* pos2 as the [R, 1] map of the permute kernels */
static struct am_tensor pos2_of(const struct moe_acts *A)
{
    struct am_tensor t = am_tensor_view(A->pos2.data, A->pos2.device, AM_I32, 1, 1, 0, 0);
    return rows(&t, A->recv_total); /* 2-D even with no rows */
}

/* gpt_oss: each local expert's bias (the first of El consecutive parameters, where they are now)
 * added to its rows of y (grouped by local expert, cnt rows each); its backward: each bias's
 * gradient += the sum of its rows of dy. */
static void experts_bias_forward(struct am_model *m, struct am_tensor *y, const struct am_param *first,
                                 const int64_t *cnt)
{
    int64_t n = y->shape[1], r0 = 0;
    size_t es = am_dtype_size(y->dtype), bs = (size_t)n * am_dtype_size(first->wc.dtype);
    for (int64_t e = 0; e < m->moe->El; r0 += cnt[e], e++) {
        if (cnt[e] == 0)
            continue;
        struct am_tensor rows_e = am_tensor_view((char *)y->data + (size_t)(r0 * n) * es, y->device, y->dtype, cnt[e],
                                                 n, 0, 0);
        struct am_tensor b = am_tensor_view((char *)first->wc.data + (size_t)e * bs, first->wc.device,
                                            first->wc.dtype, n, 0, 0, 0);
        m->K->bias_forward(m->dev, &rows_e, &b);
    }
}

static void experts_bias_backward(struct am_model *m, const struct am_tensor *dy, const struct am_param *first,
                                  const int64_t *cnt)
{
    int64_t n = dy->shape[1], r0 = 0;
    size_t es = am_dtype_size(dy->dtype), bs = (size_t)n * sizeof(float);
    for (int64_t e = 0; e < m->moe->El; r0 += cnt[e], e++) {
        if (cnt[e] == 0)
            continue;
        struct am_tensor rows_e = am_tensor_view((char *)dy->data + (size_t)(r0 * n) * es, dy->device, dy->dtype,
                                                 cnt[e], n, 0, 0);
        struct am_tensor db = am_tensor_view((char *)first->g.data + (size_t)e * bs, first->g.device, AM_F32, n, 0, 0,
                                             0);
        m->K->bias_backward(m->dev, &db, &rows_e);
    }
}

/* The experts over rows xp (grouped by local expert, cnt rows each): g, u, act and y (moe.h),
 * with their adapters beside them under LoRA on the experts. */
static void experts_forward(struct am_model *m, const struct am_moe_layer *X, const int64_t *cnt, struct am_tensor *y,
                            struct am_tensor *act, struct am_tensor *g, struct am_tensor *u, const struct am_tensor *xp)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    int64_t R = xp->shape[0];
    struct am_tensor W1 = weights_now(&X->W1, X->w1), W3 = weights_now(&X->W3, X->w3), W2 = weights_now(&X->W2, X->w2);
    K->grouped_matmul_forward(m->dev, g, xp, &W1, cnt);
    K->grouped_matmul_forward(m->dev, u, xp, &W3, cnt);
    if (X->la) { /* g += s · (x · Aᵀ) · Bgᵀ, u += s · (x · Aᵀ) · Buᵀ (dg: scratch) */
        struct am_tensor t = rows(&M->lt, R), z = rows(&M->dg, R);
        struct am_tensor LA = weights_now(&X->LA, X->la), LBG = weights_now(&X->LBG, X->lbg),
                         LBU = weights_now(&X->LBU, X->lbu);
        K->grouped_matmul_forward(m->dev, &t, xp, &LA, cnt);
        K->grouped_matmul_forward(m->dev, &z, &t, &LBG, cnt);
        K->scale(m->dev, &z, M->lscale);
        K->add(m->dev, g, &z);
        K->grouped_matmul_forward(m->dev, &z, &t, &LBU, cnt);
        K->scale(m->dev, &z, M->lscale);
        K->add(m->dev, u, &z);
    }
    if (X->b1) { /* gpt_oss: the biases of gate and up, the clamped SwiGLU */
        experts_bias_forward(m, g, X->b1, cnt);
        experts_bias_forward(m, u, X->b3, cnt);
        K->swiglu_clamped_forward(m->dev, act, g, u, (float)m->cfg.swiglu_alpha, (float)m->cfg.swiglu_limit);
    } else {
        K->swiglu_forward(m->dev, act, g, u);
    }
    K->grouped_matmul_forward(m->dev, y, act, &W2, cnt);
    if (X->b2)
        experts_bias_forward(m, y, X->b2, cnt);
    if (X->la) { /* y += s · (a · A_dᵀ) · B_dᵀ (dxp: scratch) */
        struct am_tensor t = rows(&M->ltd, R), z = rows(&M->dxp, R);
        struct am_tensor LDA = weights_now(&X->LDA, X->lda), LDB = weights_now(&X->LDB, X->ldb);
        K->grouped_matmul_forward(m->dev, &t, act, &LDA, cnt);
        K->grouped_matmul_forward(m->dev, &z, &t, &LDB, cnt);
        K->scale(m->dev, &z, M->lscale);
        K->add(m->dev, y, &z);
    }
}

/* The down adapter's backward (moe.h), after the base's: da += its part; dyl is spent (s · dy). */
static void lora_down_backward(struct am_model *m, const struct am_moe_layer *X, const int64_t *cnt,
                               struct am_tensor *dyl, struct am_tensor *da, const struct am_tensor *act)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    int64_t R = act->shape[0];
    struct am_tensor t = rows(&M->ltd, R), dt = rows(&M->ldt, R), GA = X->GLDA, GB = X->GLDB;
    struct am_tensor LDA = weights_now(&X->LDA, X->lda), LDB = weights_now(&X->LDB, X->ldb);
    GA.data = X->lda->g.data;
    GB.data = X->ldb->g.data;
    K->grouped_matmul_forward(m->dev, &t, act, &LDA, cnt); /* t_d = a · A_dᵀ again */
    K->scale(m->dev, dyl, M->lscale);
    K->zero(m->dev, &dt);
    K->grouped_matmul_backward(m->dev, &dt, &GB, dyl, &t, &LDB, cnt); /* dt_d = dd · B_d, gB_d += ddᵀ · t_d */
    K->grouped_matmul_backward(m->dev, da, &GA, &dt, act, &LDA, cnt); /* da += dt_d · A_d, gA_d += dt_dᵀ · a */
}

/* The gate and up adapter's backward (moe.h), after the base's: dxp += its part; dg and du are
 * spent (s times theirs). */
static void lora_gate_up_backward(struct am_model *m, const struct am_moe_layer *X, const int64_t *cnt,
                                  struct am_tensor *dg, struct am_tensor *du, struct am_tensor *dxp,
                                  const struct am_tensor *xp)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    int64_t R = xp->shape[0];
    struct am_tensor t = rows(&M->lt, R), dt = rows(&M->ldt, R), GA = X->GLA, GBG = X->GLBG, GBU = X->GLBU;
    struct am_tensor LA = weights_now(&X->LA, X->la), LBG = weights_now(&X->LBG, X->lbg),
                     LBU = weights_now(&X->LBU, X->lbu);
    GA.data = X->la->g.data;
    GBG.data = X->lbg->g.data;
    GBU.data = X->lbu->g.data;
    K->grouped_matmul_forward(m->dev, &t, xp, &LA, cnt); /* t = x · Aᵀ again */
    K->scale(m->dev, dg, M->lscale);
    K->scale(m->dev, du, M->lscale);
    K->zero(m->dev, &dt);
    K->grouped_matmul_backward(m->dev, &dt, &GBG, dg, &t, &LBG, cnt); /* dt = s dg · Bg + s du · Bu, */
    K->grouped_matmul_backward(m->dev, &dt, &GBU, du, &t, &LBU, cnt); /* gB += s dᵀ · t */
    K->grouped_matmul_backward(m->dev, dxp, &GA, &dt, xp, &LA, cnt);  /* dx += dt · A, gA += dtᵀ · x */
}

static int forward_ep(struct am_model *m, const struct am_layer *L, struct moe_acts *A, const struct am_tensor *in,
                      struct am_tensor *out, const struct am_tensor *pos, const struct am_tensor *wts, char *err,
                      size_t err_len)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    int64_t S = in->shape[0] * M->k;
    if (exchange_counts(m, A, err, err_len) < 0)
        return -1;
    int64_t R = A->recv_total;
    if (saved_rows(m, A, R, err, err_len) < 0 || work_rows(m, R, err, err_len) < 0)
        return -1;
    m->K->upload(m->dev, A->pos2.data, M->h32 + M->E, (size_t)R * sizeof(int32_t));
    if (m->where.phase != AM_PHASE_BACKWARD) /* a recomputation in the backward counts once */
        M->step_recv += R;
    struct am_tensor ts = rows(&M->ts, S), t1 = rows(&M->t1, R), t2 = rows(&M->t2, R), p2 = pos2_of(A);
    struct am_tensor xp = rows(&A->xp, R), g = rows(&A->g, R), u = rows(&A->u, R), act = rows(&A->act, R);
    struct am_tensor yp = rows(&A->yp, S);
    K->moe_permute_forward(m->dev, &ts, in, pos);
    if (a2a_rows(m, &ts, A->send_rows, &t1, A->recv_rows, err, err_len) < 0)
        return -1;
    K->moe_permute_forward(m->dev, &xp, &t1, &p2);
    double t0 = am_mono_time();
    experts_forward(m, L->moe, A->lcount, &t1, &act, &g, &u, &xp);
    M->experts_s += am_mono_time() - t0;
    K->zero(m->dev, &t2);
    K->moe_permute_backward(m->dev, &t2, &t1, &p2); /* back to source order */
    if (a2a_rows(m, &t2, A->recv_rows, &yp, A->send_rows, err, err_len) < 0)
        return -1;
    K->moe_combine_forward(m->dev, out, &yp, pos, wts);
    return 0;
}

/* The first or the second half of a layer's AutoModel statistics (loads, score sums), [E] f32 */
static struct am_tensor am_half(const struct am_moe *M, const struct moe_acts *A, int half)
{
    return am_tensor_view(A->am_stats.data ? (float *)A->am_stats.data + half * M->E : NULL, A->am_stats.device, AM_F32,
                          M->E, 0, 0, 0);
}

/* The tokens of the micro-batch AutoModel's gate counts (its token_mask: every row of the whole
 * sequences but the pads that end a pack), its context_length summed over the cp group, at
 * least 1 (its clamp) */
static double am_tokens(const struct am_model *m, int slot, int64_t N)
{
    double T = m->pk ? (double)am_packed_filled(m, slot, N / m->seq_len)
                     : (double)N * (double)(m->cp ? m->cp->size : 1);
    return T < 1 ? 1 : T;
}

/* AutoModel's load-balancing loss of one layer for the micro-batch (moe.h): the layer's loads and
 * (normalised) score sums, summed over the cp group, kept for the backward; its value
 * E / (k T²) Σ load score-sum added to the slot's aux (reported, never to the loss) */
static int am_aux_forward(struct am_model *m, struct moe_acts *A, struct moe_slot *Sl, const struct am_tensor *probs,
                          const struct am_tensor *idx, int64_t N, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    struct am_tensor cnt = am_half(M, A, 0), psum = am_half(M, A, 1);
    m->K->zero(m->dev, &A->am_stats);
    /* AutoModel normalises the sigmoid scores with norm_topk_prob and more than one expert a token;
     * its token_mask: the runs of rows that are no pad */
    const int64_t *runs;
    int64_t all[2], nr = gate_runs(m, A->slot, N, all, &runs);
    for (int64_t r = 0; r < nr; r++) {
        struct am_tensor p = span(probs, runs[2 * r], runs[2 * r + 1]), i = span(idx, runs[2 * r], runs[2 * r + 1]);
        m->K->moe_aux_stats(m->dev, &cnt, &psum, &p, &i, M->sigmoid && M->renorm && M->k > 1);
    }
    if (m->cp && m->cp->size > 1 &&
        am_allreduce(m->cp->comm, A->am_stats.data, A->am_stats.data, 2 * (size_t)M->E, AM_F32, AM_SUM, err,
                     err_len) < 0)
        return -1;
    double T = am_tokens(m, A->slot, N);
    m->K->moe_aux_loss(m->dev, &Sl->aux, &cnt, &psum, (double)M->E / ((double)M->k * T * T));
    M->last_slot = A->slot;
    return 0;
}

static int moe_forward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                       const struct am_tensor *in, struct am_tensor *out, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    struct moe_acts *A = acts_of(m, a);
    struct moe_slot *Sl = &M->slots[A->slot];
    int64_t N = in->shape[0], S = N * M->k;
    bool again = m->where.phase == AM_PHASE_BACKWARD; /* recomputed in the backward: statistics once */
    struct am_tensor logits = rows(&A->logits, N), probs = rows(&A->probs, N), idx = rows(&A->idx, N);
    struct am_tensor wts = rows(&A->wts, N), pos = rows(&A->pos, N), xp = rows(&A->xp, S), g = rows(&A->g, S);
    struct am_tensor u = rows(&A->u, S), act = rows(&A->act, S), yp = rows(&A->yp, S);
    K->matmul_forward(m->dev, &logits, in, &L->moe->router->wc);
    if (L->moe->router_b) /* gpt_oss: the router's bias */
        K->bias_forward(m->dev, &logits, &L->moe->router_b->wc);
    if (M->sigmoid)
        K->moe_route_sigmoid_forward(m->dev, &probs, &idx, &wts, &logits, &L->moe->bias, M->n_group, M->topk_group,
                                     M->renorm, M->scale);
    else
        K->moe_route_forward(m->dev, &probs, &idx, &wts, &logits, M->renorm);
    if (M->aux_on && !again)
        K->moe_aux_stats(m->dev, &Sl->cnt, &Sl->psum, &probs, &idx, false);
    if (M->am_aux && !again && am_aux_forward(m, A, Sl, &probs, &idx, N, err, err_len) < 0)
        return -1;
    K->moe_plan(m->dev, &pos, &A->counts, &idx);
    K->download(m->dev, M->h32, A->counts.data, (size_t)M->E * sizeof(int32_t));
    int64_t *load = M->layer_loads && !again ? M->layer_loads + (L - m->layers) * M->E : NULL;
    for (int64_t e = 0; e < M->E; e++) {
        A->hcount[e] = M->h32[e];
        if (!again)
            M->step_counts[e] += M->h32[e];
        if (load && !m->pk)
            load[e] += M->h32[e];
    }
    if (load && m->pk) { /* the selection bias's loads: the rows that are no pad (AutoModel's token_mask) */
        const int64_t *runs;
        int64_t all[2], nr = gate_runs(m, A->slot, N, all, &runs);
        K->download(m->dev, M->idx_host, idx.data, (size_t)(N * M->k) * sizeof(int32_t));
        for (int64_t r = 0; r < nr; r++)
            for (int64_t j = runs[2 * r] * M->k; j < runs[2 * r + 1] * M->k; j++)
                load[M->idx_host[j]]++;
    }
    if (M->ep > 1)
        return forward_ep(m, L, A, in, out, &pos, &wts, err, err_len);
    K->moe_permute_forward(m->dev, &xp, in, &pos);
    double t0 = am_mono_time();
    experts_forward(m, L->moe, A->hcount, &yp, &act, &g, &u, &xp);
    M->experts_s += am_mono_time() - t0;
    K->moe_combine_forward(m->dev, out, &yp, &pos, &wts);
    return 0;
}

/* The block's time goes to dispatch_s but for the experts' share (experts_s). */
int am_moe_forward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, const struct am_tensor *in,
                   struct am_tensor *out, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    double t0 = am_mono_time(), e0 = M->experts_s;
    int rc = moe_forward(m, L, a, in, out, err, err_len);
    M->dispatch_s += am_mono_time() - t0 - (M->experts_s - e0);
    return rc;
}

static int moe_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                        const struct am_tensor *dout, const struct am_tensor *in, struct am_tensor *dh, char *err,
                        size_t err_len)
{
    const struct am_kernels *K = m->K;
    struct am_moe *M = m->moe;
    struct moe_acts *A = acts_of(m, a);
    struct moe_slot *Sl = &M->slots[A->slot];
    int64_t N = in->shape[0], S = N * M->k, R = M->ep > 1 ? A->recv_total : S;
    const int64_t *cnt = M->ep > 1 ? A->lcount : A->hcount;
    struct am_tensor probs = rows(&A->probs, N), idx = rows(&A->idx, N), wts = rows(&A->wts, N), pos = rows(&A->pos, N);
    struct am_tensor xp = rows(&A->xp, R), g = rows(&A->g, R), u = rows(&A->u, R), act = rows(&A->act, R);
    struct am_tensor yp = rows(&A->yp, S);
    struct am_tensor dlogits = rows(&M->dlogits, N), dwts = rows(&M->dwts, N), dyp = rows(&M->dyp, S);
    struct am_tensor da = rows(&M->da, R), dg = rows(&M->dg, R), du = rows(&M->du, R), dxp = rows(&M->dxp, R);
    struct am_tensor dyl = dyp, p2 = {0};
    const struct am_moe_layer *X = L->moe;
    K->zero(m->dev, &dyp);
    K->zero(m->dev, &dwts);
    K->moe_combine_backward(m->dev, &dyp, &dwts, dout, &yp, &pos, &wts);
    if (M->ep > 1) { /* the gradients of the expert outputs to the ranks that computed them */
        struct am_tensor t1 = rows(&M->t1, R);
        dyl = rows(&M->t2, R);
        p2 = pos2_of(A);
        if (a2a_rows(m, &dyp, A->send_rows, &t1, A->recv_rows, err, err_len) < 0)
            return -1;
        K->moe_permute_forward(m->dev, &dyl, &t1, &p2);
    }
    double t0 = am_mono_time();
    K->zero(m->dev, &da);
    struct am_tensor G2 = X->G2, G1 = X->G1, G3 = X->G3; /* where the gradients are now (grad_use) */
    G1.data = X->w1->g.data;
    G3.data = X->w3->g.data;
    G2.data = X->w2->g.data;
    struct am_tensor W1 = weights_now(&X->W1, X->w1), W3 = weights_now(&X->W3, X->w3), W2 = weights_now(&X->W2, X->w2);
    bool frozen = m->sh.lora_r > 0; /* LoRA: the router and the experts frozen with the base, no gradients */
    if (X->b2 && !frozen)
        experts_bias_backward(m, &dyl, X->b2, cnt);
    K->grouped_matmul_backward(m->dev, &da, frozen ? NULL : &G2, &dyl, &act, &W2, cnt);
    if (X->la) /* the down adapter's (dyl is spent) */
        lora_down_backward(m, X, cnt, &dyl, &da, &act);
    K->zero(m->dev, &dg);
    K->zero(m->dev, &du);
    if (X->b1) { /* gpt_oss: the clamped SwiGLU, the biases of gate and up */
        K->swiglu_clamped_backward(m->dev, &dg, &du, &da, &g, &u, (float)m->cfg.swiglu_alpha,
                                   (float)m->cfg.swiglu_limit);
        if (!frozen) {
            experts_bias_backward(m, &dg, X->b1, cnt);
            experts_bias_backward(m, &du, X->b3, cnt);
        }
    } else {
        K->swiglu_backward(m->dev, &dg, &du, &da, &g, &u);
    }
    K->zero(m->dev, &dxp);
    K->grouped_matmul_backward(m->dev, &dxp, frozen ? NULL : &G1, &dg, &xp, &W1, cnt);
    K->grouped_matmul_backward(m->dev, &dxp, frozen ? NULL : &G3, &du, &xp, &W3, cnt);
    if (X->la) /* the gate and up adapter's (dg and du are spent) */
        lora_gate_up_backward(m, X, cnt, &dg, &du, &dxp, &xp);
    M->experts_s += am_mono_time() - t0;
    if (M->ep > 1) { /* the inputs' gradients back to the tokens' ranks */
        struct am_tensor t1 = rows(&M->t1, R), ts = rows(&M->ts, S);
        K->zero(m->dev, &t1);
        K->moe_permute_backward(m->dev, &t1, &dxp, &p2);
        if (a2a_rows(m, &t1, A->recv_rows, &ts, A->send_rows, err, err_len) < 0)
            return -1;
        K->moe_permute_backward(m->dev, dh, &ts, &pos);
    } else
        K->moe_permute_backward(m->dev, dh, &dxp, &pos);
    K->zero(m->dev, &dlogits);
    /* AutoModel's load-balancing loss: the gradient of aux_loss_coeff E / (k T²) Σ load score-sum with
     * respect to the scores, over dp x micro-batches (moe.h) */
    struct am_tensor am_cnt = am_half(M, A, 0);
    double T = am_tokens(m, A->slot, N);
    float am_scale = M->am_aux ? (float)(M->am_coef * (double)M->E / ((double)M->k * T * T) / M->am_div) : 0.0f;
    /* AutoModel's loss has no gradient on the pads (its token_mask): the rows between the runs
     * that are no pad are taken back without it */
    const int64_t *runs = NULL;
    bool masked = M->am_aux && m->pk;
    int64_t all[2], nr = masked ? gate_runs(m, A->slot, N, all, &runs) : -1;
    for (int64_t r = 0, lo = 0; r <= nr; r++) {
        int64_t hi = r < nr ? runs[2 * r] : N;
        if (lo < hi) { /* pads: no loss's gradient */
            struct am_tensor dl = span(&dlogits, lo, hi), dw = span(&dwts, lo, hi), p = span(&probs, lo, hi),
                             i = span(&idx, lo, hi);
            if (M->sigmoid)
                K->moe_route_sigmoid_backward(m->dev, &dl, &dw, &p, &i, NULL, 0.0f, M->renorm, M->scale);
            else
                K->moe_route_backward(m->dev, &dl, &dw, &p, &i, NULL, 0.0f, M->renorm);
        }
        if (r < nr) {
            struct am_tensor dl = span(&dlogits, runs[2 * r], runs[2 * r + 1]),
                             dw = span(&dwts, runs[2 * r], runs[2 * r + 1]),
                             p = span(&probs, runs[2 * r], runs[2 * r + 1]), i = span(&idx, runs[2 * r], runs[2 * r + 1]);
            if (M->sigmoid)
                K->moe_route_sigmoid_backward(m->dev, &dl, &dw, &p, &i, &am_cnt, am_scale, M->renorm, M->scale);
            else
                K->moe_route_backward(m->dev, &dl, &dw, &p, &i, &am_cnt, am_scale, M->renorm);
            lo = runs[2 * r + 1];
        }
    }
    if (!masked) {
        if (M->sigmoid)
            K->moe_route_sigmoid_backward(m->dev, &dlogits, &dwts, &probs, &idx, M->am_aux ? &am_cnt : NULL, am_scale,
                                          M->renorm, M->scale);
        else
            K->moe_route_backward(m->dev, &dlogits, &dwts, &probs, &idx,
                                  M->aux_on ? &Sl->cnt : M->am_aux ? &am_cnt : NULL,
                                  M->aux_on ? Sl->aux_scale : am_scale, M->renorm);
    }
    if (X->router_b && !frozen)
        K->bias_backward(m->dev, &X->router_b->g, &dlogits);
    K->matmul_backward(m->dev, dh, frozen ? NULL : &X->router->g, &dlogits, in, &X->router->wc);
    return 0;
}

int am_moe_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, const struct am_tensor *dout,
                    const struct am_tensor *in, struct am_tensor *dh, char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    double t0 = am_mono_time(), e0 = M->experts_s;
    int rc = moe_backward(m, L, a, dout, in, dh, err, err_len);
    M->dispatch_s += am_mono_time() - t0 - (M->experts_s - e0);
    return rc;
}

/* Pipeline stages: the statistics that travel after a hidden state (am_moe_pipe_bytes), as
 * f32 [cnt E | psum E | scale 1] at msg (the message's trailer, on the device) */
static struct am_tensor trailer(const struct am_model *m, const void *msg, int64_t off, int64_t n)
{
    return am_tensor_view((char *)msg + off * (int64_t)sizeof(float), m->K->device, AM_F32, n, 0, 0, 0);
}

size_t am_moe_pipe_bytes(const struct am_model *m)
{
    const struct am_moe *M = m->moe;
    return M && M->aux_on && M->n_moe > 0 ? (size_t)(2 * M->E + 1) * sizeof(float) : 0;
}

void am_moe_forward_begin(struct am_model *m, int slot, const void *in)
{
    struct am_moe *M = m->moe;
    if (M) { /* a new micro-batch in the slot: its saved expert rows from the pool's start */
        M->slots[slot].used = 0;
        M->slots[slot].gen++;
    }
    if (!M || (!M->aux_on && !M->am_aux))
        return;
    struct moe_slot *Sl = &M->slots[slot];
    m->K->zero(m->dev, &Sl->aux);
    if (!M->aux_on)
        return;
    if (in) { /* the earlier stages' sums go on */
        struct am_tensor c = trailer(m, in, 0, M->E), p = trailer(m, in, M->E, M->E);
        m->K->copy(m->dev, &Sl->cnt, &c);
        m->K->copy(m->dev, &Sl->psum, &p);
        return;
    }
    m->K->zero(m->dev, &Sl->cnt);
    m->K->zero(m->dev, &Sl->psum);
}

/* Context parallelism: the statistics of the whole sequences (AutoModel's Gate under cp sums
 * expert_load, expert_scores and context_length over the cp group): cnt and psum summed over
 * the cp ranks in place, so that the backward's gradient uses the global counts too, and the
 * tokens with a target of the whole micro-batch (*valid: this rank's in, the group's out). */
static int cp_sum_stats(struct am_model *m, struct moe_slot *Sl, int64_t *valid, char *err, size_t err_len)
{
    struct am_comm *c = m->cp->comm;
    size_t E = (size_t)m->moe->E;
    m->K->upload(m->dev, Sl->valid.data, valid, sizeof(*valid));
    if (am_allreduce(c, Sl->cnt.data, Sl->cnt.data, E, AM_F32, AM_SUM, err, err_len) < 0 ||
        am_allreduce(c, Sl->psum.data, Sl->psum.data, E, AM_F32, AM_SUM, err, err_len) < 0 ||
        am_allreduce(c, Sl->valid.data, Sl->valid.data, 1, AM_I64, AM_SUM, err, err_len) < 0)
        return -1;
    m->K->download(m->dev, valid, Sl->valid.data, sizeof(*valid));
    return 0;
}

int am_moe_forward_end(struct am_model *m, int slot, int64_t N, const int32_t *targets, float dloss_scale, void *out,
                       char *err, size_t err_len)
{
    struct am_moe *M = m->moe;
    if (!M || !M->aux_on || M->n_moe == 0)
        return 0;
    struct moe_slot *Sl = &M->slots[slot];
    if (out) { /* a stage before the last: its sums go on to the next */
        struct am_tensor c = trailer(m, out, 0, M->E), p = trailer(m, out, M->E, M->E);
        m->K->copy(m->dev, &c, &Sl->cnt);
        m->K->copy(m->dev, &p, &Sl->psum);
        return 0;
    }
    int64_t valid = 0, all;
    for (int64_t i = 0; targets && i < N; i++)
        valid += targets[i] >= 0;
    all = valid;
    int cp = m->cp ? m->cp->size : 1;
    if (cp > 1 && cp_sum_stats(m, Sl, &all, err, err_len) < 0)
        return -1;
    /* aux = unit Σ cnt psum over the R rows of the whole sequences' MoE layers */
    double R = (double)M->n_moe * (double)(N * cp), unit = (double)M->E / (R * R);
    m->K->moe_aux_loss(m->dev, &Sl->aux, &Sl->cnt, &Sl->psum, unit);
    /* this rank's share of the loss, coef * aux * its targets; the gradient of the whole
     * micro-batch's coef * aux * (all its targets) with respect to this rank's probabilities */
    m->K->moe_aux_loss(m->dev, &m->scalars.loss, &Sl->cnt, &Sl->psum, M->coef * (double)valid * unit);
    Sl->aux_scale = (float)((double)dloss_scale * M->coef * (double)all * unit);
    M->last_slot = slot;
    return 0;
}

void am_moe_backward_begin(struct am_model *m, int slot, const void *in)
{
    struct am_moe *M = m->moe;
    if (!M || !M->aux_on || M->n_moe == 0 || !in)
        return;
    struct moe_slot *Sl = &M->slots[slot]; /* the whole model's counts, and the loss's gradient scale */
    struct am_tensor c = trailer(m, in, 0, M->E);
    m->K->copy(m->dev, &Sl->cnt, &c);
    m->K->download(m->dev, &Sl->aux_scale, (const float *)in + 2 * M->E, sizeof(float));
}

void am_moe_backward_end(struct am_model *m, int slot, void *out)
{
    struct am_moe *M = m->moe;
    if (!M || !M->aux_on || M->n_moe == 0 || !out)
        return;
    struct moe_slot *Sl = &M->slots[slot];
    struct am_tensor c = trailer(m, out, 0, M->E);
    m->K->copy(m->dev, &c, &Sl->cnt);
    m->K->upload(m->dev, (float *)out + 2 * M->E, &Sl->aux_scale, sizeof(float));
}

size_t am_moe_alltoall_bytes(const struct am_model *m)
{
    const struct am_moe *M = m->moe;
    if (!M || M->ep < 2)
        return 0;
    return (am_tensor_bytes(&M->ts) + 63) & ~(size_t)63;
}

bool am_moe_is_expert_param(const struct am_model *m, const struct am_param *p)
{
    if (!m->moe)
        return false;
    for (int l = 0; l < m->n_layers; l++) {
        const struct am_moe_layer *X = m->layers[l].moe;
        if (X && p >= X->w1 && p < X->w1 + (X->b1 ? 6 : 3) * m->moe->El)
            return true;
        if (X && X->la && p >= X->la && p < X->la + 5 * m->moe->El)
            return true;
    }
    return false;
}

void am_moe_fail_growth(struct am_model *m)
{
    if (m->moe && m->moe->ep > 1)
        m->moe->fail_growth = true;
}

void am_moe_set_aux_div(struct am_model *m, double div)
{
    if (m->moe && div > 0)
        m->moe->am_div = div;
}

void am_moe_stats_reset(struct am_model *m)
{
    if (m->moe) {
        memset(m->moe->step_counts, 0, (size_t)m->moe->E * sizeof(int64_t));
        if (m->moe->layer_loads)
            memset(m->moe->layer_loads, 0, (size_t)m->n_layers * (size_t)m->moe->E * sizeof(int64_t));
        m->moe->a2a_s = 0;
        m->moe->dispatch_s = m->moe->experts_s = 0;
        m->moe->step_recv = 0;
        m->moe->step_rows_max = m->moe->step_layer_max = 0;
    }
}

void am_moe_stats(struct am_model *m, struct am_moe_stats *out)
{
    memset(out, 0, sizeof(*out));
    struct am_moe *M = m->moe;
    if (!M)
        return;
    int64_t sum = 0;
    out->min = M->step_counts[0];
    for (int64_t e = 0; e < M->E; e++) {
        sum += M->step_counts[e];
        out->min = M->step_counts[e] < out->min ? M->step_counts[e] : out->min;
        out->max = M->step_counts[e] > out->max ? M->step_counts[e] : out->max;
    }
    out->alltoall_s = M->a2a_s;
    out->dispatch_s = M->dispatch_s;
    out->experts_s = M->experts_s;
    out->tokens_in = M->step_recv;
    out->rows_max = M->step_rows_max;
    out->layer_rows_max = M->step_layer_max;
    out->rows_bytes = am_moe_rows_bytes(m);
    out->imbalance = sum > 0 ? (double)out->max * (double)M->E / (double)sum : 0.0;
    if (M->aux_on || M->am_aux)
        m->K->download(m->dev, &out->aux, M->slots[M->last_slot].aux.data, sizeof(double));
}

void *am_moe_bias_loads(struct am_model *m, size_t *n)
{
    struct am_moe *M = m->moe;
    *n = 0;
    if (!M || !M->update || M->n_local == 0)
        return NULL;
    size_t E = (size_t)M->E, at = 0;
    for (int l = 0; l < m->n_layers; l++)
        if (m->layers[l].moe) {
            m->K->upload(m->dev, (int64_t *)M->loads.data + at, M->layer_loads + (size_t)l * E, E * sizeof(int64_t));
            at += E;
        }
    *n = at;
    return M->loads.data;
}

/* AutoModel's Gate.update_bias, in its dtypes: the loads as fp32, their mean in fp32, and the
 * fp32 bias plus sign(mean - load) times the factor (an fp32 product). */
void am_moe_bias_update(struct am_model *m)
{
    struct am_moe *M = m->moe;
    if (!M || !M->update || M->n_local == 0)
        return;
    size_t E = (size_t)M->E;
    int64_t *load = M->sum_host;
    float *b = M->bias_host;
    m->K->download(m->dev, load, M->loads.data, (size_t)M->n_local * E * sizeof(*load));
    for (int l = 0; l < m->n_layers; l++) {
        struct am_moe_layer *X = m->layers[l].moe;
        if (!X)
            continue;
        float sum = 0;
        for (size_t e = 0; e < E; e++)
            sum += (float)load[e];
        float mean = sum / (float)E;
        m->K->download(m->dev, b, X->bias.data, E * sizeof(*b));
        for (size_t e = 0; e < E; e++) {
            float d = mean - (float)load[e];
            float sign = d > 0 ? 1.0f : d < 0 ? -1.0f : 0.0f;
            b[e] = b[e] + sign * M->factor;
        }
        m->K->upload(m->dev, X->bias.data, b, E * sizeof(*b));
        load += E;
    }
}
