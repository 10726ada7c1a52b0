/* layer.c - one decoder layer (model_impl.h): its parameters, then its pieces and the layer
 * itself, each forward beside its backward.
 *
 * A layer is an attention block and an MLP block on the residual stream, each
 * x += out(block(norm(x))): the column-parallel projections (q, k, v; gate, up) take their
 * input through am_tp_column_input, the row-parallel ones (o; down) give their output back
 * through am_tp_add_row_parallel (tp.c). Qwen2's biases, Qwen3's per-head q/k norms, Gemma's
 * post norms, GeGLU and capped attention, a sliding window, gpt-oss's attention sinks (after
 * whichever attention ran) and o's bias (added by tp rank 0 alone, before the sum over tp),
 * LoRA's adapters beside each adapted projection, and a mixture of experts in place of the MLP
 * (moe.h) are the variants.
 */
#include "model_impl.h"
#include "lora.h"
#include "rng.h"
#include "moe.h"
#include "packed.h"
#include "ring.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define add_param am_model_add_param /* params.c */

/* ---- parameters ---------------------------------------------------------------------- */

/* The layer's own parameters in transformers' order (model_impl.h). */
void am_layer_params(struct am_model *m, int l, int local)
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
    if (c->mla) { /* multi-head latent attention (mla.c), in transformers' order */
        int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim, kvw = c->qk_nope_head_dim + c->v_head_dim;
        int64_t H = c->num_attention_heads, Hl = m->heads, qr = c->q_lora_rank, kvr = c->kv_lora_rank;
        int64_t vd = c->v_head_dim;
        if (qr > 0) {
            L->wq_a = add_param(m, NAME("self_attn.q_a_proj.weight"), qr, C, AM_SPLIT_NONE, qr, C, 0, 0);
            L->q_a_norm = add_param(m, NAME("self_attn.q_a_layernorm.weight"), qr, 0, AM_SPLIT_NONE, qr, 0, 0, 0);
            L->wq = add_param(m, NAME("self_attn.q_b_proj.weight"), Hl * qk, qr, AM_SPLIT_ROWS, H * qk, qr, r * Hl * qk, 0);
        } else {
            L->wq = add_param(m, NAME("self_attn.q_proj.weight"), Hl * qk, C, AM_SPLIT_ROWS, H * qk, C, r * Hl * qk, 0);
        }
        int64_t kva = kvr + c->qk_rope_head_dim;
        L->wkv_a = add_param(m, NAME("self_attn.kv_a_proj_with_mqa.weight"), kva, C, AM_SPLIT_NONE, kva, C, 0, 0);
        L->kv_a_norm = add_param(m, NAME("self_attn.kv_a_layernorm.weight"), kvr, 0, AM_SPLIT_NONE, kvr, 0, 0, 0);
        L->wkv_b = add_param(m, NAME("self_attn.kv_b_proj.weight"), Hl * kvw, kvr, AM_SPLIT_ROWS, H * kvw, kvr,
                             r * Hl * kvw, 0);
        L->wo = add_param(m, NAME("self_attn.o_proj.weight"), C, Hl * vd, AM_SPLIT_COLS, C, H * vd, 0, r * Hl * vd);
        /* replicated over tp, each rank's gradient from its own heads: summed over tp */
        struct am_param *partial[] = {L->wq_a, L->q_a_norm, L->wkv_a, L->kv_a_norm};
        for (size_t i = 0; i < sizeof(partial) / sizeof(partial[0]); i++)
            if (partial[i])
                partial[i]->partial_in_tp = m->sh.tp > 1;
        L->window = am_model_layer_window(c, l);
        goto mlp;
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
    if (c->o_bias) /* gpt_oss: whole on every tp rank (added once, by tp rank 0) */
        L->bo = add_param(m, NAME("self_attn.o_proj.bias"), C, 0, AM_SPLIT_NONE, C, 0, 0, 0);
    if (c->gpt_oss) /* one sink logit per head, split over tp with the heads */
        L->sinks = add_param(m, NAME("self_attn.sinks"), m->heads, 0, AM_SPLIT_ROWS, c->num_attention_heads, 0,
                             r * m->heads, 0);
mlp:
    L->mlp_norm = add_param(m, NAME(c->gemma ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"), C,
                            0, AM_SPLIT_NONE, C, 0, 0, 0);
    if (am_model_layer_is_moe(c, l)) { /* the router and the experts in place of the MLP */
        if (c->n_shared_experts > 0) { /* glm4_moe's shared experts: a dense MLP beside them, split over tp */
            int64_t Is = c->n_shared_experts * c->moe_intermediate_size, Il = Is / m->sh.tp;
            L->w_gate = add_param(m, NAME("mlp.shared_experts.gate_proj.weight"), Il, C, AM_SPLIT_ROWS, Is, C, r * Il, 0);
            L->w_up = add_param(m, NAME("mlp.shared_experts.up_proj.weight"), Il, C, AM_SPLIT_ROWS, Is, C, r * Il, 0);
            L->w_down = add_param(m, NAME("mlp.shared_experts.down_proj.weight"), C, Il, AM_SPLIT_COLS, C, Is, 0, r * Il);
        }
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

/* LoRA (lora.h): A and B of each adapted projection, after the layer's own parameters, split
 * over tp with their base layer; the tp ranks' partial gradients (A beside a column-parallel
 * layer, B beside a row-parallel one) summed in am_model_finish_grads. */
void am_layer_lora_params(struct am_model *m, struct am_layer *L)
{
    const struct am_param *base[AM_LORA_NPROJ] = {L->wq, L->wk, L->wv,    L->wo,    L->w_gate,
                                                  L->w_up, L->w_down, L->wq_a, L->wkv_a, L->wkv_b};
    int64_t rk = m->sh.lora_r;
    for (int t = 0; rk > 0 && t < AM_LORA_NPROJ; t++) {
        if (!(m->sh.lora_targets >> t & 1u) || !base[t])
            continue;
        bool row = base[t]->split == AM_SPLIT_COLS;
        if (base[t]->split == AM_SPLIT_NONE) { /* replicated over tp (mla.c's q_a_proj, kv_a_proj_with_mqa):
                                                * A and B whole, both gradients partial (the rank's heads') */
            int64_t in = base[t]->full_cols, out = base[t]->full_rows, stem = (int64_t)strlen(base[t]->name) - 7;
            char n[128];
            snprintf(n, sizeof(n), "%.*s.lora_A.weight", (int)stem, base[t]->name);
            L->lora_a[t] = add_param(m, n, rk, in, AM_SPLIT_NONE, rk, in, 0, 0);
            snprintf(n, sizeof(n), "%.*s.lora_B.weight", (int)stem, base[t]->name);
            L->lora_b[t] = add_param(m, n, out, rk, AM_SPLIT_NONE, out, rk, 0, 0);
            L->lora_a[t]->partial_in_tp = L->lora_b[t]->partial_in_tp = m->sh.tp > 1;
            continue;
        }
        int64_t in = base[t]->full_cols, out = base[t]->full_rows, a_cols, a0, b_rows, b0;
        am_lora_split(in, out, row, m->sh.tp, m->sh.tp_rank, &a_cols, &a0, &b_rows, &b0);
        if (!row) { /* a kv projection held by several ranks keeps its rows (row0, its own kv head) */
            b_rows = base[t]->w.shape[0];
            b0 = base[t]->row0;
        }
        /* named after the base layer ("model.layers.3.mlp.shared_experts.gate_proj.lora_A.weight") */
        char n[128];
        int stem = (int)(strlen(base[t]->name) - strlen(".weight"));
        snprintf(n, sizeof(n), "%.*s.lora_A.weight", stem, base[t]->name);
        L->lora_a[t] = add_param(m, n, rk, a_cols, row ? AM_SPLIT_COLS : AM_SPLIT_NONE, rk, in, 0, a0);
        snprintf(n, sizeof(n), "%.*s.lora_B.weight", stem, base[t]->name);
        L->lora_b[t] = add_param(m, n, b_rows, rk, row ? AM_SPLIT_NONE : AM_SPLIT_ROWS, out, rk, b0, 0);
        struct am_param *partial = row ? L->lora_b[t] : L->lora_a[t];
        partial->partial_in_tp = m->sh.tp > 1;
        if (!row)
            L->lora_b[t]->copies_in_tp = base[t]->copies_in_tp;
    }
}

/* ---- shapes of the heads ------------------------------------------------------------- */

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

/* ---- norms --------------------------------------------------------------------------- */

/* RMSNorm as the model's family has it: w (Llama), or 1 + w (Gemma). */
void am_norm_forward(struct am_model *m, struct am_tensor *out, struct am_tensor *rstd, const struct am_tensor *x,
                     const struct am_param *norm)
{
    float eps = (float)m->cfg.rms_norm_eps;
    if (m->cfg.gemma)
        m->K->rmsnorm_offset_forward(m->dev, out, rstd, x, &norm->wc, eps);
    else
        m->K->rmsnorm_forward(m->dev, out, rstd, x, &norm->wc, eps);
}

/* The norm's backward alone: dx += the gradient of its input x from dout's. */
void am_norm_backward_local(struct am_model *m, struct am_tensor *dx, const struct am_param *norm,
                                const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *rstd)
{
    struct am_tensor *dw = base_grad(m, norm);
    if (m->cfg.gemma)
        m->K->rmsnorm_offset_backward(m->dev, dx, dw, dout, x, &norm->wc, rstd);
    else
        m->K->rmsnorm_backward(m->dev, dx, dw, dout, x, &norm->wc, rstd);
}

/* The gradient of a column-parallel input, summed over tp (all-reduce, or reduce-scatter to
 * this rank's rows), then through the norm into dx. */
int am_norm_backward(struct am_model *m, struct am_tensor *dx, struct am_param *norm, struct am_tensor *dh,
                     const struct am_tensor *x, const struct am_tensor *rstd, char *err, size_t err_len)
{
    struct am_tensor d;
    if (am_tp_column_input_grad(m, dh, am_rows_of(dx), &d, err, err_len) < 0)
        return -1;
    am_norm_backward_local(m, dx, norm, &d, x, rstd);
    return 0;
}

/* Gemma: the row-parallel output out (full rows, partial sums over tp) reduced (all-reduce,
 * or reduce-scatter to this rank's rows) into saved, normalised by the post norm and added
 * to the residual x. */
static int add_post_norm(struct am_model *m, struct am_tensor *x, struct am_tensor *out, struct am_tensor *saved,
                         struct am_tensor *rstd, const struct am_param *norm, char *err, size_t err_len)
{
    if (am_tp_reduce_rows(m, out, saved, err, err_len) < 0)
        return -1;
    struct am_tensor y = rows_of(&m->scratch_post, am_rows_of(x));
    am_norm_forward(m, &y, rstd, saved, norm);
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
    am_norm_backward_local(m, &d, norm, dx, saved, rstd);
    return am_tp_row_parallel_grad(m, &d, N, dy, err, err_len);
}

/* ---- attention's pieces -------------------------------------------------------------- */

/* Gemma's attention scale, query_pre_attn_scalar ** -0.5, and multi-head latent attention's,
 * (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 (Python floats, applied as fp32). */
static float attn_scale(const struct am_model *m)
{
    if (m->cfg.mla) { /* with yarn, times mscale² (DeepseekV3Attention's yarn_apply_mscale) */
        const struct am_model_config *c = &m->cfg;
        double s = pow((double)(c->qk_nope_head_dim + c->qk_rope_head_dim), -0.5);
        if (c->rope_scaling.type && strcmp(c->rope_scaling.type, "yarn") == 0 && c->rope_scaling.mscale_all_dim != 0) {
            double ms = am_yarn_mscale(c->rope_scaling.factor, c->rope_scaling.mscale_all_dim);
            s = s * ms * ms;
        }
        return (float)s;
    }
    return (float)(1.0 / sqrt(m->cfg.query_pre_attn_scalar));
}

/* The scale and soft cap of the block kernels' scores (kernels.h, attention_block_softcap):
 * Gemma's and multi-head latent attention's, or 0 and 0 (1 / sqrt(D), no cap) for the others. */
static float block_scale(const struct am_model *m) { return m->cfg.gemma || m->cfg.mla ? attn_scale(m) : 0.0f; }
static float block_cap(const struct am_model *m) { return m->cfg.gemma ? (float)m->cfg.attn_logit_softcapping : 0.0f; }

/* Rotary embedding of q and k [B, T, heads, D] (backward: of their gradients) with the layer's
 * tables: one row per position of the sequence, or with packed sequences one per row of the
 * micro-batch (each document's positions, packed.h: q and k seen as one sequence of B x T). */
void am_layer_rope(struct am_model *m, const struct am_layer *L, struct am_tensor *q4, struct am_tensor *k4,
                   bool backward)
{
    const struct am_tensor *cs = L->local_rope ? &m->cos_local : &m->cos, *sn = L->local_rope ? &m->sin_local : &m->sin;
    struct am_tensor q = *q4, k = *k4;
    if (m->pk) {
        cs = L->local_rope ? &m->pk->cos_local : &m->pk->cos;
        sn = L->local_rope ? &m->pk->sin_local : &m->pk->sin;
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

/* The attention of q4, k4, v4 [B, T, heads, D] (rope applied) into att4 and lse: over the cp
 * ring, by documents with packed sequences, or causal on the whole sequence; with the layer's
 * window and the model's scale and cap. Its backward adds to dq4, dk4, dv4. */
int am_attend_forward(struct am_model *m, const struct am_layer *L, struct am_tensor *att4, struct am_tensor *lse,
                      struct am_tensor *q4, struct am_tensor *k4, struct am_tensor *v4, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    if (m->cp) /* context parallelism: over the cp ring (ring.h) */
        return am_cp_attention_forward(m, att4, lse, q4, k4, v4, m->pk ? &m->pk->cur : NULL, L->window,
                                       block_scale(m), block_cap(m), err, err_len);
    if (m->pk) /* packed sequences: each row sees its own document (packed.h) */
        K->attention_block_softcap_forward(m->dev, att4, lse, q4, k4, v4, &m->pk->rows, &m->pk->rows, &m->pk->cur,
                                           L->window, 0, block_scale(m), block_cap(m));
    else if (m->cfg.gemma || m->cfg.mla)
        K->attention_softcap_forward(m->dev, att4, lse, q4, k4, v4, L->window, attn_scale(m), block_cap(m));
    else
        K->attention_forward(m->dev, att4, lse, q4, k4, v4, L->window);
    return 0;
}

int am_attend_backward(struct am_model *m, const struct am_layer *L, struct am_tensor *dq4, struct am_tensor *dk4,
                       struct am_tensor *dv4, struct am_tensor *datt4, struct am_tensor *att4, struct am_tensor *lse,
                       struct am_tensor *q4, struct am_tensor *k4, struct am_tensor *v4, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    if (m->cp)
        return am_cp_attention_backward(m, dq4, dk4, dv4, datt4, att4, lse, q4, k4, v4, m->pk ? &m->pk->cur : NULL,
                                        L->window, block_scale(m), block_cap(m), err, err_len);
    if (m->pk)
        K->attention_block_softcap_backward(m->dev, dq4, dk4, dv4, datt4, att4, lse, q4, k4, v4, &m->pk->rows,
                                            &m->pk->rows, &m->pk->cur, L->window, block_scale(m), block_cap(m));
    else if (m->cfg.gemma || m->cfg.mla)
        K->attention_softcap_backward(m->dev, dq4, dk4, dv4, datt4, att4, lse, q4, k4, v4, L->window, attn_scale(m),
                                      block_cap(m));
    else
        K->attention_backward(m->dev, dq4, dk4, dv4, datt4, att4, lse, q4, k4, v4, L->window);
    return 0;
}

/* LoRA (lora.h): projection t's adapter of layer L, with its dropout's mask in *dr when the
 * pass drops: over the whole tensor of the adapter's input (pre: A's columns) or output (post:
 * B's rows), keyed by the layer (m->where.layer), the projection and each row's sequence and
 * position (ring.h's zigzag under cp). */
static struct am_lora adapter_of(const struct am_model *m, const struct am_layer *L, int t, struct am_dropout *dr)
{
    struct am_lora l = {&L->lora_a[t]->wc, &L->lora_b[t]->wc, &L->lora_a[t]->g, &L->lora_b[t]->g,
                        m->sh.lora_alpha / (float)m->sh.lora_r, NULL, false};
    if (!m->lora_drop.on)
        return l;
    const struct am_lora_dropout *ld = &m->lora_drop;
    const struct am_param *in = L->lora_a[t], *out = L->lora_b[t];
    int64_t T = m->pk ? m->pk->seq_len : m->cp ? m->cp->seq_len : m->seq_len;
    *dr = (struct am_dropout){.p = (float)ld->p,
                              .seed = ld->seed,
                              .stream = am_splitmix64(((uint64_t)m->where.layer << 8 | (uint64_t)t) ^ 0x4c6f5241ull),
                              .seq0 = ld->cur_seq0,
                              .seq_step = ld->seq_step,
                              .seq_len = T,
                              .rows_per_seq = m->seq_len,
                              .pos = m->cp ? m->cp->pos + (int64_t)m->cp->rank * m->seq_len : NULL,
                              .col0 = ld->pre ? in->col0 : out->row0,
                              .cols = ld->pre ? in->full_cols : out->full_rows};
    l.drop = dr;
    l.drop_pre = ld->pre;
    return l;
}

/* Projection t's adapter, when it has one. y: the base layer's output (before a row-parallel
 * reduction); x: its input. */
void am_layer_lora_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, int t,
                           struct am_tensor *y, const struct am_tensor *x)
{
    if (!L->lora_a[t])
        return;
    int64_t N = y->shape[0];
    struct am_dropout dr;
    struct am_lora l = adapter_of(m, L, t, &dr);
    struct am_tensor tt = rows_of(&a->lora_t[t], N);
    struct am_tensor u = am_tensor_view(m->lora_u.data, m->K->device, m->act_dt, N, y->shape[1], 0, 0);
    am_lora_forward(m->dev, m->K, &l, y, x, &tt, &u, &m->lora_du); /* du: M ⊙ x with dropout "pre" */
}

/* Its backward: dx += the adapter's input gradient; A's and B's gradients accumulate. */
void am_layer_lora_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, int t,
                            struct am_tensor *dx, const struct am_tensor *dy, const struct am_tensor *x)
{
    if (!L->lora_a[t])
        return;
    int64_t N = dy->shape[0];
    struct am_dropout dr;
    struct am_lora l = adapter_of(m, L, t, &dr);
    struct am_tensor tt = rows_of(&a->lora_t[t], N);
    struct am_tensor du = am_tensor_view(m->lora_du.data, m->K->device, m->act_dt, N, dy->shape[1], 0, 0);
    struct am_tensor dt = rows_of(&m->lora_dt, N);
    am_lora_backward(m->dev, m->K, &l, dx, dy, x, &tt, &du, &dt, &m->lora_u);
}

/* ---- the layer ----------------------------------------------------------------------- */

/* The first N rows of the layer's saved MLP tensor t (gate, up or product), at the layer's MLP
 * width (its w_gate's rows): t may be wider (recompute's work set is the rank's widest MLP's). */
static struct am_tensor mlp_view(const struct am_model *m, const struct am_tensor *t, const struct am_layer *L,
                                 int64_t N)
{
    return am_tensor_view(t->data, m->K->device, m->act_dt, N, L->w_gate->w.shape[0], 0, 0);
}

/* Piece i of the MLP's backward scratch (the product's gradient, gate's, up's) for N rows at the
 * layer's MLP width. */
static struct am_tensor mlp_scratch(const struct am_model *m, const struct am_layer *L, int64_t N, int i)
{
    int64_t I = L->w_gate->w.shape[0];
    size_t part = (size_t)(N * I) * am_dtype_size(m->act_dt);
    return am_tensor_view((char *)m->scratch_mlp.data + i * part, m->K->device, m->act_dt, N, I, 0, 0);
}

/* One decoder layer on the residual stream x (R rows), saving what backward needs in a. */
int am_layer_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, struct am_tensor *x,
                     int64_t B, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    int64_t T = m->seq_len, N = B * T, D = m->head_dim, R = stream_rows(m, N);
    struct am_tensor x_in = rows_of(&a->x_in, R), h1 = rows_of(&a->h1, R), rstd1 = rows_of(&a->rstd1, R);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N);
    struct am_tensor att = rows_of(&a->att, N), lse = a->lse;
    struct am_tensor x_mid = rows_of(&a->x_mid, R), h2 = rows_of(&a->h2, R), rstd2 = rows_of(&a->rstd2, R);
    struct am_tensor o = rows_of(&m->scratch_c, N), in;
    lse.shape[0] = B;

    /* attention block: x += o_proj(attention(rope(q), rope(k), v)) of rmsnorm(x) */
    K->copy(m->dev, &x_in, x);
    am_norm_forward(m, &h1, &rstd1, x, L->attn_norm);
    if (am_tp_column_input(m, &h1, N, &in, err, err_len) < 0)
        return -1;
    if (L->wkv_a) { /* multi-head latent attention (mla.c) */
        if (am_mla_forward(m, L, a, &in, &o, B, err, err_len) < 0)
            return -1;
        goto attention_out;
    }
    if (L->q_norm) { /* Qwen3: q = q_norm(q_proj(h)), k = k_norm(k_proj(h)), RMSNorm over each head, before rope */
        struct am_tensor q_raw = rows_of(&a->q_raw, N), k_raw = rows_of(&a->k_raw, N);
        K->matmul_forward(m->dev, &q_raw, &in, &L->wq->wc);
        K->matmul_forward(m->dev, &k_raw, &in, &L->wk->wc);
        if (L->bq) { /* a projection's bias comes before the norm */
            K->bias_forward(m->dev, &q_raw, &L->bq->wc);
            K->bias_forward(m->dev, &k_raw, &L->bk->wc);
        }
        am_layer_lora_forward(m, L, a, AM_LORA_Q, &q_raw, &in);
        am_layer_lora_forward(m, L, a, AM_LORA_K, &k_raw, &in);
        struct am_tensor qr = head_rows(&q_raw, N * m->heads, D), kr = head_rows(&k_raw, N * m->kv_heads, D);
        struct am_tensor qn = head_rows(&q, N * m->heads, D), kn = head_rows(&k, N * m->kv_heads, D);
        struct am_tensor rq = rows_of(&a->rstd_q, N * m->heads), rk = rows_of(&a->rstd_k, N * m->kv_heads);
        am_norm_forward(m, &qn, &rq, &qr, L->q_norm);
        am_norm_forward(m, &kn, &rk, &kr, L->k_norm);
    } else {
        K->matmul_forward(m->dev, &q, &in, &L->wq->wc);
        K->matmul_forward(m->dev, &k, &in, &L->wk->wc);
        if (L->bq) { /* Qwen2: q, k = x · wᵀ + b, before rope (Qwen2Attention's nn.Linear(bias=True)) */
            K->bias_forward(m->dev, &q, &L->bq->wc);
            K->bias_forward(m->dev, &k, &L->bk->wc);
        }
        am_layer_lora_forward(m, L, a, AM_LORA_Q, &q, &in);
        am_layer_lora_forward(m, L, a, AM_LORA_K, &k, &in);
    }
    K->matmul_forward(m->dev, &v, &in, &L->wv->wc);
    if (L->bv)
        K->bias_forward(m->dev, &v, &L->bv->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_V, &v, &in);
    struct am_tensor q4 = heads_of(&q, B, T, m->heads, D), k4 = heads_of(&k, B, T, m->kv_heads, D);
    struct am_tensor v4 = heads_of(&v, B, T, m->kv_heads, D), att4 = heads_of(&att, B, T, m->heads, D);
    am_layer_rope(m, L, &q4, &k4, false);
    if (am_attend_forward(m, L, &att4, &lse, &q4, &k4, &v4, err, err_len) < 0)
        return -1;
    if (L->sinks) /* gpt_oss: each head's sink in the softmax's denominator (out and lse rescaled) */
        K->attention_sink_forward(m->dev, &att4, &lse, &L->sinks->wc);
    K->matmul_forward(m->dev, &o, &att, &L->wo->wc);
    if (L->bo && m->sh.tp_rank == 0) /* o's bias once in the sum over tp */
        K->bias_forward(m->dev, &o, &L->bo->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_O, &o, &att);
attention_out:
    if (L->post_attn_norm) {
        struct am_tensor oa = rows_of(&a->o_att, R), ra = rows_of(&a->rstd_oa, R);
        if (add_post_norm(m, x, &o, &oa, &ra, L->post_attn_norm, err, err_len) < 0)
            return -1;
    } else if (am_tp_add_row_parallel(m, x, &o, err, err_len) < 0) {
        return -1;
    }

    /* MLP block: x += down(silu(gate(h)) * up(h)) of h = rmsnorm(x) */
    K->copy(m->dev, &x_mid, x);
    am_norm_forward(m, &h2, &rstd2, x, L->mlp_norm);
    if (am_tp_column_input(m, &h2, N, &in, err, err_len) < 0)
        return -1;
    if (L->moe) { /* the experts in place of the MLP (moe.h), replicated over tp: o is whole */
        if (am_moe_forward(m, L, a, &in, &o, err, err_len) < 0)
            return -1;
        K->add(m->dev, x, &o);
        if (!L->w_gate)
            return 0;
        /* deepseek_v3's and glm4_moe's shared experts beside them: an MLP of their width, split over tp */
    }
    /* the MLP at its width (the saved tensors' with recompute are the rank's widest MLP's) */
    struct am_tensor gate = mlp_view(m, &a->gate, L, N), up = mlp_view(m, &a->up, L, N);
    struct am_tensor act = mlp_view(m, &a->act, L, N);
    K->matmul_forward(m->dev, &gate, &in, &L->w_gate->wc);
    K->matmul_forward(m->dev, &up, &in, &L->w_up->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_GATE, &gate, &in);
    am_layer_lora_forward(m, L, a, AM_LORA_UP, &up, &in);
    if (m->cfg.gemma)
        K->geglu_forward(m->dev, &act, &gate, &up);
    else
        K->swiglu_forward(m->dev, &act, &gate, &up);
    K->matmul_forward(m->dev, &o, &act, &L->w_down->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_DOWN, &o, &act);
    if (L->post_mlp_norm) {
        struct am_tensor om = rows_of(&a->o_mlp, R), rm = rows_of(&a->rstd_om, R);
        return add_post_norm(m, x, &o, &om, &rm, L->post_mlp_norm, err, err_len);
    }
    return am_tp_add_row_parallel(m, x, &o, err, err_len);
}

/* One layer in reverse: dx holds the gradient of the layer's output and becomes that of its
 * input. */
int am_layer_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                      struct am_tensor *dx, int64_t B, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    int64_t T = m->seq_len, N = B * T, D = m->head_dim, R = stream_rows(m, N);
    struct am_tensor x_in = rows_of(&a->x_in, R), h1 = rows_of(&a->h1, R), rstd1 = rows_of(&a->rstd1, R);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N);
    struct am_tensor att = rows_of(&a->att, N), lse = a->lse;
    struct am_tensor x_mid = rows_of(&a->x_mid, R), h2 = rows_of(&a->h2, R), rstd2 = rows_of(&a->rstd2, R);
    struct am_tensor dh = rows_of(&m->scratch_c, N), dy, in;
    lse.shape[0] = B;

    /* MLP block, in reverse; dx already holds the residual's gradient */
    if (L->post_mlp_norm) {
        struct am_tensor om = rows_of(&a->o_mlp, R), rm = rows_of(&a->rstd_om, R);
        if (post_norm_backward(m, dx, &om, &rm, L->post_mlp_norm, N, &dy, err, err_len) < 0)
            return -1;
    } else if (am_tp_row_parallel_grad(m, dx, N, &dy, err, err_len) < 0) {
        return -1;
    }
    if (L->moe) { /* the experts in place of the MLP (moe.h) */
        if (am_tp_column_input(m, &h2, N, &in, err, err_len) < 0)
            return -1;
        K->zero(m->dev, &dh);
        if (am_moe_backward(m, L, a, &dy, &in, &dh, err, err_len) < 0)
            return -1;
        if (m->tp_comm) /* each tp rank holds all of dh, which am_norm_backward sums over tp */
            K->scale(m->dev, &dh, 1.0f / (float)m->sh.tp);
        if (L->w_gate) { /* the shared experts (deepseek_v3, glm4_moe): their MLP's backward adds to dh (partial over tp) */
            struct am_tensor sg = mlp_view(m, &a->gate, L, N), su = mlp_view(m, &a->up, L, N);
            struct am_tensor sa = mlp_view(m, &a->act, L, N), sda = mlp_scratch(m, L, N, 0);
            struct am_tensor sdg = mlp_scratch(m, L, N, 1), sdu = mlp_scratch(m, L, N, 2);
            K->zero(m->dev, &sda);
            K->matmul_backward(m->dev, &sda, base_grad(m, L->w_down), &dy, &sa, &L->w_down->wc);
            am_layer_lora_backward(m, L, a, AM_LORA_DOWN, &sda, &dy, &sa);
            K->zero(m->dev, &sdg);
            K->zero(m->dev, &sdu);
            K->swiglu_backward(m->dev, &sdg, &sdu, &sda, &sg, &su);
            K->matmul_backward(m->dev, &dh, base_grad(m, L->w_gate), &sdg, &in, &L->w_gate->wc);
            K->matmul_backward(m->dev, &dh, base_grad(m, L->w_up), &sdu, &in, &L->w_up->wc);
            am_layer_lora_backward(m, L, a, AM_LORA_GATE, &dh, &sdg, &in);
            am_layer_lora_backward(m, L, a, AM_LORA_UP, &dh, &sdu, &in);
        }
        if (am_norm_backward(m, dx, L->mlp_norm, &dh, &x_mid, &rstd2, err, err_len) < 0)
            return -1;
        goto attention;
    }
    struct am_tensor gate = mlp_view(m, &a->gate, L, N), up = mlp_view(m, &a->up, L, N);
    struct am_tensor act = mlp_view(m, &a->act, L, N), dact = mlp_scratch(m, L, N, 0);
    struct am_tensor dgate = mlp_scratch(m, L, N, 1), dup = mlp_scratch(m, L, N, 2);
    K->zero(m->dev, &dact);
    K->matmul_backward(m->dev, &dact, base_grad(m, L->w_down), &dy, &act, &L->w_down->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_DOWN, &dact, &dy, &act);
    K->zero(m->dev, &dgate);
    K->zero(m->dev, &dup);
    if (m->cfg.gemma)
        K->geglu_backward(m->dev, &dgate, &dup, &dact, &gate, &up);
    else
        K->swiglu_backward(m->dev, &dgate, &dup, &dact, &gate, &up);
    if (am_tp_column_input(m, &h2, N, &in, err, err_len) < 0)
        return -1;
    K->zero(m->dev, &dh);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->w_gate), &dgate, &in, &L->w_gate->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->w_up), &dup, &in, &L->w_up->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_GATE, &dh, &dgate, &in);
    am_layer_lora_backward(m, L, a, AM_LORA_UP, &dh, &dup, &in);
    if (am_norm_backward(m, dx, L->mlp_norm, &dh, &x_mid, &rstd2, err, err_len) < 0)
        return -1;

    /* attention block, in reverse */
attention:;
    struct am_tensor datt = rows_of(&m->scratch_att, N), dq = rows_of(&m->scratch_q, N);
    struct am_tensor dk = rows_of(&m->scratch_kv_k, N), dv = rows_of(&m->scratch_kv_v, N);
    if (L->post_attn_norm) {
        struct am_tensor oa = rows_of(&a->o_att, R), ra = rows_of(&a->rstd_oa, R);
        if (post_norm_backward(m, dx, &oa, &ra, L->post_attn_norm, N, &dy, err, err_len) < 0)
            return -1;
    } else if (am_tp_row_parallel_grad(m, dx, N, &dy, err, err_len) < 0) {
        return -1;
    }
    if (L->wkv_a) { /* multi-head latent attention (mla.c) */
        if (am_tp_column_input(m, &h1, N, &in, err, err_len) < 0 ||
            am_mla_backward(m, L, a, &in, &dy, &dh, B, err, err_len) < 0)
            return -1;
        return am_norm_backward(m, dx, L->attn_norm, &dh, &x_in, &rstd1, err, err_len);
    }
    K->zero(m->dev, &datt);
    K->matmul_backward(m->dev, &datt, base_grad(m, L->wo), &dy, &att, &L->wo->wc);
    if (L->bo && m->sh.lora_r == 0) /* every tp rank has all of dy: the same gradient on each */
        K->bias_backward(m->dev, &L->bo->g, &dy);
    am_layer_lora_backward(m, L, a, AM_LORA_O, &datt, &dy, &att);
    K->zero(m->dev, &dq);
    K->zero(m->dev, &dk);
    K->zero(m->dev, &dv);
    struct am_tensor q4 = heads_of(&q, B, T, m->heads, D), k4 = heads_of(&k, B, T, m->kv_heads, D);
    struct am_tensor v4 = heads_of(&v, B, T, m->kv_heads, D), att4 = heads_of(&att, B, T, m->heads, D);
    struct am_tensor dq4 = heads_of(&dq, B, T, m->heads, D), dk4 = heads_of(&dk, B, T, m->kv_heads, D);
    struct am_tensor dv4 = heads_of(&dv, B, T, m->kv_heads, D), datt4 = heads_of(&datt, B, T, m->heads, D);
    if (L->sinks && m->sh.lora_r == 0) /* the sinks' gradient; q, k and v's is the attention's given its out and lse */
        K->attention_sink_backward(m->dev, &L->sinks->g, &datt4, &att4, &lse, &L->sinks->wc);
    if (am_attend_backward(m, L, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4, err, err_len) < 0)
        return -1;
    am_layer_rope(m, L, &dq4, &dk4, true);
    if (L->q_norm) { /* through the per-head norms: dq, dk become the gradients of q_proj's and k_proj's outputs */
        struct am_tensor dq_raw = datt, dk_raw = rows_of(&m->scratch_kn, N); /* datt is spent */
        struct am_tensor q_raw = rows_of(&a->q_raw, N), k_raw = rows_of(&a->k_raw, N);
        struct am_tensor dqr = head_rows(&dq_raw, N * m->heads, D), dkr = head_rows(&dk_raw, N * m->kv_heads, D);
        struct am_tensor dqn = head_rows(&dq, N * m->heads, D), dkn = head_rows(&dk, N * m->kv_heads, D);
        struct am_tensor qr = head_rows(&q_raw, N * m->heads, D), kr = head_rows(&k_raw, N * m->kv_heads, D);
        struct am_tensor rq = rows_of(&a->rstd_q, N * m->heads), rk = rows_of(&a->rstd_k, N * m->kv_heads);
        K->zero(m->dev, &dq_raw);
        K->zero(m->dev, &dk_raw);
        am_norm_backward_local(m, &dqr, L->q_norm, &dqn, &qr, &rq);
        am_norm_backward_local(m, &dkr, L->k_norm, &dkn, &kr, &rk);
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
    if (am_tp_column_input(m, &h1, N, &in, err, err_len) < 0)
        return -1;
    K->zero(m->dev, &dh);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wq), &dq, &in, &L->wq->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wk), &dk, &in, &L->wk->wc);
    K->matmul_backward(m->dev, &dh, base_grad(m, L->wv), &dv, &in, &L->wv->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_Q, &dh, &dq, &in);
    am_layer_lora_backward(m, L, a, AM_LORA_K, &dh, &dk, &in);
    am_layer_lora_backward(m, L, a, AM_LORA_V, &dh, &dv, &in);
    return am_norm_backward(m, dx, L->attn_norm, &dh, &x_in, &rstd1, err, err_len);
}
