/* mla.c - multi-head latent attention (deepseek_v3: DeepSeek-V3, Moonlight, Kimi K2), the
 * attention block of its layers (model_impl.h), forward beside backward, as transformers'
 * DeepseekV3Attention computes it:
 *
 *   q  = q_b_proj(q_a_layernorm(q_a_proj(h)))   (q_proj(h) when q_lora_rank is null)
 *        per head [q_nope (dn), q_pe (dr)]
 *   kv = kv_a_proj_with_mqa(h) = [c (kv_lora_rank), k_pe (dr): one rope key for every head]
 *   kv_b_proj(kv_a_layernorm(c)) per head [k_nope (dn), v (dv)]
 *   attention of q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)], v, scaled by (dn + dr)^-0.5
 *   o  = o_proj(the heads' outputs [N, heads * dv])
 *
 * In the attention kernels a head of q and k is dn + dr wide and laid out [pe (dr), nope (dn)]:
 * the rope part first, so that the partial rotary tables (dr wide) rotate it; the scores are the
 * same dot products in another order of their terms. v and the heads' outputs are dv wide (the
 * kernels take v's head width apart from q's and k's), so the outputs [N, heads * dv] are
 * o_proj's input as they are, and their gradient o_proj's dx. The saved q, k, v and outputs sit
 * at the start of activations sized for head_dim = max(dn + dr, dv) wide heads. With
 * rope_interleave the rope part is taken de-interleaved (x0, x2, ..., x1, x3, ...), as
 * transformers' view/transpose before rotate-half (kernels.h, copy_cols).
 *
 * Tensor parallelism: each rank holds its heads of q_b_proj (q_proj) and kv_b_proj (column-
 * parallel) and their input columns of o_proj (row-parallel); q_a_proj, kv_a_proj_with_mqa and
 * their norms whole (model.h), their gradients from the rank's heads summed over tp.
 *
 * LoRA (lora.h): an adapter beside each of the five projections, split as its base layer: B of
 * q_b_proj (q_proj) and kv_b_proj by the rank's heads, A of o_proj by its columns, those of
 * q_a_proj and kv_a_proj_with_mqa whole with both gradients partial (summed over tp).
 */
#include "model_impl.h"

/* q_a_layernorm's and kv_a_layernorm's eps: DeepseekV3RMSNorm's default, whatever rms_norm_eps is */
#define MLA_NORM_EPS 1e-6f

/* The pieces of scratch_mla, in elements of the activation dtype, for N tokens of this rank's
 * heads: q (or its gradient) [N, Hl qk], kv_a's output (or gradient) [N, kvr + dr], kv_b's
 * [N, Hl (dn + dv)], and the gradients of the compressed kv and of q_a's output, before and
 * after their norms. */
struct mla_scratch {
    struct am_tensor q, kva, kvb, dckv_n, dckv, dqa_n, dqa;
};

#define MLA_PIECES 7

static int64_t widths(const struct am_model *m, int64_t w[MLA_PIECES])
{
    const struct am_model_config *c = &m->cfg;
    int64_t Hl = m->heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    int64_t qr = c->q_lora_rank, kvr = c->kv_lora_rank;
    int64_t v[MLA_PIECES] = {Hl * qk, kvr + c->qk_rope_head_dim, Hl * (c->qk_nope_head_dim + c->v_head_dim),
                             kvr, kvr, qr, qr};
    int64_t sum = 0;
    for (int i = 0; i < MLA_PIECES; i++)
        sum += (w[i] = v[i]);
    return sum;
}

int64_t am_mla_scratch_elems(const struct am_model *m)
{
    int64_t w[MLA_PIECES];
    return m->max_tokens * widths(m, w);
}

static struct mla_scratch scratch(const struct am_model *m, int64_t N)
{
    int64_t w[MLA_PIECES];
    widths(m, w);
    struct am_tensor *t[MLA_PIECES];
    struct mla_scratch s;
    t[0] = &s.q, t[1] = &s.kva, t[2] = &s.kvb;
    t[3] = &s.dckv_n, t[4] = &s.dckv, t[5] = &s.dqa_n, t[6] = &s.dqa;
    char *p = m->scratch_mla.data;
    for (int i = 0; i < MLA_PIECES; i++) {
        *t[i] = am_tensor_view(p, m->K->device, m->act_dt, N, w[i], 0, 0);
        p += (size_t)(N * w[i]) * am_dtype_size(m->act_dt);
    }
    return s;
}

/* [rows, cols] over the same memory */
static struct am_tensor as2d(const struct am_tensor *t, int64_t rows, int64_t cols)
{
    return am_tensor_view(t->data, t->device, t->dtype, rows, cols, 0, 0);
}

int am_mla_forward(struct am_model *m, const struct am_layer *L, struct am_layer_acts *a, const struct am_tensor *in,
                   struct am_tensor *o, int64_t B, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    const struct am_model_config *c = &m->cfg;
    int64_t T = m->seq_len, N = B * T, Hl = m->heads;
    int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, kvr = c->kv_lora_rank;
    int64_t D = dn + dr; /* q's and k's heads */
    int perm = c->rope_interleave ? 1 : 0;
    struct mla_scratch s = scratch(m, N);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N), att = rows_of(&a->att, N);
    struct am_tensor lse = a->lse;
    lse.shape[0] = B;

    if (L->wq_a) { /* q through its low rank: q_a_proj, its norm, q_b_proj */
        struct am_tensor qa = rows_of(&a->qa, N), qa_n = rows_of(&a->qa_n, N), rq = rows_of(&a->rstd_qa, N);
        K->matmul_forward(m->dev, &qa, in, &L->wq_a->wc);
        am_layer_lora_forward(m, L, a, AM_LORA_Q_A, &qa, in);
        K->rmsnorm_forward(m->dev, &qa_n, &rq, &qa, &L->q_a_norm->wc, MLA_NORM_EPS);
        K->matmul_forward(m->dev, &s.q, &qa_n, &L->wq->wc);
        am_layer_lora_forward(m, L, a, AM_LORA_Q, &s.q, &qa_n);
    } else {
        K->matmul_forward(m->dev, &s.q, in, &L->wq->wc);
        am_layer_lora_forward(m, L, a, AM_LORA_Q, &s.q, in);
    }
    struct am_tensor ckv = rows_of(&a->ckv, N), ckv_n = rows_of(&a->ckv_n, N), rkv = rows_of(&a->rstd_kv, N);
    K->matmul_forward(m->dev, &s.kva, in, &L->wkv_a->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_KV_A, &s.kva, in);
    K->copy_cols(m->dev, &ckv, 0, &s.kva, 0, kvr, 0, false);
    K->rmsnorm_forward(m->dev, &ckv_n, &rkv, &ckv, &L->kv_a_norm->wc, MLA_NORM_EPS);
    K->matmul_forward(m->dev, &s.kvb, &ckv_n, &L->wkv_b->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_KV_B, &s.kvb, &ckv_n);

    /* the heads as the kernels take them: [pe, nope] for q and k, v as it is */
    struct am_tensor qh = as2d(&q, N * Hl, D), kh = as2d(&k, N * Hl, D), vh = as2d(&v, N * Hl, dv);
    struct am_tensor qs = as2d(&s.q, N * Hl, dn + dr), kvs = as2d(&s.kvb, N * Hl, dn + dv), kt = as2d(&k, N, Hl * D);
    K->copy_cols(m->dev, &qh, 0, &qs, dn, dr, perm, false);
    K->copy_cols(m->dev, &qh, dr, &qs, 0, dn, 0, false);
    for (int64_t h = 0; h < Hl; h++) /* the one rope key, in every head */
        K->copy_cols(m->dev, &kt, h * D, &s.kva, kvr, dr, perm, false);
    K->copy_cols(m->dev, &kh, dr, &kvs, 0, dn, 0, false);
    K->copy_cols(m->dev, &vh, 0, &kvs, dn, dv, 0, false);

    struct am_tensor q4 = am_tensor_view(q.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor k4 = am_tensor_view(k.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor v4 = am_tensor_view(v.data, K->device, m->act_dt, B, T, Hl, dv);
    struct am_tensor att4 = am_tensor_view(att.data, K->device, m->act_dt, B, T, Hl, dv);
    am_layer_rope(m, L, &q4, &k4, false);
    if (am_attend_forward(m, L, &att4, &lse, &q4, &k4, &v4, err, err_len) < 0)
        return -1;
    struct am_tensor o_in = as2d(&att, N, Hl * dv); /* the heads' outputs: o_proj's input */
    K->matmul_forward(m->dev, o, &o_in, &L->wo->wc);
    am_layer_lora_forward(m, L, a, AM_LORA_O, o, &o_in);
    return 0;
}

int am_mla_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a,
                    const struct am_tensor *in, const struct am_tensor *dy, struct am_tensor *dh, int64_t B, char *err,
                    size_t err_len)
{
    const struct am_kernels *K = m->K;
    const struct am_model_config *c = &m->cfg;
    int64_t T = m->seq_len, N = B * T, Hl = m->heads;
    int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, kvr = c->kv_lora_rank;
    int64_t D = dn + dr; /* q's and k's heads */
    int perm = c->rope_interleave ? -1 : 0;
    struct mla_scratch s = scratch(m, N);
    struct am_tensor q = rows_of(&a->q, N), k = rows_of(&a->k, N), v = rows_of(&a->v, N), att = rows_of(&a->att, N);
    struct am_tensor lse = a->lse;
    lse.shape[0] = B;
    struct am_tensor datt = rows_of(&m->scratch_att, N), dq = rows_of(&m->scratch_q, N);
    struct am_tensor dk = rows_of(&m->scratch_kv_k, N), dv_ = rows_of(&m->scratch_kv_v, N);

    /* o_proj: its input the heads' outputs [N, heads * dv], its dx their gradient */
    struct am_tensor o_in = as2d(&att, N, Hl * dv), do_in = as2d(&datt, N, Hl * dv);
    K->zero(m->dev, &do_in);
    K->matmul_backward(m->dev, &do_in, base_grad(m, L->wo), dy, &o_in, &L->wo->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_O, &do_in, dy, &o_in);

    struct am_tensor q4 = am_tensor_view(q.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor k4 = am_tensor_view(k.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor v4 = am_tensor_view(v.data, K->device, m->act_dt, B, T, Hl, dv);
    struct am_tensor att4 = am_tensor_view(att.data, K->device, m->act_dt, B, T, Hl, dv);
    struct am_tensor dq4 = am_tensor_view(dq.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor dk4 = am_tensor_view(dk.data, K->device, m->act_dt, B, T, Hl, D);
    struct am_tensor dv4 = am_tensor_view(dv_.data, K->device, m->act_dt, B, T, Hl, dv);
    struct am_tensor datt4 = am_tensor_view(datt.data, K->device, m->act_dt, B, T, Hl, dv);
    K->zero(m->dev, &dq4);
    K->zero(m->dev, &dk4);
    K->zero(m->dev, &dv4);
    if (am_attend_backward(m, L, &dq4, &dk4, &dv4, &datt4, &att4, &lse, &q4, &k4, &v4, err, err_len) < 0)
        return -1;
    am_layer_rope(m, L, &dq4, &dk4, true);

    /* the heads' gradients back into the projections' layouts */
    struct am_tensor dqh = as2d(&dq, N * Hl, D), dkh = as2d(&dk, N * Hl, D), dvh = as2d(&dv_, N * Hl, dv);
    struct am_tensor dqs = as2d(&s.q, N * Hl, dn + dr), dkvs = as2d(&s.kvb, N * Hl, dn + dv);
    struct am_tensor dkt = as2d(&dk, N, Hl * D);
    K->copy_cols(m->dev, &dqs, dn, &dqh, 0, dr, perm, false);
    K->copy_cols(m->dev, &dqs, 0, &dqh, dr, dn, 0, false);
    K->copy_cols(m->dev, &dkvs, 0, &dkh, dr, dn, 0, false);
    K->copy_cols(m->dev, &dkvs, dn, &dvh, 0, dv, 0, false);
    K->zero(m->dev, &s.kva);
    for (int64_t h = 0; h < Hl; h++) /* the shared rope key: the heads' gradients summed */
        K->copy_cols(m->dev, &s.kva, kvr, &dkt, h * D, dr, perm, true);

    /* kv_b_proj, kv_a_layernorm, into kv_a's output gradient */
    struct am_tensor ckv = rows_of(&a->ckv, N), ckv_n = rows_of(&a->ckv_n, N), rkv = rows_of(&a->rstd_kv, N);
    K->zero(m->dev, &s.dckv_n);
    K->matmul_backward(m->dev, &s.dckv_n, base_grad(m, L->wkv_b), &s.kvb, &ckv_n, &L->wkv_b->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_KV_B, &s.dckv_n, &s.kvb, &ckv_n);
    K->zero(m->dev, &s.dckv);
    am_norm_backward_local(m, &s.dckv, L->kv_a_norm, &s.dckv_n, &ckv, &rkv);
    K->copy_cols(m->dev, &s.kva, 0, &s.dckv, 0, kvr, 0, false);

    K->zero(m->dev, dh);
    K->matmul_backward(m->dev, dh, base_grad(m, L->wkv_a), &s.kva, in, &L->wkv_a->wc);
    am_layer_lora_backward(m, L, a, AM_LORA_KV_A, dh, &s.kva, in);
    if (L->wq_a) {
        struct am_tensor qa = rows_of(&a->qa, N), qa_n = rows_of(&a->qa_n, N), rq = rows_of(&a->rstd_qa, N);
        K->zero(m->dev, &s.dqa_n);
        K->matmul_backward(m->dev, &s.dqa_n, base_grad(m, L->wq), &s.q, &qa_n, &L->wq->wc);
        am_layer_lora_backward(m, L, a, AM_LORA_Q, &s.dqa_n, &s.q, &qa_n);
        K->zero(m->dev, &s.dqa);
        am_norm_backward_local(m, &s.dqa, L->q_a_norm, &s.dqa_n, &qa, &rq);
        K->matmul_backward(m->dev, dh, base_grad(m, L->wq_a), &s.dqa, in, &L->wq_a->wc);
        am_layer_lora_backward(m, L, a, AM_LORA_Q_A, dh, &s.dqa, in);
    } else {
        K->matmul_backward(m->dev, dh, base_grad(m, L->wq), &s.q, in, &L->wq->wc);
        am_layer_lora_backward(m, L, a, AM_LORA_Q, dh, &s.q, in);
    }
    return 0;
}
