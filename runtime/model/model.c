/* model.c - the Llama decoder over the kernel table (model.h): am_model_init in its steps,
 * and the forward and backward of one pipeline chunk for one micro-batch: the embedding, the
 * layers (layer.c), the final norm, the head and the loss.
 *
 * Reading order: init (its steps, then am_model_init), then one micro-batch: the hooks, the
 * head's forward and backward, the chunk's forward and backward, the whole model's step. The
 * other files of the model, and whom they call, are listed in model_impl.h.
 */
#include "model_impl.h"
#include "moe.h"
#include "packed.h"
#include "ring.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "util.h"

/* ---- init ---------------------------------------------------------------------------- */

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

/* The layouts the model runs (the dtype, the chunks, the tokens over sp, the experts, LoRA's
 * kv targets); -1 with the reason for another. After init's first fields (m->act_dt,
 * m->sh.sequence_parallel). */
static int check_layout(const struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                        int64_t batch, int64_t seq_len, char *err, size_t err_len)
{
    if (m->act_dt != AM_F32 && m->act_dt != AM_BF16)
        return am_fail(err, err_len, "model: compute dtype %s: the model computes in fp32 or bf16 (mixed precision)",
                       am_dtype_name(m->act_dt));
    if (m->store_dt != AM_F32 && m->store_dt != AM_BF16)
        return am_fail(err, err_len, "model: storage dtype %s: the model keeps its weights in fp32 or bf16",
                       am_dtype_name(m->store_dt));
    if (check_shard(sh, cfg, err, err_len) < 0)
        return -1;
    if (m->sh.sequence_parallel && (batch * seq_len) % sh->tp)
        return am_fail(err, err_len, "model: sequence parallelism splits the %lld tokens of a micro-batch over tp = %d "
                    "ranks: they must divide evenly", (long long)(batch * seq_len), sh->tp);
    if (am_moe_check(cfg, sh, err, err_len) < 0)
        return -1;
    if (sh->lora_r > 0 && (sh->lora_targets & (1u << AM_LORA_K | 1u << AM_LORA_V)) &&
        cfg->num_key_value_heads < sh->tp)
        return am_fail(err, err_len, "model: LoRA on k_proj or v_proj with tp = %d above the %ld kv heads (each kv "
                       "head shared by several tp ranks) is not supported yet", sh->tp, (long)cfg->num_key_value_heads);
    return 0;
}

/* This rank's shard of the heads, the MLP and the vocabulary; each chunk's first layer and
 * first slot (a chunk's slots at least 1), and the counts of layers, slots and saved layers. */
static void shard_shapes(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                         int64_t batch, int64_t seq_len)
{
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
}

/* The host's tables: parameters (sized for every kind of layer), groups, layers, slots and
 * each slot's layers' saved activations. -1: out of memory. */
static int alloc_tables(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh)
{
    m->params = calloc((size_t)((16 + (sh->lora_r > 0 ? 2 * AM_LORA_NPROJ : 0)) * m->n_layers + 6 +
                                am_moe_extra_params(cfg, m->n_layers) +
                                (sh->lora_r > 0 && sh->lora_experts ? 5 * cfg->num_experts * m->n_layers : 0)),
                       sizeof(*m->params));
    m->groups = calloc((size_t)(2 * m->n_layers + 4), sizeof(*m->groups));
    m->layers = calloc((size_t)m->n_layers, sizeof(*m->layers));
    m->slots = calloc((size_t)m->n_slots, sizeof(*m->slots));
    m->acts_mem = calloc(m->n_acts + 1, sizeof(*m->acts_mem));
    if (!m->params || !m->groups || !m->layers || !m->slots || !m->acts_mem)
        return -1;
    struct am_layer_acts *next = m->acts_mem;
    for (int c = 0; c < sh->n_chunks; c++)
        for (int s = 0; s < m->sh.chunks[c].slots; s++, next += sh->chunks[c].n_layers)
            m->slots[m->slot_base[c] + s].acts = next;
    return 0;
}

/* Every parameter of the shard in model order, each group begun before its parameters: the
 * embedding, each layer (layer.c; a MoE layer's experts a group of their own, moe.c), the
 * final norm with the head, and with LoRA every adapter in one group, the last. */
static void register_params(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh)
{
    int64_t C = cfg->hidden_size, V = cfg->vocab_size, r = sh->tp_rank;
    if (sh->first_stage) {
        am_model_begin_group(m, AM_PG_EMBED, -1, "embed");
        m->embed = am_model_add_param(m, "model.embed_tokens.weight", m->vocab_shard, C, AM_SPLIT_ROWS, V, C,
                                      r * m->vocab_shard, 0);
    }
    for (int c = 0; c < sh->n_chunks; c++)
        for (int i = 0; i < sh->chunks[c].n_layers; i++) {
            char name[32];
            snprintf(name, sizeof(name), "layers.%d", sh->chunks[c].first_layer + i);
            m->layers[m->chunk_base[c] + i].group = m->n_groups;
            am_model_begin_group(m, AM_PG_LAYER, m->chunk_base[c] + i, name);
            am_layer_params(m, sh->chunks[c].first_layer + i, m->chunk_base[c] + i);
        }
    if (sh->last_stage) {
        am_model_begin_group(m, AM_PG_HEAD, -1, "head");
        m->final_norm = am_model_add_param(m, "model.norm.weight", C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
        if (cfg->tie_word_embeddings && sh->first_stage)
            m->head = m->embed;
        else
            m->head = am_model_add_param(m, cfg->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
                                         m->vocab_shard, C, AM_SPLIT_ROWS, V, C, r * m->vocab_shard, 0);
    }
    if (sh->lora_r > 0) { /* LoRA: every adapter of the rank's layers in one group, the last */
        am_model_begin_group(m, AM_PG_LORA, -1, "lora");
        for (int c = 0; c < sh->n_chunks; c++)
            for (int i = 0; i < sh->chunks[c].n_layers; i++)
                am_layer_lora_params(m, &m->layers[m->chunk_base[c] + i]);
        if (sh->last_stage && (sh->lora_targets >> AM_LORA_HEAD & 1u)) { /* lm_head's: B split with the head */
            m->head_lora_a = am_model_add_param(m, "lm_head.lora_A.weight", sh->lora_r, C, AM_SPLIT_NONE, sh->lora_r,
                                                C, 0, 0);
            m->head_lora_b = am_model_add_param(m, "lm_head.lora_B.weight", m->vocab_shard, sh->lora_r, AM_SPLIT_ROWS,
                                                V, sh->lora_r, r * m->vocab_shard, 0);
            m->head_lora_a->partial_in_tp = sh->tp > 1;
        }
        if (m->groups[m->n_groups - 1].first == m->n_params) /* no adapted projection here */
            m->n_groups--;
        if (sh->lora_experts && cfg->num_experts > 0) { /* the experts' adapters: a group of their own (moe.h) */
            am_model_begin_group(m, AM_PG_LORA, -1, "lora.experts");
            m->groups[m->n_groups - 1].shard = AM_SHARD_EXPERT;
            for (int c = 0; c < sh->n_chunks; c++)
                for (int i = 0; i < sh->chunks[c].n_layers; i++)
                    am_moe_lora_params(m, sh->chunks[c].first_layer + i, &m->layers[m->chunk_base[c] + i]);
            if (m->groups[m->n_groups - 1].first == m->n_params) /* no MoE layer here */
                m->n_groups--;
        }
    }
}

/* ---- the activations: each slot's saved tensors, then the shared scratch ------------- */

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

/* The widths of a token's q, k, v and attention output on this rank (multi-head latent
 * attention: q and k at qk_nope + qk_rope a head, v and the output at v_head_dim; mla.c). */
struct att_widths {
    int64_t q, k, v, o;
};

static struct att_widths att_widths(const struct am_model *m)
{
    int64_t qk = am_model_qk_head_dim(&m->cfg), vd = am_model_v_head_dim(&m->cfg);
    return (struct att_widths){m->heads * qk, m->kv_heads * qk, m->kv_heads * vd, m->heads * vd};
}

/* The width of the rank's share of layer l's (the model's index) dense MLP (a MoE layer's
 * shared experts; 0 for a MoE layer without them). */
static int64_t mlp_width(const struct am_model *m, int l)
{
    return am_model_layer_mlp_width(&m->cfg, l) / m->sh.tp;
}

/* The widest MLP of the rank's layers: recompute's work set and the MLP's backward scratch. */
static int64_t rank_mlp_width(const struct am_model *m)
{
    int64_t w = 0;
    for (int c = 0; c < m->sh.n_chunks; c++)
        for (int i = 0; i < m->sh.chunks[c].n_layers; i++) {
            int64_t wl = mlp_width(m, m->sh.chunks[c].first_layer + i);
            w = wl > w ? wl : w;
        }
    return w;
}

/* A layer's saved tensors but x_in (own per slot, or the shared work set with recompute), its
 * MLP I wide (the layer's; the widest of the rank's for the work set; 0: none). */
static void carve_layer(struct am_model *m, struct slab *c, struct am_layer_acts *a, int64_t I)
{
    int64_t N = m->max_tokens, R = stream_rows(m, N), C = m->cfg.hidden_size, B = N / m->seq_len, T = m->seq_len;
    struct att_widths w = att_widths(m);
    a->h1 = carve(c, m->act_dt, R, C, 0, 0);
    a->rstd1 = carve(c, AM_F32, R, 0, 0, 0);
    a->q = carve(c, m->act_dt, N, w.q, 0, 0);
    a->k = carve(c, m->act_dt, N, w.k, 0, 0);
    if (m->cfg.qk_norm) {
        a->q_raw = carve(c, m->act_dt, N, w.q, 0, 0);
        a->k_raw = carve(c, m->act_dt, N, w.k, 0, 0);
        a->rstd_q = carve(c, AM_F32, N * m->heads, 0, 0, 0);
        a->rstd_k = carve(c, AM_F32, N * m->kv_heads, 0, 0, 0);
    }
    a->v = carve(c, m->act_dt, N, w.v, 0, 0);
    a->att = carve(c, m->act_dt, N, w.o, 0, 0);
    a->lse = carve(c, AM_F32, B, m->heads, T, 0);
    a->x_mid = carve(c, m->act_dt, R, C, 0, 0);
    a->h2 = carve(c, m->act_dt, R, C, 0, 0);
    a->rstd2 = carve(c, AM_F32, R, 0, 0, 0);
    if (I > 0) {
        a->gate = carve(c, m->act_dt, N, I, 0, 0);
        a->up = carve(c, m->act_dt, N, I, 0, 0);
        a->act = carve(c, m->act_dt, N, I, 0, 0);
    }
    for (int t = 0; m->sh.lora_r > 0 && t < AM_LORA_NPROJ; t++) /* the MLP's adapters where there is one */
        if (m->sh.lora_targets >> t & 1u && (I > 0 || (t != AM_LORA_GATE && t != AM_LORA_UP && t != AM_LORA_DOWN)))
            a->lora_t[t] = carve(c, m->act_dt, N, m->sh.lora_r, 0, 0);
    if (m->cfg.mla) { /* multi-head latent attention's low-rank activations (mla.c) */
        if (m->cfg.q_lora_rank > 0) {
            a->qa = carve(c, m->act_dt, N, m->cfg.q_lora_rank, 0, 0);
            a->qa_n = carve(c, m->act_dt, N, m->cfg.q_lora_rank, 0, 0);
            a->rstd_qa = carve(c, AM_F32, N, 0, 0, 0);
        }
        a->ckv = carve(c, m->act_dt, N, m->cfg.kv_lora_rank, 0, 0);
        a->ckv_n = carve(c, m->act_dt, N, m->cfg.kv_lora_rank, 0, 0);
        a->rstd_kv = carve(c, AM_F32, N, 0, 0, 0);
    }
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
    int64_t KV = m->kv_heads * D, I = rank_mlp_width(m), T = m->seq_len;
    struct att_widths w = att_widths(m);
    struct slab c = {.base = base, .dev = m->K->device};
    for (int k = 0; k < m->sh.n_chunks; k++) {
        for (int s = 0; s < m->sh.chunks[k].slots; s++) {
            struct am_slot *S = &m->slots[m->slot_base[k] + s];
            for (int l = 0; l < m->sh.chunks[k].n_layers; l++) {
                S->acts[l].x_in = carve(&c, m->act_dt, R, C, 0, 0);
                if (!m->sh.recompute)
                    carve_layer(m, &c, &S->acts[l], mlp_width(m, m->sh.chunks[k].first_layer + l));
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
        struct am_layer_acts work = {0};
        carve_layer(m, &c, &work, I);
        for (size_t i = 0; i < m->n_acts; i++) {
            struct am_tensor x_in = m->acts_mem[i].x_in;
            m->acts_mem[i] = work;
            m->acts_mem[i].x_in = x_in;
        }
    }
    m->x = carve(&c, m->act_dt, R, C, 0, 0);
    m->dx = carve(&c, m->act_dt, R, C, 0, 0);
    m->dhf = carve(&c, m->act_dt, N, C, 0, 0);
    int64_t RH = am_model_rotary_dim(&m->cfg) / 2; /* the rotary tables' width (partial rotary: < D / 2) */
    m->cos = carve(&c, AM_F32, T, RH, 0, 0);
    m->sin = carve(&c, AM_F32, T, RH, 0, 0);
    m->ce_t = carve(&c, AM_F32, N, 0, 0, 0);
    if (m->sh.tp > 1)
        m->ce_M = carve(&c, AM_F32, N, 0, 0, 0);
    if (m->sh.tp > m->cfg.num_key_value_heads) /* k's and v's weights (and biases) of every kv head */
        m->kv_sum = carve(&c, AM_F32, 2 * m->cfg.num_key_value_heads * D * (C + (m->cfg.qkv_bias ? 1 : 0)), 0, 0, 0);
    m->scratch_c = carve(&c, m->act_dt, N, C, 0, 0);
    m->scratch_q = carve(&c, m->act_dt, N, w.q, 0, 0);
    m->scratch_att = carve(&c, m->act_dt, N, w.o, 0, 0); /* with qk_norm also q's gradient before the norm */
    m->scratch_kv_k = carve(&c, m->act_dt, N, w.k, 0, 0);
    m->scratch_kv_v = carve(&c, m->act_dt, N, w.v, 0, 0);
    if (I > 0) /* the widest MLP's dact, dgate and dup (none where no layer has an MLP) */
        m->scratch_mlp = carve(&c, m->act_dt, N, 3 * I, 0, 0);
    if (m->cfg.qk_norm)
        m->scratch_kn = carve(&c, m->act_dt, N, KV, 0, 0);
    if (m->cfg.gemma)
        m->scratch_post = carve(&c, m->act_dt, R, C, 0, 0);
    if (m->cfg.mla)
        m->scratch_mla = carve(&c, m->act_dt, am_mla_scratch_elems(m), 0, 0, 0);
    if (m->sh.lora_r > 0) {
        int64_t wide = w.q > C ? w.q : C;
        wide = I > wide ? I : wide;
        if (m->cfg.mla) { /* q_a's output, kv_a's and kv_b's (mla.c; am-plan counts the same) */
            int64_t kvw = m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim, qr = m->cfg.q_lora_rank;
            int64_t kvb = m->heads * (m->cfg.qk_nope_head_dim + m->cfg.v_head_dim);
            wide = qr > wide ? qr : wide;
            wide = kvw > wide ? kvw : wide;
            wide = kvb > wide ? kvb : wide;
        }
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

/* The activation memory: measured, allocated, laid out. -1: out of memory. */
static int alloc_acts(struct am_model *m)
{
    m->act_bytes = layout_acts(m, NULL);
    m->act_mem = m->K->alloc(m->dev, m->act_bytes);
    if (!m->act_mem)
        return -1;
    layout_acts(m, m->act_mem);
    return 0;
}

/* The rotary tables: the model's, and Gemma 3's sliding layers'. */
static void rope_tables(struct am_model *m, const struct am_model_config *cfg)
{
    struct am_rope_scaling rs = am_model_rope_scaling(cfg);
    m->K->rope_tables(m->dev, &m->cos, &m->sin, cfg->rope_theta, &rs);
    if (cfg->rope_local_base_freq > 0) /* Gemma 3's sliding layers: their own theta, unscaled */
        m->K->rope_tables(m->dev, &m->cos_local, &m->sin_local, cfg->rope_local_base_freq, NULL);
}

int am_model_init(struct am_model *m, const struct am_model_config *cfg, const struct am_model_shard *sh,
                  const struct am_dev *dev, struct am_comm *tp_comm, struct am_comm *pp_comm, int64_t batch,
                  int64_t seq_len, char *err, size_t err_len)
{
    memset(m, 0, sizeof(*m));
    m->where = (struct am_model_where){AM_PHASE_SETUP, AM_WHERE_NONE};
    m->lora_drop.seq_step = 1;
    m->cfg = *cfg;
    m->sh = *sh;
    m->dev = dev;
    m->K = dev->k;
    m->tp_comm = sh->tp > 1 ? tp_comm : NULL;
    m->pp_comm = pp_comm;
    m->sh.sequence_parallel = sh->sequence_parallel && sh->tp > 1;
    m->act_dt = sh->compute;
    m->store_dt = sh->storage;
    m->save_dt = sh->params == AM_BF16 ? AM_BF16 : sh->storage;
    if (check_layout(m, cfg, sh, batch, seq_len, err, err_len) < 0)
        return -1;
    shard_shapes(m, cfg, sh, batch, seq_len);
    if (alloc_tables(m, cfg, sh) < 0)
        goto oom;
    register_params(m, cfg, sh);
    if (am_model_place_params(m) < 0 || am_model_alloc_scalars(m) < 0 || alloc_acts(m) < 0)
        goto oom;
    if (am_moe_init(m, err, err_len) < 0) {
        am_model_free(m);
        return -1;
    }
    rope_tables(m, cfg);
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

/* ---- one micro-batch: the hooks, the chunks' ends ------------------------------------ */

/* The head's group (final norm and head) on the last stage: the last group, or with LoRA the
 * one before the adapters' groups. */
static int head_group(const struct am_model *m)
{
    int g = m->n_groups - 1;
    while (g > 0 && m->groups[g].kind == AM_PG_LORA)
        g--;
    return g;
}

/* The group_use hook (model.h), when there is one. */
static int use_group(struct am_model *m, int group, bool backward, char *err, size_t err_len)
{
    return m->hooks.group_use ? m->hooks.group_use(m->hooks.arg, group, backward, err, err_len) : 0;
}

/* The grad_use hook (model.h), when there is one. */
static int grad_use(struct am_model *m, int group, char *err, size_t err_len)
{
    return m->hooks.grad_use ? m->hooks.grad_use(m->hooks.arg, group, err, err_len) : 0;
}

/* Tells the trainer that a group's gradients are final (model.h, grad_ready). */
static int group_done(struct am_model *m, int group, char *err, size_t err_len)
{
    if (!(m->grads_final || m->hooks.grads_each_pass) || !m->hooks.grad_ready || m->groups[group].tied)
        return 0;
    return m->hooks.grad_ready(m->hooks.arg, group, err, err_len);
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

size_t am_model_pipe_trailer_bytes(const struct am_model *m) { return am_moe_pipe_bytes(m); }

/* Gemma's embedding scale: sqrt(hidden_size) as a tensor of the compute dtype (transformers:
 * torch.tensor(hidden_size ** 0.5).to(weight.dtype): rounded to bf16 in bf16). */
static float embed_scale(const struct am_model *m)
{
    float s = (float)sqrt((double)m->cfg.hidden_size);
    if (m->act_dt == AM_BF16)
        s = am_bf16_to_f32(am_f32_to_bf16(s));
    return s;
}

/* ---- the head: the final norm, the output projection and the loss -------------------- */

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
        if (am_tp_reduce(m, &M, AM_MAX, err, err_len) < 0)
            return -1;
        K->ce_rescale(m->dev, &cs, &cm, &M);
        if (am_tp_reduce(m, &cs, AM_SUM, err, err_len) < 0 || am_tp_reduce(m, &ct, AM_SUM, err, err_len) < 0)
            return -1;
        K->copy(m->dev, &cm, &M);
    }
    K->ce_loss(m->dev, &m->scalars.loss, &cm, &cs, &ct, &tgt);
    return 0;
}

/* LoRA on lm_head: u = s · (hf · Aᵀ) [N, r] in the adapters' scratch (lora_u: the forward and
 * the backward each compute it, so a slot keeps nothing of it; its width is at least r). */
static struct am_tensor head_lora_u(struct am_model *m, const struct am_tensor *hf)
{
    struct am_tensor u = am_tensor_view(m->lora_u.data, m->K->device, m->act_dt, hf->shape[0], m->sh.lora_r, 0, 0);
    m->K->matmul_forward(m->dev, &u, hf, &m->head_lora_a->wc);
    m->K->scale(m->dev, &u, m->sh.lora_alpha / (float)m->sh.lora_r);
    return u;
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
        am_norm_forward(m, &rows, &rstdf, &xf, m->final_norm);
        if (am_sp_gather(m, &rows, &hf, err, err_len) < 0)
            return -1;
    } else {
        am_norm_forward(m, &hf, &rstdf, &xf, m->final_norm);
    }
    S->fused = false;
    float cap = (float)m->cfg.final_logit_softcapping;
    if (m->head_lora_a) { /* LoRA on lm_head: the logits x · Wᵀ + u · Bᵀ, u = s · (hf · Aᵀ) */
        struct am_tensor u = head_lora_u(m, &hf);
        K->ce_stats_lora(m->dev, &cm, &cs, &ct, &hf, &m->head->wc, &u, &m->head_lora_b->wc, &tgt, m->vocab_start,
                         cap > 0.0f ? cap : 0.0f);
        return combine_ce(m, S, N, err, err_len);
    }
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

/* The head and the loss in reverse: dx receives the gradient of the final norm's input. */
static int head_backward(struct am_model *m, const struct am_slot *S, struct am_tensor *dx, float dloss_scale,
                         char *err, size_t err_len)
{
    int64_t N = S->batch * m->seq_len, R = stream_rows(m, N);
    struct am_tensor tgt = rows_of(&S->targets, N), hf = rows_of(&S->hf, N), dhf = rows_of(&m->dhf, N);
    struct am_tensor xf = rows_of(&S->xf, R), rstdf = rows_of(&S->rstdf, R);
    struct am_tensor cm = rows_of(&S->ce_m, N), cs = rows_of(&S->ce_s, N);
    if (m->head_lora_a) { /* LoRA on lm_head: du = dlogits · B, then A's gradient and dhf's share */
        const struct am_kernels *K = m->K;
        struct am_tensor u = head_lora_u(m, &hf), du = rows_of(&m->lora_dt, N);
        float cap = (float)m->cfg.final_logit_softcapping;
        K->zero(m->dev, &dhf);
        K->zero(m->dev, &du);
        K->ce_backward_lora(m->dev, &dhf, base_grad(m, m->head), &du, &m->head_lora_b->g, &hf, &m->head->wc, &u,
                            &m->head_lora_b->wc, &tgt, m->vocab_start, &cm, &cs, dloss_scale, cap > 0.0f ? cap : 0.0f);
        K->scale(m->dev, &du, m->sh.lora_alpha / (float)m->sh.lora_r); /* dt = s · du */
        K->matmul_backward(m->dev, &dhf, &m->head_lora_a->g, &du, &hf, &m->head_lora_a->wc); /* dhf += dt · A */
    } else if (!S->fused) { /* dhf is summed over the vocabulary shards in am_norm_backward */
        m->K->zero(m->dev, &dhf);
        if (m->cfg.final_logit_softcapping > 0)
            m->K->ce_backward_softcap(m->dev, &dhf, base_grad(m, m->head), &hf, &m->head->wc, &tgt, m->vocab_start, &cm, &cs,
                                      dloss_scale, (float)m->cfg.final_logit_softcapping);
        else
            m->K->ce_backward(m->dev, &dhf, base_grad(m, m->head), &hf, &m->head->wc, &tgt, m->vocab_start, &cm, &cs,
                              dloss_scale);
    }
    m->K->zero(m->dev, dx);
    return am_norm_backward(m, dx, m->final_norm, &dhf, &xf, &rstdf, err, err_len);
}

/* ---- a chunk: forward and backward --------------------------------------------------- */

/* One chunk's forward for the micro-batch of `slot` (am_model_forward); want_grad: its backward
 * follows (am_model_loss runs without), so the head may compute its gradients already. */
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
    if (m->pk && am_packed_load(m, m->slot_base[chunk] + slot, B, starts, m->pack_fill_next, err, err_len) < 0)
        return -1;
    if (m->pk)
        am_packed_enter(m, m->slot_base[chunk] + slot, B);
    const struct am_kernels *K = m->K;
    struct am_slot *S = &m->slots[m->slot_base[chunk] + slot];
    int64_t N = B * m->seq_len, R = stream_rows(m, N);
    struct am_tensor x = rows_of(&m->x, R);
    S->batch = B;
    S->seq0 = m->lora_drop.seq0;
    m->lora_drop.cur_seq0 = S->seq0;
    m->lora_drop.on = want_grad && m->lora_drop.p > 0; /* training only */
    m->where = (struct am_model_where){AM_PHASE_FORWARD, AM_WHERE_EMBEDDING};
    if (is_first(m, chunk)) {
        /* the embedding: each rank looks up the ids of its vocabulary shard; summed over tp */
        struct am_tensor tok = rows_of(&S->tokens, N), e = rows_of(&m->scratch_c, N);
        if (use_group(m, 0, false, err, err_len) < 0)
            return -1;
        K->upload(m->dev, tok.data, tokens, (size_t)N * sizeof(int32_t));
        K->embedding_forward(m->dev, &e, &tok, &m->embed->wc, m->vocab_start);
        K->zero(m->dev, &x);
        if (am_tp_add_row_parallel(m, &x, &e, err, err_len) < 0)
            return -1;
        if (m->cfg.gemma) /* Gemma: the embedding times sqrt(hidden_size), in the compute dtype */
            K->scale(m->dev, &x, embed_scale(m));
    } else {
        struct am_tensor in = hidden(m, x_in, B);
        K->copy(m->dev, &x, &in);
    }
    const struct am_layer *layers = &m->layers[m->chunk_base[chunk]];
    /* the load-balancing statistics of the earlier stages travel after the hidden state */
    size_t hb = am_model_hidden_elems(m, B) * am_dtype_size(m->act_dt);
    am_moe_forward_begin(m, m->slot_base[chunk] + slot, is_first(m, chunk) ? NULL : (const char *)x_in + hb);
    for (int l = 0; l < m->sh.chunks[chunk].n_layers; l++) {
        m->where.layer = m->sh.chunks[chunk].first_layer + l;
        if (use_group(m, layers[l].group, false, err, err_len) < 0 ||
            am_layer_forward(m, &layers[l], &S->acts[l], &x, B, err, err_len) < 0)
            return -1;
    }
    if (am_moe_forward_end(m, m->slot_base[chunk] + slot, N, is_last(m, chunk) ? targets : NULL, dloss_scale,
                           is_last(m, chunk) ? NULL : (char *)x_out + hb, err, err_len) < 0)
        return -1;
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
    m->lora_drop.cur_seq0 = S->seq0;
    m->lora_drop.on = m->lora_drop.p > 0;
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
    /* the load-balancing loss's whole-model counts and gradient scale travel after the gradient */
    size_t hb = am_model_hidden_elems(m, B) * am_dtype_size(m->act_dt);
    am_moe_backward_begin(m, m->slot_base[chunk] + slot, is_last(m, chunk) ? NULL : (const char *)dy + hb);
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
            if (am_layer_forward(m, &layers[l], a, &x, B, err, err_len) < 0)
                return -1;
        }
        if (am_layer_backward(m, &layers[l], a, &dx, B, err, err_len) < 0 ||
            (layers[l].moe && group_done(m, layers[l].moe->experts_group, err, err_len) < 0) ||
            group_done(m, layers[l].group, err, err_len) < 0)
            return -1;
    }
    m->where.layer = AM_WHERE_EMBEDDING;
    if (is_first(m, chunk)) {
        struct am_tensor tok = rows_of(&S->tokens, N), g;
        if (am_tp_row_parallel_grad(m, &dx, N, &g, err, err_len) < 0 || grad_use(m, 0, err, err_len) < 0)
            return -1;
        if (m->cfg.gemma) /* through the embedding's scale */
            K->scale(m->dev, &g, embed_scale(m));
        if (m->sh.lora_r == 0) /* LoRA: the embedding is frozen */
            K->embedding_backward(m->dev, &m->embed->g, &g, &tok, m->vocab_start);
        return group_done(m, 0, err, err_len);
    }
    struct am_tensor out = hidden(m, dx_out, B);
    K->copy(m->dev, &out, &dx);
    am_moe_backward_end(m, m->slot_base[chunk] + slot, (char *)dx_out + hb);
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
