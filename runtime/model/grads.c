/* grads.c - a step's gradients and device scalars (model_impl.h, model.h): zeroed at the
 * step's start, completed after its last backward (the tp ranks' partial sums, the kv heads
 * they share, the two copies of a tied embedding), their squared norm, the loss summed over
 * ranks, and the one read of the scalars the host needs.
 */
#include "model_impl.h"
#include "moe.h"

#include <stddef.h>

/* ---- the device scalars -------------------------------------------------------------- */

/* The device scalars (model.h, scalars), in one allocation read at once (am_model_read_scalars). */
struct scalar_block {
    double loss, sumsq, local_sumsq;
    float loss_f, sumsq_f;
    int32_t flag;
    int64_t job_max[2][AM_MODEL_JOB_MAX]; /* the trainer's: an all-reduce's send and receive */
};

int am_model_alloc_scalars(struct am_model *m)
{
    enum am_device dev = m->dev->device;
    m->scalar_mem = m->K->alloc(m->dev, sizeof(struct scalar_block));
    if (!m->scalar_mem)
        return -1;
    char *b = m->scalar_mem;
    m->scalars.loss = am_tensor_view(b, dev, AM_F64, 1, 0, 0, 0);
    m->scalars.sumsq = am_tensor_view(b + offsetof(struct scalar_block, sumsq), dev, AM_F64, 1, 0, 0, 0);
    m->scalars.local_sumsq = am_tensor_view(b + offsetof(struct scalar_block, local_sumsq), dev, AM_F64, 1, 0, 0, 0);
    m->scalars.loss_f = am_tensor_view(b + offsetof(struct scalar_block, loss_f), dev, AM_F32, 1, 0, 0, 0);
    m->scalars.sumsq_f = am_tensor_view(b + offsetof(struct scalar_block, sumsq_f), dev, AM_F32, 1, 0, 0, 0);
    m->scalars.flag = am_tensor_view(b + offsetof(struct scalar_block, flag), dev, AM_I32, 1, 0, 0, 0);
    for (int i = 0; i < 2; i++)
        m->scalars.job_max[i] = am_tensor_view(b + offsetof(struct scalar_block, job_max) + i * sizeof(int64_t) *
                                               AM_MODEL_JOB_MAX, dev, AM_I64, AM_MODEL_JOB_MAX, 0, 0, 0);
    return 0;
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

/* ---- completing the gradients -------------------------------------------------------- */

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
    if (am_tp_sum(m, &all, err, err_len) < 0)
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
        if (m->params[i].partial_in_tp && am_tp_sum(m, &m->params[i].g, err, err_len) < 0)
            return -1;
    if (G->kind == AM_PG_LAYER && m->kv_sum.data)
        return sum_shared_kv(m, &m->layers[G->layer], err, err_len);
    return 0;
}

int am_model_finish_tied(struct am_model *m, char *err, size_t err_len)
{
    return am_model_tied_across_stages(m) && m->sh.lora_r == 0 ? sum_tied_copies(m, err, err_len) : 0;
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

/* ---- sums over ranks, and the read --------------------------------------------------- */

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

int am_model_grad_sumsq_shards(struct am_model *m, const void *shards, enum am_dtype dt, int rank, struct am_comm *dp,
                               struct am_comm *replicas, char *err, size_t err_len)
{
    m->K->zero(m->dev, &m->scalars.sumsq);
    for (int g = 0; g < m->n_groups; g++) {
        const struct am_pgroup *G = &m->groups[g];
        /* summed over the replicas too: the experts' shards once each, the rest R times */
        double copies = replicas && G->kind != AM_PG_EXPERTS ? (double)am_comm_size(replicas) : 1.0;
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
            struct am_tensor piece =
                am_tensor_view((char *)shards + (G->shard_offset + (a - lo)) * am_dtype_size(dt), m->dev->device, dt,
                               (int64_t)(b - a), 0, 0, 0);
            m->K->sum_squares(m->dev, &m->scalars.sumsq, &piece, (double)p->copies_in_tp * copies);
        }
    }
    struct am_comm *groups[4] = {m->tp_comm, m->pp_comm, dp, replicas};
    return sum_scalar(m, &m->scalars.sumsq, &m->scalars.sumsq_f, groups, 4, &m->sumsq_reduced, err, err_len);
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
