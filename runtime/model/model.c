/* model.c - the Llama decoder over the kernel table (model.h).
 *
 * Reading order: shapes and parameters (init), then forward and backward of one
 * micro-batch, block by block, each backward below its forward in reverse.
 */
#include "model.h"
#include "lora.h"
#include "moe.h"
#include "packed.h"
#include "ring.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "rng.h"
#include "util.h"

/* ---- parameters ---------------------------------------------------------------------- */

/* Registers a parameter of local shape rows x cols (cols 0: a vector). */
struct am_param *am_model_add_param(struct am_model *m, const char *name, int64_t rows, int64_t cols,
                                    enum am_split split, int64_t full_rows, int64_t full_cols, int64_t row0,
                                    int64_t col0)
{
    struct am_param *p = &m->params[m->n_params++];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->w = am_tensor_view(NULL, m->K->device, AM_F32, rows, cols, 0, 0);
    p->g = p->w;
    p->wc = am_tensor_view(NULL, m->K->device, m->act_dt, rows, cols, 0, 0);
    p->split = split;
    p->full_rows = full_rows;
    p->full_cols = full_cols;
    p->row0 = row0;
    p->col0 = col0;
    p->copies_in_tp = split == AM_SPLIT_NONE ? m->sh.tp : 1;
    p->partial_in_tp = split == AM_SPLIT_NONE && m->sh.sequence_parallel; /* the norms of the stream's rows */
    m->n_elems += (size_t)am_tensor_numel(&p->w);
    return p;
}
#define add_param am_model_add_param

/* LoRA (lora.h): A and B of each adapted projection, after the layer's own parameters, split
 * over tp with their base layer; the tp ranks' partial gradients (A beside a column-parallel
 * layer, B beside a row-parallel one) summed in am_model_finish_grads. */
static void lora_params(struct am_model *m, int l, struct am_layer *L)
{
    static const char *const names[AM_LORA_NPROJ] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj"};
    const struct am_param *base[AM_LORA_NPROJ] = {L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down};
    int64_t rk = m->sh.lora_r;
    for (int t = 0; rk > 0 && t < AM_LORA_NPROJ; t++) {
        if (!(m->sh.lora_targets >> t & 1u) || !base[t])
            continue;
        bool row = base[t]->split == AM_SPLIT_COLS;
        int64_t in = base[t]->full_cols, out = base[t]->full_rows, a_cols, a0, b_rows, b0;
        am_lora_split(in, out, row, m->sh.tp, m->sh.tp_rank, &a_cols, &a0, &b_rows, &b0);
        if (!row) { /* a kv projection held by several ranks keeps its rows (row0, its own kv head) */
            b_rows = base[t]->w.shape[0];
            b0 = base[t]->row0;
        }
        char n[128];
        snprintf(n, sizeof(n), "model.layers.%d.%s.lora_A.weight", l, names[t]);
        L->lora_a[t] = add_param(m, n, rk, a_cols, row ? AM_SPLIT_COLS : AM_SPLIT_NONE, rk, in, 0, a0);
        snprintf(n, sizeof(n), "model.layers.%d.%s.lora_B.weight", l, names[t]);
        L->lora_b[t] = add_param(m, n, b_rows, rk, row ? AM_SPLIT_NONE : AM_SPLIT_ROWS, out, rk, b0, 0);
        struct am_param *partial = row ? L->lora_b[t] : L->lora_a[t];
        partial->partial_in_tp = m->sh.tp > 1;
        if (!row)
            L->lora_b[t]->copies_in_tp = base[t]->copies_in_tp;
    }
}

static void layer_params(struct am_model *m, int l, int local)
{
    const struct am_model_config *c = &m->cfg;
    int64_t C = c->hidden_size, D = m->head_dim, r = m->sh.tp_rank;
    int64_t Hq = c->num_attention_heads * D, Hkv = c->num_key_value_heads * D;
    char n[96];
    struct am_layer *L = &m->layers[local];
#define NAME(s) (snprintf(n, sizeof(n), "model.layers.%d.%s", l, s), n)
    L->attn_norm = add_param(m, NAME("input_layernorm.weight"), C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
    if (c->gemma) { /* Gemma: the norm of the attention's output, then the MLP's pre- and post-norms */
        L->post_attn_norm = add_param(m, NAME("post_attention_layernorm.weight"), C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
        L->post_mlp_norm = add_param(m, NAME("post_feedforward_layernorm.weight"), C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
    }
    /* transformers' order: each projection's weight, then its bias (Qwen2: q, k, v) */
    L->wq = add_param(m, NAME("self_attn.q_proj.weight"), m->heads * D, C, AM_SPLIT_ROWS, Hq, C, r * m->heads * D, 0);
    if (c->qkv_bias)
        L->bq = add_param(m, NAME("self_attn.q_proj.bias"), m->heads * D, 0, AM_SPLIT_ROWS, Hq, 0, r * m->heads * D, 0);
    L->wk = add_param(m, NAME("self_attn.k_proj.weight"), m->kv_heads * D, C, AM_SPLIT_ROWS, Hkv, C, m->kv_head0 * D, 0);
    if (c->qkv_bias)
        L->bk = add_param(m, NAME("self_attn.k_proj.bias"), m->kv_heads * D, 0, AM_SPLIT_ROWS, Hkv, 0,
                            m->kv_head0 * D, 0);
    L->wv = add_param(m, NAME("self_attn.v_proj.weight"), m->kv_heads * D, C, AM_SPLIT_ROWS, Hkv, C, m->kv_head0 * D, 0);
    if (c->qkv_bias)
        L->bv = add_param(m, NAME("self_attn.v_proj.bias"), m->kv_heads * D, 0, AM_SPLIT_ROWS, Hkv, 0,
                            m->kv_head0 * D, 0);
    if (c->num_key_value_heads < m->sh.tp) { /* each kv head is held by tp / kv heads ranks */
        int copies = (int)(m->sh.tp / c->num_key_value_heads);
        L->wk->copies_in_tp = L->wv->copies_in_tp = copies;
        if (L->bk)
            L->bk->copies_in_tp = L->bv->copies_in_tp = copies;
    }
    if (c->qk_norm) { /* transformers' order: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm */
        L->q_norm = add_param(m, NAME("self_attn.q_norm.weight"), D, 0, AM_SPLIT_NONE, D, 0, 0, 0);
        L->k_norm = add_param(m, NAME("self_attn.k_norm.weight"), D, 0, AM_SPLIT_NONE, D, 0, 0, 0);
        L->q_norm->partial_in_tp = L->k_norm->partial_in_tp = m->sh.tp > 1; /* each rank saw its own heads */
    }
    L->window = am_model_layer_window(c, l);
    L->local_rope = c->rope_local_base_freq > 0 && L->window > 0;
    L->wo = add_param(m, NAME("self_attn.o_proj.weight"), C, m->heads * D, AM_SPLIT_COLS, C, Hq, 0, r * m->heads * D);
    L->mlp_norm = add_param(m, NAME(c->gemma ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"), C,
                            0, AM_SPLIT_NONE, C, 0, 0, 0);
    if (am_model_layer_is_moe(c, l)) { /* the router and the experts in place of the MLP */
        am_moe_layer_params(m, l, L);
        return;
    }
    L->w_gate = add_param(m, NAME("mlp.gate_proj.weight"), m->inter, C, AM_SPLIT_ROWS, c->intermediate_size, C,
                          r * m->inter, 0);
    L->w_up = add_param(m, NAME("mlp.up_proj.weight"), m->inter, C, AM_SPLIT_ROWS, c->intermediate_size, C,
                        r * m->inter, 0);
    L->w_down = add_param(m, NAME("mlp.down_proj.weight"), C, m->inter, AM_SPLIT_COLS, C, c->intermediate_size, 0,
                          r * m->inter);
#undef NAME
}

/* The device scalars, in one allocation read at once (am_model_read_scalars). */
struct scalar_block {
    double loss, sumsq, local_sumsq;
    float loss_f, sumsq_f;
    int32_t flag;
};

/* Starts parameter group `kind` with the next parameter registered (model.h). */
void am_model_begin_group(struct am_model *m, enum am_pgroup_kind kind, int layer, const char *name)
{
    struct am_pgroup *g = &m->groups[m->n_groups++];
    *g = (struct am_pgroup){.kind = kind, .layer = layer, .first = m->n_params, .shard = AM_SHARD_REPLICATED};
    snprintf(g->name, sizeof(g->name), "%s", name);
}
#define begin_group am_model_begin_group

/* A tied embedding split over the first and the last pipeline stage: each holds a copy. */
static bool tied_across_stages(const struct am_model *m)
{
    return m->pp_comm && m->cfg.tie_word_embeddings && m->sh.first_stage != m->sh.last_stage;
}

static size_t align_up(size_t n, int align) { return align > 1 ? (n + (size_t)align - 1) / (size_t)align * (size_t)align : n; }

/* The slab offset of each parameter: consecutive, each group's span padded to group_align. */
static size_t param_offsets(struct am_model *m, size_t *offs)
{
    size_t off = 0;
    for (int g = 0, i = 0; g < m->n_groups; g++) {
        size_t start = off;
        int end = g + 1 < m->n_groups ? m->groups[g + 1].first : m->n_params;
        for (; i < end; i++) {
            offs[i] = off;
            off += (size_t)am_tensor_numel(&m->params[i].w);
        }
        off = start + align_up(off - start, m->sh.group_align);
    }
    return off;
}

/* Each group's span of the slabs, and whether it holds a tied copy split over stages. */
static void end_groups(struct am_model *m)
{
    for (int i = 0; i < m->n_groups; i++) {
        struct am_pgroup *g = &m->groups[i];
        g->n = (i + 1 < m->n_groups ? m->groups[i + 1].first : m->n_params) - g->first;
        g->offset = m->params[g->first].slab_off;
        g->n_elems = 0;
        for (int k = g->first; k < g->first + g->n; k++) {
            g->n_elems += (size_t)am_tensor_numel(&m->params[k].g);
            g->tied |= tied_across_stages(m) && (&m->params[k] == m->embed || &m->params[k] == m->head);
        }
        g->span = align_up(g->n_elems, m->sh.group_align);
    }
}

/* The next tensor of a slab: at byte offset *off of base (base NULL: only measures). */
struct slab {
    char *base;
    size_t off;
    enum am_device dev;
};

static struct am_tensor carve(struct slab *s, enum am_dtype dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    struct am_tensor t = am_tensor_view(s->base ? s->base + s->off : NULL, s->dev, dt, d0, d1, d2, d3);
    s->off += (am_tensor_bytes(&t) + 63) & ~(size_t)63;
    return t;
}

/* Rows of the residual stream on this rank for n tokens: all, or 1/tp with sequence parallelism. */
static int64_t stream_rows(const struct am_model *m, int64_t n) { return m->sh.sequence_parallel ? n / m->sh.tp : n; }

/* A layer's saved tensors but x_in (own per slot, or the shared work set with recompute). */
static void carve_layer(struct am_model *m, struct slab *c, struct am_layer_acts *a)
{
    int64_t N = m->max_tokens, R = stream_rows(m, N), C = m->cfg.hidden_size, D = m->head_dim;
    int64_t Q = m->heads * D, KV = m->kv_heads * D, I = m->inter, B = N / m->seq_len, T = m->seq_len;
    a->h1 = carve(c, m->act_dt, R, C, 0, 0);
    a->rstd1 = carve(c, AM_F32, R, 0, 0, 0);
    a->q = carve(c, m->act_dt, N, Q, 0, 0);
    a->k = carve(c, m->act_dt, N, KV, 0, 0);
    if (m->cfg.qk_norm) {
        a->q_raw = carve(c, m->act_dt, N, Q, 0, 0);
        a->k_raw = carve(c, m->act_dt, N, KV, 0, 0);
        a->rstd_q = carve(c, AM_F32, N * m->heads, 0, 0, 0);
        a->rstd_k = carve(c, AM_F32, N * m->kv_heads, 0, 0, 0);
    }
    a->v = carve(c, m->act_dt, N, KV, 0, 0);
    a->att = carve(c, m->act_dt, N, Q, 0, 0);
    a->lse = carve(c, AM_F32, B, m->heads, T, 0);
    a->x_mid = carve(c, m->act_dt, R, C, 0, 0);
    a->h2 = carve(c, m->act_dt, R, C, 0, 0);
    a->rstd2 = carve(c, AM_F32, R, 0, 0, 0);
    a->gate = carve(c, m->act_dt, N, I, 0, 0);
    a->up = carve(c, m->act_dt, N, I, 0, 0);
    a->act = carve(c, m->act_dt, N, I, 0, 0);
    for (int t = 0; m->sh.lora_r > 0 && t < AM_LORA_NPROJ; t++)
        if (m->sh.lora_targets >> t & 1u)
            a->lora_t[t] = carve(c, m->act_dt, N, m->sh.lora_r, 0, 0);
    if (m->cfg.gemma) {
        a->o_att = carve(c, m->act_dt, R, C, 0, 0);
        a->rstd_oa = carve(c, AM_F32, R, 0, 0, 0);
        a->o_mlp = carve(c, m->act_dt, R, C, 0, 0);
        a->rstd_om = carve(c, AM_F32, R, 0, 0, 0);
    }
}

/* Lays out (base NULL: only measures) the activation buffers: each slot's saved tensors,
 * then the scratch every micro-batch shares. */
static size_t layout_acts(struct am_model *m, char *base)
{
    int64_t N = m->max_tokens, R = stream_rows(m, N), C = m->cfg.hidden_size, D = m->head_dim;
    int64_t Q = m->heads * D, KV = m->kv_heads * D, I = m->inter, T = m->seq_len;
    struct slab c = {.base = base, .dev = m->K->device};
    for (int k = 0; k < m->sh.n_chunks; k++) {
        for (int s = 0; s < m->sh.chunks[k].slots; s++) {
            struct am_slot *S = &m->slots[m->slot_base[k] + s];
            for (int l = 0; l < m->sh.chunks[k].n_layers; l++) {
                S->acts[l].x_in = carve(&c, m->act_dt, R, C, 0, 0);
                if (!m->sh.recompute)
                    carve_layer(m, &c, &S->acts[l]);
            }
            if (m->sh.first_stage && k == 0)
                S->tokens = carve(&c, AM_I32, N, 0, 0, 0);
            if (m->sh.last_stage && k == m->sh.n_chunks - 1) {
                S->targets = carve(&c, AM_I32, N, 0, 0, 0);
                S->xf = carve(&c, m->act_dt, R, C, 0, 0);
                S->hf = carve(&c, m->act_dt, N, C, 0, 0);
                S->rstdf = carve(&c, AM_F32, R, 0, 0, 0);
                S->ce_m = carve(&c, AM_F32, N, 0, 0, 0);
                S->ce_s = carve(&c, AM_F32, N, 0, 0, 0);
            }
        }
    }
    if (m->sh.recompute) {
        struct am_layer_acts work;
        carve_layer(m, &c, &work);
        for (size_t i = 0; i < m->n_acts; i++) {
            struct am_tensor x_in = m->acts_mem[i].x_in;
            m->acts_mem[i] = work;
            m->acts_mem[i].x_in = x_in;
        }
    }
    m->x = carve(&c, m->act_dt, R, C, 0, 0);
    m->dx = carve(&c, m->act_dt, R, C, 0, 0);
    m->dhf = carve(&c, m->act_dt, N, C, 0, 0);
    m->cos = carve(&c, AM_F32, T, D / 2, 0, 0);
    m->sin = carve(&c, AM_F32, T, D / 2, 0, 0);
    m->ce_t = carve(&c, AM_F32, N, 0, 0, 0);
    if (m->sh.tp > 1)
        m->ce_M = carve(&c, AM_F32, N, 0, 0, 0);
    if (m->sh.tp > m->cfg.num_key_value_heads) /* k's and v's weights (and biases) of every kv head */
        m->kv_sum = carve(&c, AM_F32, 2 * m->cfg.num_key_value_heads * D * (C + (m->cfg.qkv_bias ? 1 : 0)), 0, 0, 0);
    m->scratch_c = carve(&c, m->act_dt, N, C, 0, 0);
    m->scratch_q = carve(&c, m->act_dt, N, Q, 0, 0);
    m->scratch_att = carve(&c, m->act_dt, N, Q, 0, 0);
    m->scratch_kv_k = carve(&c, m->act_dt, N, KV, 0, 0);
    m->scratch_kv_v = carve(&c, m->act_dt, N, KV, 0, 0);
    m->scratch_mlp = carve(&c, m->act_dt, N, 3 * I, 0, 0); /* dact, dgate, dup */
    if (m->cfg.qk_norm)
        m->scratch_kn = carve(&c, m->act_dt, N, KV, 0, 0);
    if (m->cfg.gemma)
        m->scratch_post = carve(&c, m->act_dt, R, C, 0, 0);
    if (m->sh.lora_r > 0) {
        int64_t wide = Q > C ? Q : C;
        wide = I > wide ? I : wide;
        m->lora_u = carve(&c, m->act_dt, N, wide, 0, 0);
        m->lora_du = carve(&c, m->act_dt, N, wide, 0, 0);
        m->lora_dt = carve(&c, m->act_dt, N, m->sh.lora_r, 0, 0);
    }
    if (m->cfg.rope_local_base_freq > 0) {
        m->cos_local = carve(&c, AM_F32, T, D / 2, 0, 0);
        m->sin_local = carve(&c, AM_F32, T, D / 2, 0, 0);
    }
    if (m->sh.sequence_parallel) {
        m->gathered = carve(&c, m->act_dt, N, C, 0, 0);
        m->scratch_rows = carve(&c, m->act_dt, R, C, 0, 0);
    }
    return c.off;
}

/* The chunks must be non-empty runs of layers in model order. */
static int check_shard(const struct am_model_shard *sh, const struct am_model_config *cfg, char *err, size_t err_len)
{
    if (sh->n_chunks < 1 || sh->n_chunks > AM_MAX_CHUNKS)
        return am_fail(err, err_len, "model: %d pipeline chunks on one rank (1 to %d are supported)", sh->n_chunks,
                    AM_MAX_CHUNKS);
    int next = 0;
    for (int c = 0; c < sh->n_chunks; c++) {
        const struct am_chunk *k = &sh->chunks[c];
        if (k->n_layers < 1 || k->first_layer < next || k->first_layer + k->n_layers > cfg->num_hidden_layers)
            return am_fail(err, err_len, "model: chunk %d (layers %d..%d) is not a run of layers after the previous "
                        "chunk within the model's %ld", c, k->first_layer, k->first_layer + k->n_layers - 1,
                        (long)cfg->num_hidden_layers);
        next = k->first_layer + k->n_layers;
    }
    return 0;
}

int am_model_init(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                  const struct am_dev *dev, struct am_comm *tp_comm, struct am_comm *pp_comm, int64_t batch,
                  int64_t seq_len, char *err, size_t err_len)
{
    memset(m, 0, sizeof(*m));
    m->where = (struct am_model_where){AM_PHASE_SETUP, AM_WHERE_NONE};
    m->cfg = *cfg;
    m->sh = *sh;
    m->dev = dev;
    m->K = dev->k;
    const struct am_kernels *K = m->K;
    m->tp_comm = sh->tp > 1 ? tp_comm : NULL;
    m->pp_comm = pp_comm;
    m->sh.sequence_parallel = sh->sequence_parallel && sh->tp > 1;
    m->act_dt = sh->compute;
    if (m->act_dt != AM_F32 && m->act_dt != AM_BF16)
        return am_fail(err, err_len, "model: compute dtype %s: the model computes in fp32 or bf16 (mixed precision)",
                       am_dtype_name(m->act_dt));
    if (check_shard(sh, cfg, err, err_len) < 0)
        return -1;
    if (m->sh.sequence_parallel && (batch * seq_len) % sh->tp)
        return am_fail(err, err_len, "model: sequence parallelism splits the %lld tokens of a micro-batch over tp = %d "
                    "ranks: they must divide evenly", (long long)(batch * seq_len), sh->tp);
    if (am_moe_check(cfg, sh, err, err_len) < 0)
        return -1;
    if (sh->lora_r > 0 && (sh->lora_targets & (1u << AM_LORA_PK | 1u << AM_LORA_PV)) &&
        cfg->num_key_value_heads < sh->tp)
        return am_fail(err, err_len, "model: LoRA on k_proj or v_proj with tp = %d above the %ld kv heads (each kv "
                       "head shared by several tp ranks) is not supported yet", sh->tp, (long)cfg->num_key_value_heads);
    int tp = sh->tp;
    int64_t H = cfg->num_attention_heads, KVH = cfg->num_key_value_heads;
    m->head_dim = cfg->head_dim;
    m->heads = H / tp;
    if (KVH >= tp) {
        m->kv_heads = KVH / tp;
        m->kv_head0 = sh->tp_rank * m->kv_heads;
    } else {
        m->kv_heads = 1;
        m->kv_head0 = sh->tp_rank * m->heads / (H / KVH);
    }
    m->inter = cfg->intermediate_size / tp;
    m->vocab_shard = cfg->vocab_size / tp;
    m->vocab_start = sh->tp_rank * m->vocab_shard;
    m->max_tokens = batch * seq_len;
    m->seq_len = seq_len;
    for (int c = 0; c < sh->n_chunks; c++) {
        if (m->sh.chunks[c].slots < 1)
            m->sh.chunks[c].slots = 1;
        m->chunk_base[c] = m->n_layers;
        m->slot_base[c] = m->n_slots;
        m->n_layers += sh->chunks[c].n_layers;
        m->n_slots += m->sh.chunks[c].slots;
        m->n_acts += (size_t)m->sh.chunks[c].slots * (size_t)sh->chunks[c].n_layers;
    }

    m->params = calloc((size_t)((16 + (sh->lora_r > 0 ? 2 * AM_LORA_NPROJ : 0)) * m->n_layers + 4 +
                                am_moe_extra_params(cfg, m->n_layers)), sizeof(*m->params));
    m->groups = calloc((size_t)(2 * m->n_layers + 3), sizeof(*m->groups));
    m->layers = calloc((size_t)m->n_layers, sizeof(*m->layers));
    m->slots = calloc((size_t)m->n_slots, sizeof(*m->slots));
    m->acts_mem = calloc(m->n_acts + 1, sizeof(*m->acts_mem));
    if (!m->params || !m->groups || !m->layers || !m->slots || !m->acts_mem)
        goto oom;
    struct am_layer_acts *next = m->acts_mem;
    for (int c = 0; c < sh->n_chunks; c++)
        for (int s = 0; s < m->sh.chunks[c].slots; s++, next += sh->chunks[c].n_layers)
            m->slots[m->slot_base[c] + s].acts = next;
    int64_t C = cfg->hidden_size, V = cfg->vocab_size, r = sh->tp_rank;
    if (sh->first_stage) {
        begin_group(m, AM_PG_EMBED, -1, "embed");
        m->embed = add_param(m, "model.embed_tokens.weight", m->vocab_shard, C, AM_SPLIT_ROWS, V, C,
                             r * m->vocab_shard, 0);
    }
    for (int c = 0; c < sh->n_chunks; c++)
        for (int i = 0; i < sh->chunks[c].n_layers; i++) {
            char name[32];
            snprintf(name, sizeof(name), "layers.%d", sh->chunks[c].first_layer + i);
            m->layers[m->chunk_base[c] + i].group = m->n_groups;
            begin_group(m, AM_PG_LAYER, m->chunk_base[c] + i, name);
            layer_params(m, sh->chunks[c].first_layer + i, m->chunk_base[c] + i);
        }
    if (sh->last_stage) {
        begin_group(m, AM_PG_HEAD, -1, "head");
        m->final_norm = add_param(m, "model.norm.weight", C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
        if (cfg->tie_word_embeddings && sh->first_stage)
            m->head = m->embed;
        else
            m->head = add_param(m, cfg->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
                                m->vocab_shard, C, AM_SPLIT_ROWS, V, C, r * m->vocab_shard, 0);
    }
    if (sh->lora_r > 0) { /* LoRA: every adapter of the rank's layers in one group, the last */
        begin_group(m, AM_PG_LORA, -1, "lora");
        for (int c = 0; c < sh->n_chunks; c++)
            for (int i = 0; i < sh->chunks[c].n_layers; i++)
                lora_params(m, sh->chunks[c].first_layer + i, &m->layers[m->chunk_base[c] + i]);
        if (m->groups[m->n_groups - 1].first == m->n_params) /* no adapted projection here */
            m->n_groups--;
    }
    /* one slab for the values, one for the gradients (each group padded to group_align: the
     * padding stays zero) */
    size_t *offs = malloc(((size_t)m->n_params + 1) * sizeof(*offs));
    if (!offs)
        goto oom;
    m->slab_elems = param_offsets(m, offs);
    m->param_mem = K->alloc(m->dev, m->slab_elems * sizeof(float));
    /* LoRA freezes the base: the gradient slab is the adapters' group alone, the last */
    m->grad_off = 0;
    m->grad_elems = m->slab_elems;
    if (sh->lora_r > 0) {
        const struct am_pgroup *L = &m->groups[m->n_groups - 1];
        m->grad_off = L->kind == AM_PG_LORA && L->first < m->n_params ? offs[L->first] : m->slab_elems;
        m->grad_elems = m->slab_elems - m->grad_off;
        for (int g = 0; g < m->n_groups; g++)
            m->groups[g].frozen = m->groups[g].kind != AM_PG_LORA;
    }
    m->grad_mem = K->alloc(m->dev, (m->grad_elems ? m->grad_elems : 1) * sizeof(float));
    if (m->act_dt != AM_F32 && m->param_mem &&
        !(m->param_lp_mem = K->alloc(m->dev, m->slab_elems * am_dtype_size(m->act_dt)))) {
        free(offs);
        goto oom;
    }
    if (!m->param_mem || !m->grad_mem) {
        free(offs);
        goto oom;
    }
    if (m->slab_elems != m->n_elems) {
        struct am_tensor all = am_tensor_view(m->param_mem, dev->device, AM_F32, (int64_t)m->slab_elems, 0, 0, 0);
        K->zero(m->dev, &all);
    }
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        size_t off = offs[i];
        p->slab_off = off;
        p->w.data = (float *)m->param_mem + off;
        p->g.data = off >= m->grad_off ? (float *)m->grad_mem + (off - m->grad_off) : NULL;
        p->wc.data = m->param_lp_mem ? (char *)m->param_lp_mem + off * am_dtype_size(m->act_dt) : p->w.data;
    }
    free(offs);
    end_groups(m);
    m->scalar_mem = K->alloc(m->dev, sizeof(struct scalar_block));
    if (!m->scalar_mem)
        goto oom;
    m->scalars.loss = am_tensor_view(m->scalar_mem, dev->device, AM_F64, 1, 0, 0, 0);
    m->scalars.sumsq = am_tensor_view((char *)m->scalar_mem + offsetof(struct scalar_block, sumsq), dev->device,
                                      AM_F64, 1, 0, 0, 0);
    m->scalars.local_sumsq = am_tensor_view((char *)m->scalar_mem + offsetof(struct scalar_block, local_sumsq),
                                            dev->device, AM_F64, 1, 0, 0, 0);
    m->scalars.loss_f = am_tensor_view((char *)m->scalar_mem + offsetof(struct scalar_block, loss_f), dev->device,
                                       AM_F32, 1, 0, 0, 0);
    m->scalars.sumsq_f = am_tensor_view((char *)m->scalar_mem + offsetof(struct scalar_block, sumsq_f), dev->device,
                                        AM_F32, 1, 0, 0, 0);
    m->scalars.flag = am_tensor_view((char *)m->scalar_mem + offsetof(struct scalar_block, flag), dev->device,
                                     AM_I32, 1, 0, 0, 0);
    m->act_bytes = layout_acts(m, NULL);
    m->act_mem = K->alloc(m->dev, m->act_bytes);
    if (!m->act_mem)
        goto oom;
    layout_acts(m, m->act_mem);
    if (am_moe_init(m, err, err_len) < 0) {
        am_model_free(m);
        return -1;
    }
    struct am_rope_scaling rs = {cfg->rope_scaling.type, cfg->rope_scaling.factor, cfg->rope_scaling.low_freq_factor,
                                 cfg->rope_scaling.high_freq_factor,
                                 cfg->rope_scaling.original_max_position_embeddings};
    K->rope_tables(dev, &m->cos, &m->sin, cfg->rope_theta, &rs);
    if (cfg->rope_local_base_freq > 0) /* Gemma 3's sliding layers: their own theta, unscaled */
        K->rope_tables(dev, &m->cos_local, &m->sin_local, cfg->rope_local_base_freq, NULL);
    return 0;
oom:;
    size_t n_elems = m->n_elems;
    int n_slots = m->n_slots;
    am_model_free(m);
    return am_fail(err, err_len, "model: out of memory for %zu parameters and activations of %d x %lld tokens",
                n_elems, n_slots, (long long)(batch * seq_len));
}

void am_model_free(struct am_model *m)
{
    if (m->K) {
        if (m->param_mem)
            m->K->free(m->dev, m->param_mem);
        if (m->grad_mem)
            m->K->free(m->dev, m->grad_mem);
        if (m->param_lp_mem)
            m->K->free(m->dev, m->param_lp_mem);
        if (m->act_mem)
            m->K->free(m->dev, m->act_mem);
        if (m->scalar_mem)
            m->K->free(m->dev, m->scalar_mem);
        am_moe_free(m);
        am_cp_free(m);
        am_packed_free(m);
    }
    free(m->params);
    free(m->groups);
    free(m->layers);
    free(m->slots);
    free(m->acts_mem);
    memset(m, 0, sizeof(*m));
}

static bool is_bias(const struct am_param *p)
{
    size_t n = strlen(p->name);
    return n > 5 && strcmp(p->name + n - 5, ".bias") == 0;
}

void am_model_init_weights(struct am_model *m, uint64_t seed)
{
    double std = m->cfg.initializer_range;
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (am_model_is_lora(p)) /* am_model_init_lora */
            continue;
        int64_t rows = p->w.shape[0], cols = p->w.ndim > 1 ? p->w.shape[1] : 1;
        float *host = malloc((size_t)(rows * cols) * sizeof(float));
        if (!host)
            continue;
        uint64_t stream = am_hash_str(p->name);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                if (p->w.ndim == 1) { /* RMSNorm weights 1 (Gemma's, 1 + w: 0), biases 0 (transformers' _init_weights) */
                    host[r] = is_bias(p) || m->cfg.gemma ? 0.0f : 1.0f;
                    continue;
                }
                uint64_t idx = (uint64_t)((p->row0 + r) * p->full_cols + p->col0 + c);
                host[r * cols + c] = (float)(std * am_rng_normal(seed, stream, idx));
            }
        m->K->upload(m->dev, p->w.data, host, (size_t)(rows * cols) * sizeof(float));
        free(host);
    }
    am_model_cast_weights(m);
}

bool am_model_is_lora(const struct am_param *p) { return strstr(p->name, ".lora_A.") || strstr(p->name, ".lora_B."); }

void am_model_init_lora(struct am_model *m, uint64_t seed, bool kaiming)
{
    for (int i = 0; i < m->n_params; i++) {
        struct am_param *p = &m->params[i];
        if (!am_model_is_lora(p))
            continue;
        int64_t rows = p->w.shape[0], cols = p->w.shape[1];
        float *host = calloc((size_t)(rows * cols), sizeof(float));
        if (!host)
            continue;
        uint64_t stream = am_hash_str(p->name);
        double in = (double)p->full_cols, r = (double)p->full_rows;
        for (int64_t y = 0; strstr(p->name, ".lora_A.") && y < rows; y++) /* B stays zero */
            for (int64_t c = 0; c < cols; c++) {
                uint64_t idx = (uint64_t)((p->row0 + y) * p->full_cols + p->col0 + c);
                host[y * cols + c] = kaiming ? (float)((2 * am_rng_uniform(seed, stream, idx) - 1) / sqrt(in))
                                             : (float)(sqrt(2.0 / (in + r)) * am_rng_normal(seed, stream, idx));
            }
        m->K->upload(m->dev, p->w.data, host, (size_t)(rows * cols) * sizeof(float));
        free(host);
    }
    am_model_cast_weights(m);
}

void am_model_cast_weights(struct am_model *m)
{
    if (!m->param_lp_mem || !m->param_mem)
        return;
    struct am_tensor w = am_tensor_view(m->param_mem, m->K->device, AM_F32, (int64_t)m->slab_elems, 0, 0, 0);
    struct am_tensor c = am_tensor_view(m->param_lp_mem, m->K->device, m->act_dt, (int64_t)m->slab_elems, 0, 0, 0);
    m->K->convert(m->dev, &c, &w);
}

void am_model_drop_weights(struct am_model *m)
{
    if (m->param_mem)
        m->K->free(m->dev, m->param_mem);
    if (m->param_lp_mem)
        m->K->free(m->dev, m->param_lp_mem);
    m->param_mem = m->param_lp_mem = NULL;
    for (int i = 0; i < m->n_params; i++)
        m->params[i].w.data = m->params[i].wc.data = NULL;
}

void am_model_drop_grads(struct am_model *m)
{
    if (m->grad_mem)
        m->K->free(m->dev, m->grad_mem);
    m->grad_mem = NULL;
    for (int i = 0; i < m->n_params; i++)
        m->params[i].g.data = NULL;
}

int am_model_group_also(const struct am_model *m, int group)
{
    if (group < 0 || group >= m->n_groups)
        return -1;
    if (m->embed && m->head == m->embed && m->groups[group].kind == AM_PG_HEAD)
        return 0;
    return group + 1 < m->n_groups && m->groups[group].kind == AM_PG_LAYER &&
                   m->groups[group + 1].kind == AM_PG_EXPERTS
               ? group + 1
               : -1;
}

void am_model_begin_step(struct am_model *m)
{
    am_model_cast_weights(m);
    if (m->grad_mem && m->grad_elems) {
        struct am_tensor g = am_tensor_view(m->grad_mem, m->K->device, AM_F32, (int64_t)m->grad_elems, 0, 0, 0);
        m->K->zero(m->dev, &g);
    }
    m->K->zero(m->dev, &m->scalars.loss);
    m->K->zero(m->dev, &m->scalars.local_sumsq);
    am_moe_stats_reset(m);
}

const char *am_model_phase_name(enum am_model_phase p)
{
    switch (p) {
    case AM_PHASE_SETUP: return "setup";
    case AM_PHASE_FORWARD: return "forward";
    case AM_PHASE_BACKWARD: return "backward";
    case AM_PHASE_GRAD_SYNC: return "grad_sync";
    case AM_PHASE_OPTIMIZER: return "optimizer";
    }
    return "setup";
}

int am_model_find(const struct am_model *m, const char *name)
{
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return i;
    return -1;
}

/* ---- helpers for one micro-batch ----------------------------------------------------- */

/* A view of the first `rows` rows of a [max_rows, ...] buffer. */
static struct am_tensor rows_of(const struct am_tensor *t, int64_t rows)
{
    struct am_tensor v = *t;
    v.shape[0] = rows;
    return v;
}

static int64_t am_rows_of(const struct am_tensor *t) { return t->shape[0]; }

/* [N, H*D] as [N*H, D]: one row per head of each token */
static struct am_tensor head_rows(const struct am_tensor *t, int64_t rows, int64_t D)
{
    return am_tensor_view(t->data, t->device, t->dtype, rows, D, 0, 0);
}

/* [N, H*D] as [B, T, H, D] */
static struct am_tensor heads_of(const struct am_tensor *t, int64_t B, int64_t T, int64_t H, int64_t D)
{
    return am_tensor_view(t->data, t->device, t->dtype, B, T, H, D);
}

/* The communicators' name for a tensor's dtype (f32 or bf16 here). */

/* Tensor-parallel collectives are on the critical path. On a GPU they go through the
 * non-blocking calls: the collective is enqueued after the kernels that wrote its buffer (an
 * event on the compute stream), and am_comm_wait makes the compute stream wait for its end on
 * the device, so the host goes on enqueuing kernels (no host wait per collective; the trainer's
 * am_comm_stream_wait once a step catches one that never completes). The CPU's blocking calls
 * stay as they are: the same bits either way (comm.h). */
static int tp_on_device(const struct am_model *m) { return m->dev->device == AM_DEV_CUDA; }

/* t reduced in place over the tp group (none: t as it is). */
static int tp_reduce(struct am_model *m, struct am_tensor *t, enum am_comm_op op, char *err, size_t err_len)
{
    if (!m->tp_comm)
        return 0;
    size_t n = (size_t)am_tensor_numel(t);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_iallreduce(m->tp_comm, t->data, t->data, n, t->dtype, op, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_allreduce(m->tp_comm, t->data, t->data, n, t->dtype, op, err, err_len);
}

static int tp_sum(struct am_model *m, struct am_tensor *t, char *err, size_t err_len)
{
    return tp_reduce(m, t, AM_SUM, err, err_len);
}

/* Sequence parallelism: rank r of the tp group holds token rows [r N/tp, (r+1) N/tp). */
static int sp_gather(struct am_model *m, const struct am_tensor *rows, struct am_tensor *full, char *err,
                     size_t err_len)
{
    size_t n = (size_t)am_tensor_numel(rows);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_iallgather(m->tp_comm, rows->data, full->data, n, rows->dtype, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_allgather(m->tp_comm, rows->data, full->data, n, rows->dtype, err, err_len);
}

static int sp_scatter(struct am_model *m, const struct am_tensor *full, struct am_tensor *rows, char *err,
                      size_t err_len)
{
    size_t n = (size_t)am_tensor_numel(rows);
    if (tp_on_device(m)) {
        struct am_comm_req *q = NULL;
        return am_ireduce_scatter(m->tp_comm, full->data, rows->data, n, rows->dtype, AM_SUM, &q, err, err_len) < 0
                   ? -1
                   : am_comm_wait(q, err, err_len);
    }
    return am_reduce_scatter(m->tp_comm, full->data, rows->data, n, rows->dtype, AM_SUM, err, err_len);
}

/* The output of a row-parallel product (full rows, partial sums over tp) added to the
 * residual x: all-reduced, or reduce-scattered to this rank's rows. */
static int add_row_parallel(struct am_model *m, struct am_tensor *x, struct am_tensor *out, char *err, size_t err_len)
{
    if (m->sh.sequence_parallel) {
        struct am_tensor rows = rows_of(&m->scratch_rows, am_rows_of(x));
        if (sp_scatter(m, out, &rows, err, err_len) < 0)
            return -1;
        m->K->add(m->dev, x, &rows);
        return 0;
    }
    if (tp_sum(m, out, err, err_len) < 0)
        return -1;
    m->K->add(m->dev, x, out);
    return 0;
}

/* The input of a column-parallel product: the normalised rows themselves, or all of them
 * gathered from the tp group. */
static int column_input(struct am_model *m, struct am_tensor *h, int64_t N, struct am_tensor *in, char *err,
                        size_t err_len)
{
    if (!m->sh.sequence_parallel) {
        *in = *h;
        return 0;
    }
    *in = rows_of(&m->gathered, N);
    return sp_gather(m, h, in, err, err_len);
}

/* The head's group (final norm and head) on the last stage: the last group, or with LoRA the
 * one before the adapters' group. */
static int head_group(const struct am_model *m)
{
    return m->n_groups - 1 - (m->groups[m->n_groups - 1].kind == AM_PG_LORA);
}

/* A base weight's gradient, or NULL when LoRA freezes the base (its weight-gradient kernel
 * skipped: the base has no gradient memory, model.h). */
static struct am_tensor *base_grad(const struct am_model *m, const struct am_param *p)
{
    return m->sh.lora_r > 0 ? NULL : (struct am_tensor *)&p->g;
}

/* The gradient of a column-parallel input, summed over tp (all-reduce, or reduce-scatter to
 * this rank's rows), then through the norm into dx. */
static int norm_backward(struct am_model *m, struct am_tensor *dx, struct am_param *norm, struct am_tensor *dh,
                         const struct am_tensor *x, const struct am_tensor *rstd, char *err, size_t err_len)
{
    struct am_tensor d = *dh;
    if (m->sh.sequence_parallel) {
        d = rows_of(&m->scratch_rows, am_rows_of(dx));
        if (sp_scatter(m, dh, &d, err, err_len) < 0)
            return -1;
    } else if (tp_sum(m, dh, err, err_len) < 0) {
        return -1;
    }
    if (m->cfg.gemma)
        m->K->rmsnorm_offset_backward(m->dev, dx, base_grad(m, norm), &d, x, &norm->wc, rstd);
    else
        m->K->rmsnorm_backward(m->dev, dx, base_grad(m, norm), &d, x, &norm->wc, rstd);
    return 0;
}

static int row_parallel_grad(struct am_model *m, struct am_tensor *dx, int64_t N, struct am_tensor *dy, char *err,
                             size_t err_len);

/* RMSNorm as the model's family has it: w (Llama), or 1 + w (Gemma). */
static void norm_forward(struct am_model *m, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                         const struct am_param *norm)
{
    float eps = (float)m->cfg.rms_norm_eps;
    if (m->cfg.gemma)
        m->K->rmsnorm_offset_forward(m->dev, out, rstd, x, &norm->wc, eps);
    else
        m->K->rmsnorm_forward(m->dev, out, rstd, x, &norm->wc, eps);
}

static void norm_backward_local(struct am_model *m, struct am_tensor *dx, const struct am_param *norm,
                                const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *rstd)
{
    struct am_tensor *dw = base_grad(m, norm);
    if (m->cfg.gemma)
        m->K->rmsnorm_offset_backward(m->dev, dx, dw, dout, x, &norm->wc, rstd);
    else
        m->K->rmsnorm_backward(m->dev, dx, dw, dout, x, &norm->wc, rstd);
}

/* Gemma: the row-parallel output out (full rows, partial sums over tp) reduced (all-reduce,
 * or reduce-scatter to this rank's rows) into saved, normalised by the post norm and added
 * to the residual x. */
static int add_post_norm(struct am_model *m, struct am_tensor *x, struct am_tensor *out, struct am_tensor *saved,
                         struct am_tensor *rstd, const struct am_param *norm, char *err, size_t err_len)
{
    if (m->sh.sequence_parallel) {
        if (sp_scatter(m, out, saved, err, err_len) < 0)
            return -1;
    } else {
        if (tp_sum(m, out, err, err_len) < 0)
            return -1;
        m->K->copy(m->dev, saved, out);
    }
    struct am_tensor y = rows_of(&m->scratch_post, am_rows_of(x));
    norm_forward(m, &y, rstd, saved, norm);
    m->K->add(m->dev, x, &y);
    return 0;
}

/* Its backward: from dx (the residual's gradient, also the post norm's output's), the
 * gradient of the row-parallel output in *dy (all rows: gathered with sequence parallelism). */
static int post_norm_backward(struct am_model *m, struct am_tensor *dx, const struct am_tensor *saved,
                              const struct am_tensor *rstd, const struct am_param *norm, int64_t N, struct am_tensor *dy,
                              char *err, size_t err_len)
{
    struct am_tensor d = rows_of(&m->scratch_post, am_rows_of(dx));
    m->K->zero(m->dev, &d);
    norm_backward_local(m, &d, norm, dx, saved, rstd);
    return row_parallel_grad(m, &d, N, dy, err, err_len);
}

/* Combines the vocabulary shards' softmax statistics (kernels.h, ce_stats) into M and S in
 * the slot, for the backward, and adds the micro-batch's token losses to the loss scalar. */
static int combine_ce(struct am_model *m, struct am_slot *S, int64_t N, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    struct am_tensor cm = rows_of(&S->ce_m, N), cs = rows_of(&S->ce_s, N), ct = rows_of(&m->ce_t, N);
    struct am_tensor tgt = rows_of(&S->targets, N);
    if (m->tp_comm) {
        struct am_tensor M = rows_of(&m->ce_M, N);
        K->copy(m->dev, &M, &cm);
        if (tp_reduce(m, &M, AM_MAX, err, err_len) < 0)
            return -1;
        K->ce_rescale(m->dev, &cs, &cm, &M);
        if (tp_reduce(m, &cs, AM_SUM, err, err_len) < 0 || tp_reduce(m, &ct, AM_SUM, err, err_len) < 0)
            return -1;
        K->copy(m->dev, &cm, &M);
    }
    K->ce_loss(m->dev, &m->scalars.loss, &cm, &cs, &ct, &tgt);
    return 0;
}

/* ---- forward ------------------------------------------------------------------------- */

/* Gemma's attention scale, query_pre_attn_scalar ** -0.5 (a Python float, applied as fp32). */
static float attn_scale(const struct am_model *m) { return (float)(1.0 / sqrt(m->cfg.query_pre_attn_scalar)); }

/* Rotary embedding of q and k [B, T, heads, D] (backward: of their gradients) with the layer's
 * tables: one row per position of the sequence, or with packed sequences one per row of the
 * micro-batch (each document's positions, packed.h: q and k seen as one sequence of B x T). */
static void rope(struct am_model *m, const struct am_layer *L, struct am_tensor *q4, struct am_tensor *k4,
                 bool backward)
{
    const struct am_tensor *cs = L->local_rope ? &m->cos_local : &m->cos, *sn = L->local_rope ? &m->sin_local : &m->sin;
    struct am_tensor q = *q4, k = *k4;
    if (m->pk) {
        cs = &m->pk->cos;
        sn = &m->pk->sin;
        q.shape[1] *= q.shape[0];
        k.shape[1] *= k.shape[0];
        q.shape[0] = k.shape[0] = 1;
    }
    if (backward) {
        m->K->rope_backward(m->dev, &q, cs, sn);
        m->K->rope_backward(m->dev, &k, cs, sn);
    } else {
        m->K->rope_forward(m->dev, &q, cs, sn);
        m->K->rope_forward(m->dev, &k, cs, sn);
    }
}

/* LoRA (lora.h): projection t's adapter of layer L. */
static struct am_lora adapter_of(const struct am_model *m, const struct am_layer *L, int t)
{
    return (struct am_lora){&L->lora_a[t]->wc, &L->lora_b[t]->wc, &L->lora_a[t]->g, &L->lora_b[t]->g,
                            m->sh.lora_alpha / (float)m->sh.lora_r};
}

/* Projection t's adapter, when it has one. y: the base layer's output (before a row-parallel
 * reduction); x: its input. */
static void lora_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, int t,
                         struct am_tensor *y, const struct am_tensor *x)
{
    if (!L->lora_a[t])
        return;
    int64_t N = y->shape[0];
    struct am_lora l = adapter_of(m, L, t);
    struct am_tensor tt = rows_of(&a->lora_t[t], N);
    struct am_tensor u = am_tensor_view(m->lora_u.data, m->K->device, m->act_dt, N, y->shape[1], 0, 0);
    am_lora_forward(m->dev, m->K, &l, y, x, &tt, &u);
}

/* Its backward: dx += the adapter's input gradient; A's and B's gradients accumulate. */
static void lora_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, int t,
                          struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x)
{
    if (!L->lora_a[t])
        return;
    int64_t N = dy->shape[0];
    struct am_lora l = adapter_of(m, L, t);
    struct am_tensor tt = rows_of(&a->lora_t[t], N);
    struct am_tensor du = am_tensor_view(m->lora_du.data, m->K->device, m->act_dt, N, dy->shape[1], 0, 0);
    struct am_tensor dt = rows_of(&m->lora_dt, N);
    am_lora_backward(m->dev, m->K, &l, dx, dy, x, &tt, &du, &dt);
}

/* One decoder layer on the residual stream x (R rows), saving what backward needs in a. */
static int layer_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, struct am_tensor *x,
                         int64_t B, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    int64_t T = m->seq_len, N = B * T, D = m->head_dim, R = stream_rows(m, N);
    struct am_tensor x_in = rows_of(&a->x_in, R), h1 = rows_of(&a->h1, R), rstd1 = rows_of(&a->rstd1, R);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N);
    struct am_tensor att = rows_of(&a->att, N), lse = a->lse;
    struct am_tensor x_mid = rows_of(&a->x_mid, R), h2 = rows_of(&a->h2, R), rstd2 = rows_of(&a->rstd2, R);
    struct am_tensor gate = rows_of(&a->gate, N), up = rows_of(&a->up, N), act = rows_of(&a->act, N);
    struct am_tensor o = rows_of(&m->scratch_c, N), in;
    lse.shape[0] = B;

    /* attention block: x += o_proj(attention(rope(q), rope(k), v)) of rmsnorm(x) */
    K->copy(m->dev, &x_in, x);
    norm_forward(m, &h1, &rstd1, x, L->attn_norm);
    if (column_input(m, &h1, N, &in, err, err_len) < 0)
        return -1;
    if (L->q_norm) { /* Qwen3: q = q_norm(q_proj(h)), k = k_norm(k_proj(h)), RMSNorm over each head, before rope */
        struct am_tensor q_raw = rows_of(&a->q_raw, N), k_raw = rows_of(&a->k_raw, N);
        K->matmul_forward(m->dev, &q_raw, &in, &L->wq->wc);
        K->matmul_forward(m->dev, &k_raw, &in, &L->wk->wc);
        if (L->bq) { /* a projection's bias comes before the norm */
            K->bias_forward(m->dev, &q_raw, &L->bq->wc);
            K->bias_forward(m->dev, &k_raw, &L->bk->wc);
        }
        lora_forward(m, L, a, AM_LORA_PQ, &q_raw, &in);
        lora_forward(m, L, a, AM_LORA_PK, &k_raw, &in);
        struct am_tensor qr = head_rows(&q_raw, N * m->heads, D), kr = head_rows(&k_raw, N * m->kv_heads, D);
        struct am_tensor qn = head_rows(&q, N * m->heads, D), kn = head_rows(&k, N * m->kv_heads, D);
        struct am_tensor rq = rows_of(&a->rstd_q, N * m->heads), rk = rows_of(&a->rstd_k, N * m->kv_heads);
        norm_forward(m, &qn, &rq, &qr, L->q_norm);
        norm_forward(m, &kn, &rk, &kr, L->k_norm);
    } else {
        K->matmul_forward(m->dev, &q, &in, &L->wq->wc);
        K->matmul_forward(m->dev, &k, &in, &L->wk->wc);
        if (L->bq) { /* Qwen2: q, k = x · wᵀ + b, before rope (Qwen2Attention's nn.Linear(bias=True)) */
            K->bias_forward(m->dev, &q, &L->bq->wc);
            K->bias_forward(m->dev, &k, &L->bk->wc);
        }
        lora_forward(m, L, a, AM_LORA_PQ, &q, &in);
        lora_forward(m, L, a, AM_LORA_PK, &k, &in);
    }
    K->matmul_forward(m->dev, &v, &in, &L->wv->wc);
    if (L->bv)
        K->bias_forward(m->dev, &v, &L->bv->wc);
    lora_forward(m, L, a, AM_LORA_PV, &v, &in);
    struct am_tensor q4 = heads_of(&q, B, T, m->heads, D), k4 = heads_of(&k, B, T, m->kv_heads, D);
    struct am_tensor v4 = heads_of(&v, B, T, m->kv_heads, D), att4 = heads_of(&att, B, T, m->heads, D);
    rope(m, L, &q4, &k4, false);
    if (m->cp) { /* context parallelism: over the cp ring (ring.h) */
        if (am_cp_attention_forward(m, &att4, &lse, &q4, &k4, &v4, m->pk ? &m->pk->cur : NULL, L->window, err,
                                    err_len) < 0)
            return -1;
    } else if (m->pk) { /* packed sequences: each row sees its own document (packed.h) */
        K->attention_block_forward(m->dev, &att4, &lse, &q4, &k4, &v4, &m->pk->rows, &m->pk->rows, &m->pk->cur,
                                   L->window, 0);
    } else if (m->cfg.gemma) {
        K->attention_softcap_forward(m->dev, &att4, &lse, &q4, &k4, &v4, L->window, attn_scale(m),
                                     (float)m->cfg.attn_logit_softcapping);
    } else {
        K->attention_forward(m->dev, &att4, &lse, &q4, &k4, &v4, L->window);
    }
    K->matmul_forward(m->dev, &o, &att, &L->wo->wc);
    lora_forward(m, L, a, AM_LORA_PO, &o, &att);
    if (L->post_attn_norm) {
        struct am_tensor oa = rows_of(&a->o_att, R), ra = rows_of(&a->rstd_oa, R);
        if (add_post_norm(m, x, &o, &oa, &ra, L->post_attn_norm, err, err_len) < 0)
            return -1;
    } else if (add_row_parallel(m, x, &o, err, err_len) < 0) {
        return -1;
    }

    /* MLP block: x += down(silu(gate(h)) * up(h)) of h = rmsnorm(x) */
    K->copy(m->dev, &x_mid, x);
    norm_forward(m, &h2, &rstd2, x, L->mlp_norm);
    if (column_input(m, &h2, N, &in, err, err_len) < 0)
        return -1;
    if (L->moe) { /* the experts in place of the MLP (moe.h), replicated over tp: o is whole */
        if (am_moe_forward(m, L, a, &in, &o, err, err_len) < 0)
            return -1;
        K->add(m->dev, x, &o);
        return 0;
    }
    K->matmul_forward(m->dev, &gate, &in, &L->w_gate->wc);
    K->matmul_forward(m->dev, &up, &in, &L->w_up->wc);
    lora_forward(m, L, a, AM_LORA_PGATE, &gate, &in);
    lora_forward(m, L, a, AM_LORA_PUP, &up, &in);
    if (m->cfg.gemma)
        K->geglu_forward(m->dev, &act, &gate, &up);
    else
        K->swiglu_forward(m->dev, &act, &gate, &up);
    K->matmul_forward(m->dev, &o, &act, &L->w_down->wc);
    lora_forward(m, L, a, AM_LORA_PDOWN, &o, &act);
    if (L->post_mlp_norm) {
        struct am_tensor om = rows_of(&a->o_mlp, R), rm = rows_of(&a->rstd_om, R);
        return add_post_norm(m, x, &o, &om, &rm, L->post_mlp_norm, err, err_len);
    }
    return add_row_parallel(m, x, &o, err, err_len);
}

/* The grad_use hook (model.h), when there is one. */
static int grad_use(struct am_model *m, int group, char *err, size_t err_len)
{
    return m->hooks.grad_use ? m->hooks.grad_use(m->hooks.arg, group, err, err_len) : 0;
}

/* The final norm, the output head and the cross-entropy, vocabulary-parallel. With
 * want_grad and the conditions of ce_fused (no tensor parallelism, and this slot's backward
 * certain to come before the next forward: one slot, one chunk), the head's gradients are
 * computed here too, in one pass over the logits, and dhf kept for the backward. */
static int head_forward(struct am_model *m, struct am_slot *S, const struct am_tensor *x, const int32_t *targets,
                        float dloss_scale, bool want_grad, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    int64_t N = S->batch * m->seq_len, R = stream_rows(m, N);
    struct am_tensor tgt = rows_of(&S->targets, N), xf = rows_of(&S->xf, R);
    struct am_tensor hf = rows_of(&S->hf, N), rstdf = rows_of(&S->rstdf, R);
    struct am_tensor cm = rows_of(&S->ce_m, N), cs = rows_of(&S->ce_s, N), ct = rows_of(&m->ce_t, N);
    K->upload(m->dev, tgt.data, targets, (size_t)N * sizeof(int32_t));
    K->copy(m->dev, &xf, x);
    if (m->sh.sequence_parallel) {
        struct am_tensor rows = rows_of(&m->scratch_rows, R);
        norm_forward(m, &rows, &rstdf, &xf, m->final_norm);
        if (sp_gather(m, &rows, &hf, err, err_len) < 0)
            return -1;
    } else {
        norm_forward(m, &hf, &rstdf, &xf, m->final_norm);
    }
    S->fused = false;
    float cap = (float)m->cfg.final_logit_softcapping;
    if (want_grad && !m->tp_comm && K->ce_fused && m->n_slots == 1 && cap <= 0.0f && m->sh.lora_r == 0) {
        struct am_tensor dhf = rows_of(&m->dhf, N);
        if (grad_use(m, head_group(m), err, err_len) < 0 || (m->head == m->embed && grad_use(m, 0, err, err_len) < 0))
            return -1;
        K->zero(m->dev, &dhf);
        S->fused = K->ce_fused(m->dev, &cm, &cs, &ct, &dhf, &m->head->g, &hf, &m->head->wc, &tgt, dloss_scale);
    }
    if (!S->fused && cap > 0.0f) /* Gemma: the logits capped, cap * tanh(logit / cap) */
        K->ce_stats_softcap(m->dev, &cm, &cs, &ct, &hf, &m->head->wc, &tgt, m->vocab_start, cap);
    else if (!S->fused)
        K->ce_stats(m->dev, &cm, &cs, &ct, &hf, &m->head->wc, &tgt, m->vocab_start);
    return combine_ce(m, S, N, err, err_len);
}

/* Gemma's embedding scale: sqrt(hidden_size) as a tensor of the compute dtype (transformers:
 * torch.tensor(hidden_size ** 0.5).to(weight.dtype): rounded to bf16 in bf16). */
static float embed_scale(const struct am_model *m)
{
    float s = (float)sqrt((double)m->cfg.hidden_size);
    if (m->act_dt == AM_BF16)
        s = am_bf16_to_f32(am_f32_to_bf16(s));
    return s;
}

static bool is_first(const struct am_model *m, int chunk) { return chunk == 0 && m->sh.first_stage; }
static bool is_last(const struct am_model *m, int chunk) { return chunk == m->sh.n_chunks - 1 && m->sh.last_stage; }

/* A hidden state handed between stages, as a tensor of R rows. */
static struct am_tensor hidden(const struct am_model *m, const void *p, int64_t B)
{
    return am_tensor_view((void *)p, m->K->device, m->act_dt, stream_rows(m, B * m->seq_len), m->cfg.hidden_size, 0, 0);
}

size_t am_model_hidden_elems(const struct am_model *m, int64_t batch)
{
    return (size_t)(stream_rows(m, batch * m->seq_len) * m->cfg.hidden_size);
}

/* The group_use hook (model.h), when there is one. */
static int use_group(struct am_model *m, int group, bool backward, char *err, size_t err_len)
{
    return m->hooks.group_use ? m->hooks.group_use(m->hooks.arg, group, backward, err, err_len) : 0;
}

static int check_slot(const struct am_model *m, int chunk, int slot, char *err, size_t err_len)
{
    if (chunk < 0 || chunk >= m->sh.n_chunks)
        return am_fail(err, err_len, "model: chunk %d out of range (%d chunks)", chunk, m->sh.n_chunks);
    if (slot < 0 || slot >= m->sh.chunks[chunk].slots)
        return am_fail(err, err_len, "model: slot %d of chunk %d out of range (%d slots)", slot, chunk,
                       m->sh.chunks[chunk].slots);
    return 0;
}

static int forward_chunk(struct am_model *m, int chunk, int slot, int64_t B, const int32_t *tokens,
                         const int32_t *targets, const int32_t *starts, const void *x_in, void *x_out,
                         float dloss_scale, bool want_grad, char *err, size_t err_len)
{
    if (check_slot(m, chunk, slot, err, err_len) < 0)
        return -1;
    if (B < 1 || B * m->seq_len > m->max_tokens)
        return am_fail(err, err_len, "model: a micro-batch of %lld tokens; this model was built for up to %lld",
                    (long long)(B * m->seq_len), (long long)m->max_tokens);
    if (!m->pk != !starts)
        return am_fail(err, err_len, m->pk ? "model: packed sequences need each row's document start (starts is NULL)"
                                           : "model: document starts given to a model without packed sequences");
    if (m->pk && am_packed_load(m, m->slot_base[chunk] + slot, B, starts, err, err_len) < 0)
        return -1;
    if (m->pk)
        am_packed_enter(m, m->slot_base[chunk] + slot, B);
    const struct am_kernels *K = m->K;
    struct am_slot *S = &m->slots[m->slot_base[chunk] + slot];
    int64_t N = B * m->seq_len, R = stream_rows(m, N);
    struct am_tensor x = rows_of(&m->x, R);
    S->batch = B;
    m->where = (struct am_model_where){AM_PHASE_FORWARD, AM_WHERE_EMBEDDING};
    if (is_first(m, chunk)) {
        /* the embedding: each rank looks up the ids of its vocabulary shard; summed over tp */
        struct am_tensor tok = rows_of(&S->tokens, N), e = rows_of(&m->scratch_c, N);
        if (use_group(m, 0, false, err, err_len) < 0)
            return -1;
        K->upload(m->dev, tok.data, tokens, (size_t)N * sizeof(int32_t));
        K->embedding_forward(m->dev, &e, &tok, &m->embed->wc, m->vocab_start);
        K->zero(m->dev, &x);
        if (add_row_parallel(m, &x, &e, err, err_len) < 0)
            return -1;
        if (m->cfg.gemma) /* Gemma: the embedding times sqrt(hidden_size), in the compute dtype */
            K->scale(m->dev, &x, embed_scale(m));
    } else {
        struct am_tensor in = hidden(m, x_in, B);
        K->copy(m->dev, &x, &in);
    }
    const struct am_layer *layers = &m->layers[m->chunk_base[chunk]];
    am_moe_forward_begin(m, m->slot_base[chunk] + slot);
    for (int l = 0; l < m->sh.chunks[chunk].n_layers; l++) {
        m->where.layer = m->sh.chunks[chunk].first_layer + l;
        if (use_group(m, layers[l].group, false, err, err_len) < 0 ||
            layer_forward(m, &layers[l], &S->acts[l], &x, B, err, err_len) < 0)
            return -1;
    }
    am_moe_forward_end(m, m->slot_base[chunk] + slot, N, is_last(m, chunk) ? targets : NULL, dloss_scale);
    m->where.layer = AM_WHERE_HEAD;
    if (is_last(m, chunk) && use_group(m, head_group(m), false, err, err_len) < 0)
        return -1;
    if (is_last(m, chunk))
        return head_forward(m, S, &x, targets, dloss_scale, want_grad, err, err_len);
    struct am_tensor out = hidden(m, x_out, B);
    K->copy(m->dev, &out, &x);
    return 0;
}

int am_model_forward(struct am_model *m, int chunk, int slot, int64_t batch, const int32_t *tokens,
                     const int32_t *targets, const int32_t *starts, const void *x_in, void *x_out, float dloss_scale,
                     char *err, size_t err_len)
{
    return forward_chunk(m, chunk, slot, batch, tokens, targets, starts, x_in, x_out, dloss_scale, true, err, err_len);
}

/* ---- backward ------------------------------------------------------------------------ */

/* The gradient of a row-parallel output: dx itself, or all of the rows gathered. */
static int row_parallel_grad(struct am_model *m, struct am_tensor *dx, int64_t N, struct am_tensor *dy, char *err,
                             size_t err_len)
{
    if (!m->sh.sequence_parallel) {
        *dy = *dx;
        return 0;
    }
    *dy = rows_of(&m->dhf, N); /* free once the head's gradient has gone into dx */
    return sp_gather(m, dx, dy, err, err_len);
}

/* One layer in reverse: dx holds the gradient of the layer's output and becomes that of its
 * input. */
static int layer_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                          struct am_tensor *dx, int64_t B, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    int64_t T = m->seq_len, N = B * T, D = m->head_dim, I = m->inter, R = stream_rows(m, N);
    struct am_tensor x_in = rows_of(&a->x_in, R), h1 = rows_of(&a->h1, R), rstd1 = rows_of(&a->rstd1, R);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N);
    struct am_tensor att = rows_of(&a->att, N), lse = a->lse;
    struct am_tensor x_mid = rows_of(&a->x_mid, R), h2 = rows_of(&a->h2, R), rstd2 = rows_of(&a->rstd2, R);
    struct am_tensor gate = rows_of(&a->gate, N), up = rows_of(&a->up, N), act = rows_of(&a->act, N);
    struct am_tensor dh = rows_of(&m->scratch_c, N), dy, in;
    size_t part = (size_t)(N * I) * am_dtype_size(m->act_dt);
    struct am_tensor dact = am_tensor_view(m->scratch_mlp.data, K->device, m->act_dt, N, I, 0, 0);
    struct am_tensor dgate = am_tensor_view((char *)m->scratch_mlp.data + part, K->device, m->act_dt, N, I, 0, 0);
    struct am_tensor dup = am_tensor_view((char *)m->scratch_mlp.data + 2 * part, K->device, m->act_dt, N, I, 0, 0);
    lse.shape[0] = B;

    /* MLP block, in reverse; dx already holds the residual's gradient */
    if (L->post_mlp_norm) {
        struct am_tensor om = rows_of(&a->o_mlp, R), rm = rows_of(&a->rstd_om, R);
        if (post_norm_backward(m, dx, &om, &rm, L->post_mlp_norm, N, &dy, err, err_len) < 0)
            return -1;
    } else if (row_parallel_grad(m, dx, N, &dy, err, err_len) < 0) {
        return -1;
    }
    if (L->moe) { /* the experts in place of the MLP (moe.h) */
        if (column_input(m, &h2, N, &in, err, err_len) < 0)
            return -1;
        K->zero(m->dev, &dh);
        if (am_moe_backward(m, L, a, &dy, &in, &dh, err, err_len) < 0)
            return -1;
        if (m->tp_comm) /* each tp rank holds all of dh, which norm_backward sums over tp */
            K->scale(m->dev, &dh, 1.0f / (float)m->sh.tp);
        if (norm_backward(m, dx, L->mlp_norm, &dh, &x_mid, &rstd2, err, err_len) < 0)
            return -1;
        goto attention;
    }
    K->zero(m->dev, &dact);
    K->matmul_backward(m->dev, &dact, base_grad(m, L->w_down), &dy, &act, &L->w_down->wc);
    lora_backward(m, L, a, AM_LORA_PDOWN, &dact, &dy, &act);
    K->zero(m->dev, &dgate);
    K->zero(m->dev, &dup);
    if (m->cfg.gemma)
        K->geglu_backward(m->dev, &dgate, &dup, &dact, &gate, &up);
    else
        K->swiglu_backward(m->dev, &dgate, &dup, &dact, &gate, &up);
    if (column_input(m, &h2, N, &in, err, err_len) < 0)
        return -1;
    K->zero(m->dev, &dh);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->w_gate), &dgate, &in, &L->w_gate->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->w_up), &dup, &in, &L->w_up->wc);
    lora_backward(m, L, a, AM_LORA_PGATE, &dh, &dgate, &in);
    lora_backward(m, L, a, AM_LORA_PUP, &dh, &dup, &in);
    if (norm_backward(m, dx, L->mlp_norm, &dh, &x_mid, &rstd2, err, err_len) < 0)
        return -1;

    /* attention block, in reverse */
attention:;
    struct am_tensor datt = rows_of(&m->scratch_att, N), dq = rows_of(&m->scratch_q, N);
    struct am_tensor dk = rows_of(&m->scratch_kv_k, N), dv = rows_of(&m->scratch_kv_v, N);
    if (L->post_attn_norm) {
        struct am_tensor oa = rows_of(&a->o_att, R), ra = rows_of(&a->rstd_oa, R);
        if (post_norm_backward(m, dx, &oa, &ra, L->post_attn_norm, N, &dy, err, err_len) < 0)
            return -1;
    } else if (row_parallel_grad(m, dx, N, &dy, err, err_len) < 0) {
        return -1;
    }
    K->zero(m->dev, &datt);
    K->matmul_backward(m->dev, &datt, base_grad(m, L->wo), &dy, &att, &L->wo->wc);
    lora_backward(m, L, a, AM_LORA_PO, &datt, &dy, &att);
    K->zero(m->dev, &dq);
    K->zero(m->dev, &dk);
    K->zero(m->dev, &dv);
    struct am_tensor q4 = heads_of(&q, B, T, m->heads, D), k4 = heads_of(&k, B, T, m->kv_heads, D);
    struct am_tensor v4 = heads_of(&v, B, T, m->kv_heads, D), att4 = heads_of(&att, B, T, m->heads, D);
    struct am_tensor dq4 = heads_of(&dq, B, T, m->heads, D), dk4 = heads_of(&dk, B, T, m->kv_heads, D);
    struct am_tensor dv4 = heads_of(&dv, B, T, m->kv_heads, D), datt4 = heads_of(&datt, B, T, m->heads, D);
    if (m->cp) {
        if (am_cp_attention_backward(m, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4,
                                     m->pk ? &m->pk->cur : NULL, L->window, err, err_len) < 0)
            return -1;
    } else if (m->pk) {
        K->attention_block_backward(m->dev, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4, &m->pk->rows,
                                    &m->pk->rows, &m->pk->cur, L->window);
    } else if (m->cfg.gemma) {
        K->attention_softcap_backward(m->dev, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4, L->window,
                                      attn_scale(m), (float)m->cfg.attn_logit_softcapping);
    } else {
        K->attention_backward(m->dev, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4, L->window);
    }
    rope(m, L, &dq4, &dk4, true);
    if (L->q_norm) { /* through the per-head norms: dq, dk become the gradients of q_proj's and k_proj's outputs */
        struct am_tensor dq_raw = datt, dk_raw = rows_of(&m->scratch_kn, N); /* datt is spent */
        struct am_tensor q_raw = rows_of(&a->q_raw, N), k_raw = rows_of(&a->k_raw, N);
        struct am_tensor dqr = head_rows(&dq_raw, N * m->heads, D), dkr = head_rows(&dk_raw, N * m->kv_heads, D);
        struct am_tensor dqn = head_rows(&dq, N * m->heads, D), dkn = head_rows(&dk, N * m->kv_heads, D);
        struct am_tensor qr = head_rows(&q_raw, N * m->heads, D), kr = head_rows(&k_raw, N * m->kv_heads, D);
        struct am_tensor rq = rows_of(&a->rstd_q, N * m->heads), rk = rows_of(&a->rstd_k, N * m->kv_heads);
        K->zero(m->dev, &dq_raw);
        K->zero(m->dev, &dk_raw);
        norm_backward_local(m, &dqr, L->q_norm, &dqn, &qr, &rq);
        norm_backward_local(m, &dkr, L->k_norm, &dkn, &kr, &rk);
        dq = dq_raw;
        dk = dk_raw;
    }
    if (L->bq) { /* the biases' gradients: the projections' output gradients summed over the tokens */
        if (m->sh.lora_r == 0) { /* LoRA: the biases are frozen with the base */
            K->bias_backward(m->dev, &L->bq->g, &dq);
            K->bias_backward(m->dev, &L->bk->g, &dk);
            K->bias_backward(m->dev, &L->bv->g, &dv);
        }
    }
    if (column_input(m, &h1, N, &in, err, err_len) < 0)
        return -1;
    K->zero(m->dev, &dh);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wq), &dq, &in, &L->wq->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wk), &dk, &in, &L->wk->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wv), &dv, &in, &L->wv->wc);
    lora_backward(m, L, a, AM_LORA_PQ, &dh, &dq, &in);
    lora_backward(m, L, a, AM_LORA_PK, &dh, &dk, &in);
    lora_backward(m, L, a, AM_LORA_PV, &dh, &dv, &in);
    return norm_backward(m, dx, L->attn_norm, &dh, &x_in, &rstd1, err, err_len);
}

/* The head and the loss in reverse: dx receives the gradient of the final norm's input. */
static int head_backward(struct am_model *m, const struct am_slot *S, struct am_tensor *dx, float dloss_scale,
                         char *err, size_t err_len)
{
    int64_t N = S->batch * m->seq_len, R = stream_rows(m, N);
    struct am_tensor tgt = rows_of(&S->targets, N), hf = rows_of(&S->hf, N), dhf = rows_of(&m->dhf, N);
    struct am_tensor xf = rows_of(&S->xf, R), rstdf = rows_of(&S->rstdf, R);
    struct am_tensor cm = rows_of(&S->ce_m, N), cs = rows_of(&S->ce_s, N);
    if (!S->fused) { /* dhf is summed over the vocabulary shards in norm_backward */
        m->K->zero(m->dev, &dhf);
        if (m->cfg.final_logit_softcapping > 0)
            m->K->ce_backward_softcap(m->dev, &dhf, base_grad(m, m->head), &hf, &m->head->wc, &tgt, m->vocab_start, &cm, &cs,
                                      dloss_scale, (float)m->cfg.final_logit_softcapping);
        else
            m->K->ce_backward(m->dev, &dhf, base_grad(m, m->head), &hf, &m->head->wc, &tgt, m->vocab_start, &cm, &cs,
                              dloss_scale);
    }
    m->K->zero(m->dev, dx);
    return norm_backward(m, dx, m->final_norm, &dhf, &xf, &rstdf, err, err_len);
}

/* Tells the trainer that a group's gradients are final (model.h, grad_ready). */
static int group_done(struct am_model *m, int group, char *err, size_t err_len)
{
    if (!(m->grads_final || m->hooks.grads_each_pass) || !m->hooks.grad_ready || m->groups[group].tied)
        return 0;
    return m->hooks.grad_ready(m->hooks.arg, group, err, err_len);
}

int am_model_backward(struct am_model *m, int chunk, int slot, const void *dy, void *dx_out, float dloss_scale,
                      char *err, size_t err_len)
{
    if (check_slot(m, chunk, slot, err, err_len) < 0)
        return -1;
    const struct am_kernels *K = m->K;
    struct am_slot *S = &m->slots[m->slot_base[chunk] + slot];
    if (S->batch < 1)
        return am_fail(err, err_len, "model: backward of slot %d of chunk %d, which holds no forward", slot, chunk);
    int64_t B = S->batch, N = B * m->seq_len, R = stream_rows(m, N);
    struct am_tensor dx = rows_of(&m->dx, R);
    m->where = (struct am_model_where){AM_PHASE_BACKWARD, AM_WHERE_HEAD};
    if (m->pk)
        am_packed_enter(m, m->slot_base[chunk] + slot, B);
    if (is_last(m, chunk)) {
        if (use_group(m, head_group(m), true, err, err_len) < 0 || grad_use(m, head_group(m), err, err_len) < 0 ||
            (m->head == m->embed && grad_use(m, 0, err, err_len) < 0) ||
            head_backward(m, S, &dx, dloss_scale, err, err_len) < 0 ||
            group_done(m, head_group(m), err, err_len) < 0)
            return -1;
    } else {
        struct am_tensor g = hidden(m, dy, B);
        K->copy(m->dev, &dx, &g);
    }
    const struct am_layer *layers = &m->layers[m->chunk_base[chunk]];
    for (int l = m->sh.chunks[chunk].n_layers - 1; l >= 0; l--) {
        struct am_layer_acts *a = &S->acts[l];
        m->where.layer = m->sh.chunks[chunk].first_layer + l;
        if (use_group(m, layers[l].group, true, err, err_len) < 0 || grad_use(m, layers[l].group, err, err_len) < 0 ||
            (layers[l].moe && grad_use(m, layers[l].moe->experts_group, err, err_len) < 0))
            return -1;
        if (m->sh.recompute) { /* the layer's forward again, from its saved input */
            struct am_tensor x = rows_of(&m->x, R), x_in = rows_of(&a->x_in, R);
            K->copy(m->dev, &x, &x_in);
            if (layer_forward(m, &layers[l], a, &x, B, err, err_len) < 0)
                return -1;
        }
        if (layer_backward(m, &layers[l], a, &dx, B, err, err_len) < 0 ||
            (layers[l].moe && group_done(m, layers[l].moe->experts_group, err, err_len) < 0) ||
            group_done(m, layers[l].group, err, err_len) < 0)
            return -1;
    }
    m->where.layer = AM_WHERE_EMBEDDING;
    if (is_first(m, chunk)) {
        struct am_tensor tok = rows_of(&S->tokens, N), g;
        if (row_parallel_grad(m, &dx, N, &g, err, err_len) < 0 || grad_use(m, 0, err, err_len) < 0)
            return -1;
        if (m->cfg.gemma) /* through the embedding's scale */
            K->scale(m->dev, &g, embed_scale(m));
        if (m->sh.lora_r == 0) /* LoRA: the embedding is frozen */
            K->embedding_backward(m->dev, &m->embed->g, &g, &tok, m->vocab_start);
        return group_done(m, 0, err, err_len);
    }
    struct am_tensor out = hidden(m, dx_out, B);
    K->copy(m->dev, &out, &dx);
    return 0;
}

/* The loss scalar alone, zeroed before and read after one whole-model pass. */
static double read_loss(struct am_model *m)
{
    double loss;
    m->K->download(m->dev, &loss, m->scalars.loss.data, sizeof(loss));
    return loss;
}

static void zero_loss(struct am_model *m) { m->K->zero(m->dev, &m->scalars.loss); }

int am_model_step(struct am_model *m, const int32_t *tokens, const int32_t *targets, const int32_t *starts,
                  int64_t batch, float dloss_scale, double *loss_sum, char *err, size_t err_len)
{
    if (!m->sh.first_stage || !m->sh.last_stage || m->sh.n_chunks != 1)
        return am_fail(err, err_len, "model: am_model_step runs a whole model; this rank holds part of a pipeline");
    zero_loss(m);
    if (am_model_forward(m, 0, 0, batch, tokens, targets, starts, NULL, NULL, dloss_scale, err, err_len) < 0 ||
        am_model_backward(m, 0, 0, NULL, NULL, dloss_scale, err, err_len) < 0)
        return -1;
    *loss_sum = read_loss(m);
    return 0;
}

int am_model_loss(struct am_model *m, const int32_t *tokens, const int32_t *targets, const int32_t *starts,
                  int64_t batch, double *loss_sum, char *err, size_t err_len)
{
    if (!m->sh.first_stage || !m->sh.last_stage || m->sh.n_chunks != 1)
        return am_fail(err, err_len, "model: am_model_loss runs a whole model; this rank holds part of a pipeline");
    zero_loss(m);
    if (forward_chunk(m, 0, 0, batch, tokens, targets, starts, NULL, NULL, 0.0f, false, err, err_len) < 0)
        return -1;
    *loss_sum = read_loss(m);
    return 0;
}

/* A tied embedding split over the first and the last pipeline stage: each copy got the
 * gradient of its own use (lookup, head). Both become first + last, on both ranks, so that
 * the two copies stay equal bit for bit; exchanged piece by piece through a scratch buffer. */
static int sum_tied_copies(struct am_model *m, char *err, size_t err_len)
{
    struct am_param *p = m->sh.first_stage ? m->embed : m->head;
    int64_t n = am_tensor_numel(&p->g), piece = (int64_t)(am_tensor_bytes(&m->scratch_c) / sizeof(float));
    int last = am_comm_size(m->pp_comm) - 1, peer = m->sh.first_stage ? last : 0;
    for (int64_t off = 0; off < n; off += piece) {
        int64_t len = n - off < piece ? n - off : piece;
        struct am_tensor mine = am_tensor_view((float *)p->g.data + off, m->dev->device, AM_F32, len, 0, 0, 0);
        struct am_tensor theirs = am_tensor_view(m->scratch_c.data, m->dev->device, AM_F32, len, 0, 0, 0);
        int rc = m->sh.first_stage
                     ? am_send(m->pp_comm, mine.data, (size_t)len, AM_F32, peer, err, err_len) < 0 ||
                           am_recv(m->pp_comm, theirs.data, (size_t)len, AM_F32, peer, err, err_len) < 0
                     : am_recv(m->pp_comm, theirs.data, (size_t)len, AM_F32, peer, err, err_len) < 0 ||
                           am_send(m->pp_comm, mine.data, (size_t)len, AM_F32, peer, err, err_len) < 0;
        if (rc)
            return -1;
        m->K->add(m->dev, &mine, &theirs); /* first + last on both ranks: IEEE addition commutes */
    }
    return 0;
}

bool am_model_is_tied_copy(const struct am_model *m, const struct am_param *p)
{
    return m->cfg.tie_word_embeddings && p == m->head && p != m->embed;
}

/* With fewer kv heads than tp ranks, the ranks that share a kv head each computed its
 * gradient from their own query heads only: the true gradient is their sum. Each rank puts
 * its share in its head's slot of a device buffer of all kv heads, the tp group sums the
 * buffer, and each rank takes its head's slot back. */
static int sum_shared_kv(struct am_model *m, const struct am_layer *L, char *err, size_t err_len)
{
    /* k's weight, v's weight, then (Qwen2) k's bias and v's bias: for each, every kv head's slot */
    const struct am_param *kv[4] = {L->wk, L->wv, L->bk, L->bv};
    int n = L->bk ? 4 : 2;
    int64_t heads = m->cfg.num_key_value_heads, total = 0;
    struct am_tensor mine[4], g[4]; /* this rank's head's slot of each, and the gradients */
    for (int i = 0; i < n; i++) {
        int64_t slot = i < 2 ? m->head_dim * m->cfg.hidden_size : m->head_dim;
        mine[i] = am_tensor_view((float *)m->kv_sum.data + total + m->kv_head0 * slot, m->dev->device, AM_F32, slot,
                                 0, 0, 0);
        g[i] = am_tensor_view(kv[i]->g.data, m->dev->device, AM_F32, slot, 0, 0, 0);
        total += heads * slot;
    }
    struct am_tensor all = am_tensor_view(m->kv_sum.data, m->dev->device, AM_F32, total, 0, 0, 0);
    m->K->zero(m->dev, &all);
    for (int i = 0; i < n; i++)
        m->K->copy(m->dev, &mine[i], &g[i]);
    if (tp_sum(m, &all, err, err_len) < 0)
        return -1;
    for (int i = 0; i < n; i++)
        m->K->copy(m->dev, &g[i], &mine[i]);
    return 0;
}

int am_model_group_finish(struct am_model *m, int group, char *err, size_t err_len)
{
    const struct am_pgroup *G = &m->groups[group];
    if (G->frozen)
        return 0; /* LoRA's frozen base: no gradients */
    /* with sequence parallelism each rank saw its own token rows, and the q/k norms each rank's
     * own heads: those gradients are partial sums */
    for (int i = G->first; m->tp_comm && i < G->first + G->n; i++)
        if (m->params[i].partial_in_tp && tp_sum(m, &m->params[i].g, err, err_len) < 0)
            return -1;
    if (G->kind == AM_PG_LAYER && m->kv_sum.data)
        return sum_shared_kv(m, &m->layers[G->layer], err, err_len);
    return 0;
}

int am_model_finish_tied(struct am_model *m, char *err, size_t err_len)
{
    return tied_across_stages(m) && m->sh.lora_r == 0 ? sum_tied_copies(m, err, err_len) : 0;
}

int am_model_finish_grads(struct am_model *m, char *err, size_t err_len)
{
    if (am_model_finish_tied(m, err, err_len) < 0)
        return -1;
    for (int g = 0; g < m->n_groups; g++)
        if (am_model_group_finish(m, g, err, err_len) < 0)
            return -1;
    return 0;
}

/* x (one f64 on the device) as f32 in y, summed over each of the groups there are. */
static int sum_scalar(struct am_model *m, struct am_tensor *x, struct am_tensor *y, struct am_comm *const *groups,
                      int n, bool *reduced, char *err, size_t err_len)
{
    *reduced = false;
    m->K->convert(m->dev, y, x);
    for (int i = 0; i < n; i++) {
        if (!groups[i])
            continue;
        if (am_allreduce(groups[i], y->data, y->data, 1, AM_F32, AM_SUM, err, err_len) < 0)
            return -1;
        *reduced = true;
    }
    return 0;
}

int am_model_grad_sumsq(struct am_model *m, char *err, size_t err_len)
{
    m->K->zero(m->dev, &m->scalars.sumsq);
    for (int i = 0; i < m->n_params; i++) {
        const struct am_param *p = &m->params[i];
        if (am_model_is_tied_copy(m, p) || !p->g.data)
            continue; /* the first stage counts the tied embedding; LoRA's frozen base has no gradient */
        /* summed over ep too: the experts' once each, the rest ep times, so counted 1 / ep each */
        double ep = m->ep_comm && !am_moe_is_expert_param(m, p) ? (double)am_comm_size(m->ep_comm) : 1.0;
        m->K->sum_squares(m->dev, &m->scalars.sumsq, &p->g, (double)p->copies_in_tp * ep);
    }
    /* comms reduce fp32: a relative 6e-8, far below any clipping threshold's use */
    struct am_comm *groups[3] = {m->tp_comm, m->pp_comm, m->ep_comm};
    return sum_scalar(m, &m->scalars.sumsq, &m->scalars.sumsq_f, groups, 3, &m->sumsq_reduced, err, err_len);
}

int am_model_grad_sumsq_shards(struct am_model *m, const float *shards, int rank, struct am_comm *dp, char *err,
                               size_t err_len)
{
    m->K->zero(m->dev, &m->scalars.sumsq);
    for (int g = 0; g < m->n_groups; g++) {
        const struct am_pgroup *G = &m->groups[g];
        int r = G->comm ? am_comm_rank(G->comm) : rank; /* its place in the group its shards span */
        size_t lo = G->offset + (size_t)r * G->shard_elems, hi = lo + G->shard_elems;
        for (int i = G->first; i < G->first + G->n; i++) {
            const struct am_param *p = &m->params[i];
            size_t a = p->slab_off;
            size_t b = a + (size_t)am_tensor_numel(&p->g);
            if (am_model_is_tied_copy(m, p) || b <= lo || a >= hi)
                continue;
            a = a > lo ? a : lo;
            b = b < hi ? b : hi;
            struct am_tensor piece = am_tensor_view((float *)shards + G->shard_offset + (a - lo), m->dev->device,
                                                    AM_F32, (int64_t)(b - a), 0, 0, 0);
            m->K->sum_squares(m->dev, &m->scalars.sumsq, &piece, (double)p->copies_in_tp);
        }
    }
    struct am_comm *groups[3] = {m->tp_comm, m->pp_comm, dp};
    return sum_scalar(m, &m->scalars.sumsq, &m->scalars.sumsq_f, groups, 3, &m->sumsq_reduced, err, err_len);
}

int am_model_reduce_loss(struct am_model *m, struct am_comm *dp, char *err, size_t err_len)
{
    struct am_comm *groups[2] = {dp, m->pp_comm}; /* the loss is the last stage's */
    return sum_scalar(m, &m->scalars.loss, &m->scalars.loss_f, groups, 2, &m->loss_reduced, err, err_len);
}

const struct am_tensor *am_model_sumsq(const struct am_model *m)
{
    return m->sumsq_reduced ? &m->scalars.sumsq_f : &m->scalars.sumsq;
}

void am_model_read_scalars(struct am_model *m, struct am_model_values *v)
{
    struct scalar_block h;
    m->K->download(m->dev, &h, m->scalar_mem, sizeof(h));
    v->loss_sum = m->loss_reduced ? h.loss_f : h.loss;
    v->sumsq = m->sumsq_reduced ? h.sumsq_f : h.sumsq;
    v->local_sumsq = h.local_sumsq;
}
