/* grad_sync.c - data-parallel gradient synchronisation per parameter group (grad_sync.h). */
#include "grad_sync.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

int am_gsync_init(struct am_gsync *s, struct am_model *m, struct am_comm *dp, bool overlap, enum am_dtype reduce,
                  char *err, size_t err_len)
{
    memset(s, 0, sizeof(*s));
    s->m = m;
    s->dp = dp;
    s->overlap = overlap;
    s->reduce = reduce;
    if (dp && reduce != AM_F32 && !(s->lp_mem = m->K->alloc(m->dev, m->slab_elems * am_dtype_size(reduce))))
        return am_fail(err, err_len, "out of memory for the %zu gradients in the reduction's dtype", m->slab_elems);
    s->state = calloc((size_t)m->n_groups + 1, sizeof(*s->state));
    s->reqs = calloc((size_t)m->n_groups + 1, sizeof(*s->reqs));
    if (!s->state || !s->reqs)
        return am_fail(err, err_len, "out of memory for %d parameter groups", m->n_groups);
    for (int g = 0; g < m->n_groups; g++)
        m->groups[g].comm = dp;
    m->grad_ready = am_gsync_group;
    m->grad_ready_arg = s;
    return 0;
}

int am_gsync_set_shards(struct am_gsync *s, void *shard_grads, size_t n_shard, struct am_comm *shard,
                        struct am_comm *replicate, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    s->shard_g = shard_grads;
    s->n_shard = n_shard;
    s->shard = shard;
    s->replicate = replicate;
    if (s->reduce != AM_F32 && !(s->shard_lp = m->K->alloc(m->dev, n_shard * am_dtype_size(s->reduce))))
        return am_fail(err, err_len, "out of memory for the %zu gradient shards in the reduction's dtype", n_shard);
    return 0;
}

void am_gsync_free(struct am_gsync *s)
{
    if (s->lp_mem)
        s->m->K->free(s->m->dev, s->lp_mem);
    if (s->shard_lp)
        s->m->K->free(s->m->dev, s->shard_lp);
    free(s->state);
    free(s->reqs);
    memset(s, 0, sizeof(*s));
}

/* A group's progress through the step: its tp sums done, then its reduction. */
enum { PENDING, FINISHED, REDUCED };

/* The group's gradients into local_sumsq, then reduced: started (overlapped, waited for in
 * am_gsync_finish) or done (blocking). A sharded group is reduce-scattered (its padded span,
 * the padding zeros) into its shard of the shard slab over its shard group (G->shard_comm:
 * dp_shard, or for experts the expert-data-parallel group); a replicated one all-reduced over
 * G->comm (dp, or for experts the expert-data-parallel group, NULL when that is this rank
 * alone). */
static int reduce(struct am_gsync *s, int group, bool start, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    const struct am_pgroup *G = &m->groups[group];
    struct am_tensor g = am_tensor_view((float *)m->grad_mem + G->offset, m->dev->device, AM_F32,
                                        (int64_t)G->n_elems, 0, 0, 0);
    s->state[group] = REDUCED;
    if (!s->dp)
        return 0;
    m->K->sum_squares(m->dev, &m->scalars.local_sumsq, &g, 1.0);
    bool sharded = G->shard == AM_SHARD_SHARDED && s->shard_g;
    if (!sharded && !G->comm)
        return 0; /* experts whose expert-data-parallel group is this rank alone */
    size_t n = sharded ? G->span : G->n_elems, es = am_dtype_size(s->reduce);
    struct am_tensor r = g; /* what is reduced: the gradients, or their copy in reduce_dtype */
    if (s->lp_mem) {
        struct am_tensor gs = am_tensor_view(g.data, m->dev->device, AM_F32, (int64_t)n, 0, 0, 0);
        r = am_tensor_view((char *)s->lp_mem + G->offset * es, m->dev->device, s->reduce, (int64_t)n, 0, 0, 0);
        m->K->convert(m->dev, &r, &gs);
    }
    if (sharded) {
        void *shard = (char *)(s->shard_lp ? s->shard_lp : s->shard_g) + G->shard_offset * es;
        struct am_comm *over = G->shard_comm ? G->shard_comm : s->shard;
        return start ? am_ireduce_scatter(over, r.data, shard, G->shard_elems, s->reduce, AM_SUM,
                                          &s->reqs[s->n_reqs++], err, err_len)
                     : am_reduce_scatter(over, r.data, shard, G->shard_elems, s->reduce, AM_SUM, err, err_len);
    }
    return start ? am_iallreduce(G->comm, r.data, r.data, G->n_elems, s->reduce, AM_SUM, &s->reqs[s->n_reqs++], err,
                                 err_len)
                 : am_allreduce(G->comm, r.data, r.data, G->n_elems, s->reduce, AM_SUM, err, err_len);
}

int am_gsync_group(void *arg, int group, char *err, size_t err_len)
{
    struct am_gsync *s = arg;
    if (am_model_group_finish(s->m, group, err, err_len) < 0)
        return -1;
    s->state[group] = FINISHED;
    return s->overlap ? reduce(s, group, true, err, err_len) : 0;
}

int am_gsync_finish(struct am_gsync *s, char *err, size_t err_len)
{
    struct am_model *m = s->m;
    double t0 = am_mono_time();
    int rc = am_model_finish_tied(m, err, err_len);
    for (int g = 0; g < m->n_groups && rc == 0; g++) {
        if (s->state[g] == PENDING && am_model_group_finish(m, g, err, err_len) < 0)
            rc = -1;
        else if (s->state[g] != REDUCED)
            rc = reduce(s, g, false, err, err_len);
    }
    /* the requests started in the backward, oldest first (a failed one names itself); after
     * an earlier failure they are only released, its message kept */
    if (am_comm_wait_all(s->reqs, s->n_reqs, rc == 0 ? err : NULL, rc == 0 ? err_len : 0) < 0)
        rc = -1;
    s->n_reqs = 0;
    if (rc == 0 && s->shard_g && s->replicate) { /* HSDP: the shards summed over the replicas */
        void *sh = s->shard_lp ? s->shard_lp : s->shard_g;
        rc = am_allreduce(s->replicate, sh, sh, s->n_shard, s->reduce, AM_SUM, err, err_len);
    }
    if (s->lp_mem && rc == 0 && s->shard_g) { /* the sums back into the fp32 gradient shards */
        struct am_tensor g = am_tensor_view(s->shard_g, m->dev->device, AM_F32, (int64_t)s->n_shard, 0, 0, 0);
        struct am_tensor r = am_tensor_view(s->shard_lp, m->dev->device, s->reduce, (int64_t)s->n_shard, 0, 0, 0);
        m->K->convert(m->dev, &g, &r);
    } else if (s->lp_mem && rc == 0) { /* the sums back into the fp32 gradients */
        struct am_tensor g = am_tensor_view(m->grad_mem, m->dev->device, AM_F32, (int64_t)m->n_elems, 0, 0, 0);
        struct am_tensor r = am_tensor_view(s->lp_mem, m->dev->device, s->reduce, (int64_t)m->n_elems, 0, 0, 0);
        m->K->convert(m->dev, &g, &r);
    }
    memset(s->state, 0, (size_t)m->n_groups * sizeof(*s->state));
    s->wait_s = am_mono_time() - t0;
    return rc;
}
