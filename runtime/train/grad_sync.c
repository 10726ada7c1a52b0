/* grad_sync.c - data-parallel gradient synchronisation per parameter group (grad_sync.h). */
#include "grad_sync.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

static struct am_tensor flat(const struct am_model *m, void *p, enum am_dtype dt, size_t n)
{
    return am_tensor_view(p, m->dev->device, dt, (int64_t)n, 0, 0, 0);
}

/* The buffers sharded gradients need (grad_sync.h), from the model's groups that take one
 * (none: none); s->direct set. */
static int buffers_needed(const struct am_gsync *s)
{
    const struct am_model *m = s->m;
    bool any = false, moe = false, tied = false;
    for (int g = 0; g < m->n_groups; g++) {
        if (s->direct[g])
            continue;
        any = true;
        moe |= m->groups[g].kind == AM_PG_EXPERTS;
        tied |= m->groups[g].tied;
    }
    return !any ? 0 : (moe ? 4 : m->embed && m->head == m->embed ? 3 : 2) + (tied ? 1 : 0);
}

static int init_shards(struct am_gsync *s, const struct am_gsync_shards *sh, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_kernels *K = m->K;
    size_t es = am_dtype_size(s->reduce);
    s->shard_g = sh->grads;
    s->n_shard = sh->n_shard;
    s->shard_dt = sh->dtype;
    if (s->shard_dt != AM_F32 && s->shard_dt != AM_BF16)
        return am_fail(err, err_len, "gradient shards in %s: they are fp32 or bf16", am_dtype_name(s->shard_dt));
    s->direct = calloc((size_t)m->n_groups + 1, sizeof(*s->direct));
    s->open = calloc((size_t)m->n_groups + 1, sizeof(*s->open));
    if (!s->direct || !s->open)
        return am_fail(err, err_len, "out of memory for %d parameter groups", m->n_groups);
    for (int g = 0; g < m->n_groups; g++) {
        struct am_pgroup *G = &m->groups[g];
        /* with expert parallelism the experts' shards span the replicas (their expert-data-parallel
         * group, AutoModel's ep_shard): no replica all-reduce for them */
        G->replicate = G->kind == AM_PG_EXPERTS && m->ep_comm ? NULL : sh->replicate;
        /* a shard group of one rank reduced in fp32: its shard is its whole span, where its
         * gradients accumulate (no buffer, no receive shard); not with bf16 shards and replicas,
         * whose every backward's sum is all-reduced over them before it is rounded */
        s->direct[g] = G->shard == AM_SHARD_SHARDED && s->reduce == AM_F32 && am_comm_size(G->comm) == 1 &&
                       !(s->shard_dt == AM_BF16 && G->replicate);
        if (s->direct[g] && s->shard_dt != AM_F32 && G->span > s->stage_elems)
            s->stage_elems = G->span; /* bf16 shards: its fp32 gradients staged */
        if (s->direct[g])
            continue;
        if (G->span > s->buf_elems)
            s->buf_elems = G->span;
        if (G->shard_elems > s->recv_elems)
            s->recv_elems = G->shard_elems;
    }
    s->n_bufs = buffers_needed(s);
    int n = s->n_bufs;
    s->buf_group = malloc(((size_t)n + 1) * sizeof(*s->buf_group));
    s->buf_sent = malloc(((size_t)n + 1) * sizeof(*s->buf_sent));
    s->buf_final = calloc((size_t)n + 1, sizeof(*s->buf_final));
    s->buf_seq = calloc((size_t)n + 1, sizeof(*s->buf_seq));
    s->buf_req = calloc((size_t)n + 1, sizeof(*s->buf_req));
    s->ones = malloc(((size_t)m->n_params + 1) * sizeof(*s->ones));
    if (!s->buf_group || !s->buf_sent || !s->buf_final || !s->buf_seq || !s->buf_req || !s->ones)
        return am_fail(err, err_len, "out of memory for %d gradient buffers", n);
    for (int b = 0; b < n; b++)
        s->buf_group[b] = s->buf_sent[b] = -1;
    for (int i = 0; i < m->n_params; i++)
        s->ones[i] = 1;
    s->finite = K->alloc(m->dev, ((size_t)m->n_params + 1) * sizeof(int32_t));
    if (!s->finite)
        return am_fail(err, err_len, "out of memory for the gradients' %d finite flags", m->n_params);
    if (n) { /* none when every group accumulates in its shard */
        s->buf_mem = K->alloc(m->dev, (size_t)n * s->buf_elems * sizeof(float));
        s->recv_mem = K->alloc(m->dev, (size_t)n * s->recv_elems * es);
        if (!s->buf_mem || !s->recv_mem)
            return am_fail(err, err_len, "out of memory for %d gradient buffers of %zu", n, s->buf_elems);
    }
    if (n && s->reduce != AM_F32 && !(s->buf_lp = K->alloc(m->dev, (size_t)n * s->buf_elems * es)))
        return am_fail(err, err_len, "out of memory for %d gradient buffers of %zu in the reduction's dtype", n,
                       s->buf_elems);
    if (s->reduce != AM_F32 && sh->replicate && s->shard_dt == AM_F32 &&
        !(s->shard_lp = K->alloc(m->dev, s->n_shard * es)))
        return am_fail(err, err_len, "out of memory for the %zu gradient shards in the reduction's dtype", s->n_shard);
    if (s->stage_elems && !(s->stage = K->alloc(m->dev, s->stage_elems * (sizeof(float) + am_dtype_size(s->shard_dt)))))
        return am_fail(err, err_len, "out of memory for the %zu fp32 gradients staged before their bf16 shard",
                       s->stage_elems);
    am_model_drop_grads(m);
    return 0;
}

int am_gsync_init(struct am_gsync *s, struct am_model *m, struct am_comm *dp, bool overlap, enum am_dtype reduce,
                  const struct am_gsync_shards *shards, char *err, size_t err_len)
{
    memset(s, 0, sizeof(*s));
    s->m = m;
    s->dp = dp;
    s->overlap = overlap;
    s->reduce = reduce;
    if (dp && reduce != AM_F32 && !shards && m->grad_elems &&
        !(s->lp_mem = m->K->alloc(m->dev, m->grad_elems * am_dtype_size(reduce))))
        return am_fail(err, err_len, "out of memory for the %zu gradients in the reduction's dtype", m->grad_elems);
    s->state = calloc((size_t)m->n_groups + 1, sizeof(*s->state));
    s->reqs = calloc((size_t)m->n_groups + 1, sizeof(*s->reqs));
    if (!s->state || !s->reqs)
        return am_fail(err, err_len, "out of memory for %d parameter groups", m->n_groups);
    for (int g = 0; g < m->n_groups; g++) /* replicated: dp, unless the caller chose another */
        if (m->groups[g].shard != AM_SHARD_SHARDED && !m->groups[g].comm)
            m->groups[g].comm = dp;
    return shards && dp ? init_shards(s, shards, err, err_len) : 0;
}

void am_gsync_free(struct am_gsync *s)
{
    void *dev_mem[] = {s->lp_mem, s->shard_lp, s->buf_mem, s->buf_lp, s->recv_mem, s->stage, s->finite};
    for (size_t i = 0; i < sizeof(dev_mem) / sizeof(dev_mem[0]); i++)
        if (dev_mem[i])
            s->m->K->free(s->m->dev, dev_mem[i]);
    free(s->state);
    free(s->reqs);
    free(s->buf_group);
    free(s->buf_sent);
    free(s->buf_final);
    free(s->buf_seq);
    free(s->buf_req);
    free(s->direct);
    free(s->open);
    free(s->ones);
    memset(s, 0, sizeof(*s));
}

size_t am_gsync_bytes(const struct am_gsync *s)
{
    size_t es = am_dtype_size(s->reduce);
    return (s->lp_mem ? s->m->grad_elems * es : 0) + (s->shard_lp ? s->n_shard * es : 0);
}

size_t am_gsync_buffer_bytes(const struct am_gsync *s)
{
    size_t es = am_dtype_size(s->reduce);
    size_t per = s->buf_elems * sizeof(float) + (s->buf_lp ? s->buf_elems * es : 0) + s->recv_elems * es;
    return (size_t)s->n_bufs * per + s->stage_elems * (sizeof(float) + am_dtype_size(s->shard_dt));
}

void am_gsync_begin_step(struct am_gsync *s)
{
    const struct am_model *m = s->m;
    s->wait_s = 0;
    if (!s->shard_g)
        return;
    struct am_tensor g = flat(m, s->shard_g, s->shard_dt, s->n_shard);
    m->K->zero(m->dev, &g);
    m->K->upload(m->dev, s->finite, s->ones, (size_t)m->n_params * sizeof(int32_t));
}

int am_gsync_first_nonfinite(struct am_gsync *s)
{
    const struct am_model *m = s->m;
    if (!s->shard_g)
        return -2;
    m->K->download(m->dev, s->ones, s->finite, (size_t)m->n_params * sizeof(int32_t));
    int first = -1;
    for (int i = 0; i < m->n_params; i++) {
        if (first < 0 && !s->ones[i])
            first = i;
        s->ones[i] = 1;
    }
    return first;
}

/* A group's progress through the step: its tp sums done, then its reduction. */
enum { PENDING, FINISHED, REDUCED };

/* ---- sharded gradients --------------------------------------------------------------- */

static float *buf_at(const struct am_gsync *s, int b) { return (float *)s->buf_mem + (size_t)b * s->buf_elems; }

/* Element i of the shard slab, in its dtype. */
static void *shard_at(const struct am_gsync *s, size_t i)
{
    return (char *)s->shard_g + i * am_dtype_size(s->shard_dt);
}

static void *recv_at(const struct am_gsync *s, int b)
{
    return (char *)s->recv_mem + (size_t)b * s->recv_elems * am_dtype_size(s->reduce);
}

/* Buffer b's reduce-scatter is complete: its shard added to the group's, and after the group's
 * last one of the step its shard all-reduced over the replicas (HSDP: started, or done when
 * blocking). The reduced shard takes the shards' dtype first, in the buffer (free now):
 * widened from a bf16 reduction into fp32 shards, or rounded from an fp32 one to bf16 shards
 * (FSDP2's cast of the reduce-scatter's output to the parameter's dtype, then its += in bf16:
 * the sum in fp32, rounded once). bf16 shards with HSDP: the reduced shard is all-reduced over
 * the replicas first, in reduce_dtype, every backward (FSDP2's all-reduce of the
 * reduce-scatter's output before that cast), done here: its sum is what is rounded and added. */
static int added(struct am_gsync *s, int b, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[s->buf_sent[b]];
    struct am_tensor sum = flat(m, recv_at(s, b), s->reduce, G->shard_elems);
    struct am_tensor dst = flat(m, shard_at(s, G->shard_offset), s->shard_dt, G->shard_elems);
    bool each = s->shard_dt != AM_F32 && G->replicate; /* over the replicas every backward */
    if (each && am_allreduce(G->replicate, sum.data, sum.data, G->shard_elems, s->reduce, AM_SUM, err, err_len) < 0) {
        s->buf_sent[b] = -1;
        return -1;
    }
    if (s->reduce != s->shard_dt) {
        struct am_tensor w = flat(m, buf_at(s, b), s->shard_dt, G->shard_elems);
        m->K->convert(m->dev, &w, &sum);
        sum = w;
    }
    m->K->add(m->dev, &dst, &sum);
    s->buf_sent[b] = -1;
    if (!s->buf_final[b] || !G->replicate || each)
        return 0;
    void *r = dst.data;
    if (s->shard_lp) {
        struct am_tensor lp = flat(m, (char *)s->shard_lp + G->shard_offset * am_dtype_size(s->reduce), s->reduce,
                                   G->shard_elems);
        m->K->convert(m->dev, &lp, &dst);
        r = lp.data;
    }
    return s->overlap ? am_iallreduce(G->replicate, r, r, G->shard_elems, s->reduce, AM_SUM, &s->reqs[s->n_reqs++],
                                      err, err_len)
                      : am_allreduce(G->replicate, r, r, G->shard_elems, s->reduce, AM_SUM, err, err_len);
}

/* The oldest buffer in a reduce-scatter, or -1. */
static int oldest_sent(const struct am_gsync *s)
{
    int best = -1;
    for (int b = 0; b < s->n_bufs; b++)
        if (s->buf_sent[b] >= 0 && (best < 0 || s->buf_seq[b] < s->buf_seq[best]))
            best = b;
    return best;
}

/* Completes the reduce-scatters in the order they were started, waiting for each, until at
 * most `keep` are still in flight. Where it is called depends on the schedule alone (never on
 * which request happens to be complete), so that the replicas' all-reduces it starts come in
 * the same order among every rank's other collectives (comm.h: one order across groups). */
static int progress(struct am_gsync *s, int keep, char *err, size_t err_len)
{
    int b, n = 0;
    for (int i = 0; i < s->n_bufs; i++)
        n += s->buf_sent[i] >= 0;
    for (; n > keep && (b = oldest_sent(s)) >= 0; n--) {
        double t0 = am_mono_time();
        int rc = am_comm_wait(s->buf_req[b], err, err_len);
        s->wait_s += am_mono_time() - t0;
        s->buf_req[b] = NULL;
        if (rc < 0) {
            s->buf_sent[b] = -1;
            return -1;
        }
        if (added(s, b, err, err_len) < 0)
            return -1;
    }
    return 0;
}

int am_gsync_use(struct am_gsync *s, int group, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[group];
    int b = -1;
    if (s->direct && s->direct[group]) { /* into its shard, its span whole; bf16 shards: the staging buffer */
        if (s->open[group])
            return 0; /* accumulating there already */
        float *base = s->stage ? s->stage : (float *)s->shard_g + G->shard_offset;
        if (s->stage) {
            for (int g = 0; g < m->n_groups; g++)
                if (s->open[g] && s->direct[g])
                    return am_fail(err, err_len, "gradient shards: %s's backward began while %s's holds the staging "
                                   "buffer", G->name, m->groups[g].name);
            struct am_tensor z = flat(m, base, AM_F32, G->span);
            m->K->zero(m->dev, &z);
        }
        for (int i = G->first; i < G->first + G->n; i++)
            m->params[i].g.data = base + (m->params[i].slab_off - G->offset);
        s->open[group] = true;
        return 0;
    }
    for (int i = 0; i < s->n_bufs; i++)
        if (s->buf_group[i] == group)
            return 0; /* accumulating there already (the embedding the head shares, a tied copy) */
    while (b < 0) { /* a free buffer, else the oldest in a reduce-scatter once it completes */
        int sent = 0;
        for (int i = 0; i < s->n_bufs && b < 0; i++) {
            if (s->buf_group[i] < 0 && s->buf_sent[i] < 0)
                b = i;
            sent += s->buf_sent[i] >= 0;
        }
        if (b >= 0)
            break;
        if (!sent)
            return am_fail(err, err_len, "gradient buffers: all %d hold groups still in their backward, none for %s",
                           s->n_bufs, G->name);
        if (progress(s, sent - 1, err, err_len) < 0)
            return -1;
    }
    s->buf_group[b] = group;
    struct am_tensor z = flat(m, buf_at(s, b), AM_F32, G->span);
    m->K->zero(m->dev, &z);
    for (int i = G->first; i < G->first + G->n; i++)
        m->params[i].g.data = buf_at(s, b) + (m->params[i].slab_off - G->offset);
    return 0;
}

/* A group that accumulates in its shard (its shard group is this rank alone) ended a backward:
 * after the step's last, its sum checked and into local_sumsq (a gradient that was not finite
 * in a micro-batch is not in their sum: an infinity or a NaN stays one through additions), and
 * with HSDP its shard all-reduced over the replicas (started, or done when blocking). With bf16
 * shards the pass's fp32 gradients in the staging buffer are checked and into local_sumsq
 * (which only tells whether this rank's gradients were finite), rounded to bf16 and added to
 * the shard, as FSDP2 adds a one-rank reduce-scatter's output cast to the parameter's dtype. */
static int end_direct(struct am_gsync *s, int group, bool final, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[group];
    if (!s->open[group])
        return am_fail(err, err_len, "gradient shards: group %s ended a backward it did not start", G->name);
    s->open[group] = false;
    struct am_tensor flag = am_tensor_view(s->finite, m->dev->device, AM_I32, 1, 0, 0, 0);
    for (int i = G->first; i < G->first + G->n; i++) {
        flag.data = (int32_t *)s->finite + i;
        if (final || s->stage)
            m->K->all_finite(m->dev, &flag, &m->params[i].g);
        m->params[i].g.data = NULL;
    }
    if (s->stage) {
        struct am_tensor g = flat(m, s->stage, AM_F32, G->shard_elems), sq = flat(m, s->stage, AM_F32, G->n_elems);
        struct am_tensor lp = flat(m, (float *)s->stage + s->stage_elems, s->shard_dt, G->shard_elems);
        struct am_tensor dst = flat(m, shard_at(s, G->shard_offset), s->shard_dt, G->shard_elems);
        m->K->sum_squares(m->dev, &m->scalars.local_sumsq, &sq, 1.0);
        m->K->convert(m->dev, &lp, &g);
        m->K->add(m->dev, &dst, &lp);
        return 0; /* no replicas: such a group with replicas takes a buffer (init_shards) */
    }
    if (!final)
        return 0;
    struct am_tensor dst = flat(m, (float *)s->shard_g + G->shard_offset, AM_F32, G->shard_elems);
    struct am_tensor sq = flat(m, dst.data, AM_F32, G->n_elems);
    m->K->sum_squares(m->dev, &m->scalars.local_sumsq, &sq, 1.0);
    if (!G->replicate)
        return 0;
    return s->overlap ? am_iallreduce(G->replicate, dst.data, dst.data, G->shard_elems, AM_F32, AM_SUM,
                                      &s->reqs[s->n_reqs++], err, err_len)
                      : am_allreduce(G->replicate, dst.data, dst.data, G->shard_elems, AM_F32, AM_SUM, err, err_len);
}

/* The group's backward ended (or, a tied copy, the step's): its buffer's gradients checked,
 * into local_sumsq, and reduce-scattered (started, or done and added when blocking). */
static int send_group(struct am_gsync *s, int group, bool final, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[group];
    int b = -1;
    if (s->direct && s->direct[group])
        return end_direct(s, group, final, err, err_len);
    for (int i = 0; i < s->n_bufs; i++)
        if (s->buf_group[i] == group)
            b = i;
    if (b < 0)
        return am_fail(err, err_len, "gradient buffers: group %s ended a backward it did not start", G->name);
    struct am_tensor flag = am_tensor_view(s->finite, m->dev->device, AM_I32, 1, 0, 0, 0);
    for (int i = G->first; i < G->first + G->n; i++) {
        flag.data = (int32_t *)s->finite + i;
        m->K->all_finite(m->dev, &flag, &m->params[i].g);
        m->params[i].g.data = NULL;
    }
    struct am_tensor g = flat(m, buf_at(s, b), AM_F32, G->span);
    struct am_tensor sq = flat(m, buf_at(s, b), AM_F32, G->n_elems);
    m->K->sum_squares(m->dev, &m->scalars.local_sumsq, &sq, 1.0);
    void *send = g.data;
    if (s->buf_lp) {
        struct am_tensor lp = flat(m, (char *)s->buf_lp + (size_t)b * s->buf_elems * am_dtype_size(s->reduce),
                                   s->reduce, G->span);
        m->K->convert(m->dev, &lp, &g);
        send = lp.data;
    }
    s->buf_group[b] = -1;
    s->buf_sent[b] = group;
    s->buf_final[b] = final;
    s->buf_seq[b] = ++s->seq;
    if (s->overlap)
        return am_ireduce_scatter(G->comm, send, recv_at(s, b), G->shard_elems, s->reduce, AM_SUM, &s->buf_req[b],
                                  err, err_len);
    if (am_reduce_scatter(G->comm, send, recv_at(s, b), G->shard_elems, s->reduce, AM_SUM, err, err_len) < 0) {
        s->buf_sent[b] = -1;
        return -1;
    }
    return added(s, b, err, err_len);
}

/* ---- replicated gradients ------------------------------------------------------------ */

/* The group's gradients into local_sumsq, then all-reduced over G->comm (dp, or for experts
 * the expert-data-parallel group: nothing to sum when that is this rank alone): started
 * (overlapped, waited for in am_gsync_finish) or done (blocking). */
static int reduce(struct am_gsync *s, int group, bool start, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[group];
    s->state[group] = REDUCED;
    if (!s->dp || G->frozen) /* LoRA's frozen base: no gradients */
        return 0;
    struct am_tensor g = flat(m, (float *)m->grad_mem + (G->offset - m->grad_off), AM_F32, G->n_elems);
    m->K->sum_squares(m->dev, &m->scalars.local_sumsq, &g, 1.0);
    if (!G->comm || am_comm_size(G->comm) == 1)
        return 0; /* experts whose expert-data-parallel group is this rank alone */
    struct am_tensor r = g; /* what is reduced: the gradients, or their copy in reduce_dtype */
    if (s->lp_mem) {
        r = flat(m, (char *)s->lp_mem + (G->offset - m->grad_off) * am_dtype_size(s->reduce), s->reduce, G->n_elems);
        m->K->convert(m->dev, &r, &g);
    }
    return start ? am_iallreduce(G->comm, r.data, r.data, G->n_elems, s->reduce, AM_SUM, &s->reqs[s->n_reqs++], err,
                                 err_len)
                 : am_allreduce(G->comm, r.data, r.data, G->n_elems, s->reduce, AM_SUM, err, err_len);
}

int am_gsync_group(struct am_gsync *s, int group, char *err, size_t err_len)
{
    const struct am_pgroup *G = &s->m->groups[group];
    if (am_model_group_finish(s->m, group, err, err_len) < 0)
        return -1;
    s->state[group] = FINISHED;
    switch (G->shard) {
    case AM_SHARD_SHARDED: /* HSDP: the previous groups' all-reduces started as this one's reduce-scatter is */
        return send_group(s, group, s->m->grads_final, err, err_len) < 0 ||
                       (G->replicate && progress(s, 1, err, err_len) < 0)
                   ? -1
                   : 0;
    case AM_SHARD_REPLICATED: /* all-reduced over G->comm: dp, or the experts' expert-data-parallel group */
    case AM_SHARD_EXPERT:
        break;
    }
    return s->overlap ? reduce(s, group, true, err, err_len) : 0;
}

int am_gsync_finish(struct am_gsync *s, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    double t0 = am_mono_time();
    int rc = am_model_finish_tied(m, err, err_len);
    for (int g = 0; g < m->n_groups && rc == 0; g++) {
        if (m->groups[g].shard == AM_SHARD_SHARDED) { /* a tied copy, held for the step */
            bool held = s->open && s->open[g];
            for (int b = 0; b < s->n_bufs; b++)
                held |= s->buf_group[b] == g;
            if (held && (am_model_group_finish(m, g, err, err_len) < 0 || send_group(s, g, true, err, err_len) < 0))
                rc = -1;
        } else if (s->state[g] == PENDING && am_model_group_finish(m, g, err, err_len) < 0) {
            rc = -1;
        } else if (s->state[g] != REDUCED) {
            rc = reduce(s, g, false, err, err_len);
        }
    }
    if (rc == 0 && s->shard_g)
        rc = progress(s, 0, err, err_len);
    /* the requests started in the backward, oldest first (a failed one names itself); after
     * an earlier failure they are only released, its message kept */
    if (am_comm_wait_all(s->reqs, s->n_reqs, rc == 0 ? err : NULL, rc == 0 ? err_len : 0) < 0)
        rc = -1;
    for (int b = 0; s->shard_g && b < s->n_bufs; b++) { /* after a failure: forgotten */
        if (s->buf_req[b])
            am_comm_wait_all(&s->buf_req[b], 1, NULL, 0);
        s->buf_req[b] = NULL;
        s->buf_group[b] = s->buf_sent[b] = -1;
    }
    for (int g = 0; s->open && g < m->n_groups; g++) /* after a failure: forgotten */
        s->open[g] = false;
    s->n_reqs = 0;
    if (s->shard_lp && rc == 0) { /* HSDP in reduce_dtype: the replicas' sums back into the fp32 shards */
        struct am_tensor g = flat(m, s->shard_g, AM_F32, s->n_shard), r = flat(m, s->shard_lp, s->reduce, s->n_shard);
        m->K->convert(m->dev, &g, &r);
    } else if (s->lp_mem && rc == 0) { /* the sums back into the fp32 gradients, of the groups reduced (not of
                                         * experts, or LoRA's adapters on them, whose expert-data-parallel
                                         * group is this rank alone: their copy was never made, reduce) */
        size_t es = am_dtype_size(s->reduce);
        for (int g = 0; g < m->n_groups; g++) {
            const struct am_pgroup *G = &m->groups[g];
            if (G->frozen || !G->comm || am_comm_size(G->comm) == 1)
                continue;
            struct am_tensor gf = flat(m, (float *)m->grad_mem + (G->offset - m->grad_off), AM_F32, G->n_elems),
                             r = flat(m, (char *)s->lp_mem + (G->offset - m->grad_off) * es, s->reduce, G->n_elems);
            m->K->convert(m->dev, &gf, &r);
        }
    }
    memset(s->state, 0, (size_t)m->n_groups * sizeof(*s->state));
    s->wait_s += am_mono_time() - t0;
    return rc;
}
