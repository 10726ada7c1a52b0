/* dp.c - data parallelism, replicated or sharded, behind one interface (dp.h). */
#include "dp.h"

#include "util.h"

/* One way of holding the state: the operations that differ (NULL: nothing to do). */
struct am_dp_ops {
    bool sharded;
    int (*group_align)(const struct am_dp *d);
    int (*init)(struct am_dp *d, char *err, size_t err_len);
    int (*group_use)(struct am_dp *d, int group, bool backward, char *err, size_t err_len);
    int (*grad_use)(struct am_dp *d, int group, char *err, size_t err_len);
    bool (*grads_each_pass)(const struct am_dp *d);
    void (*begin_step)(struct am_dp *d);
    int (*end_backward)(struct am_dp *d, char *err, size_t err_len);
    int (*grad_sumsq)(struct am_dp *d, char *err, size_t err_len);
    int (*update)(struct am_dp *d, float lr, char *err, size_t err_len);
    void (*bytes)(const struct am_dp *d, struct am_dp_bytes *b);
    void (*record)(const struct am_dp *d, json_t *rec);
    void (*state)(struct am_dp *d, struct am_train_state *st);
    int (*restored)(struct am_dp *d, char *err, size_t err_len);
    int (*gather_weights)(struct am_dp *d, void **slab, char *err, size_t err_len);
    void (*release_weights)(struct am_dp *d, void *slab);
};

/* AdamW's moments for the n elements this rank steps. */
static int optim_init(struct am_dp *d, size_t n, char *err, size_t err_len)
{
    if (am_optim_init(&d->optim, d->c.dev, n, d->m->store_dt, d->c.r) < 0)
        return am_fail(err, err_len, "out of memory for the optimizer state of %zu parameters", n);
    return 0;
}

/* ---- replicated: every rank holds the whole state ---------------------------------------- */

static int rep_group_align(const struct am_dp *d)
{
    (void)d;
    return 0;
}

static int rep_init(struct am_dp *d, char *err, size_t err_len)
{
    const struct am_dp_config *c = &d->c;
    if (optim_init(d, d->m->grad_elems, err, err_len) < 0) /* LoRA: the adapters' alone */
        return -1;
    return am_gsync_init(&d->sync, d->m, c->grad_comm, c->overlap, c->reduce, NULL, err, err_len);
}

static int rep_grad_sumsq(struct am_dp *d, char *err, size_t err_len)
{
    return am_model_grad_sumsq(d->m, err, err_len);
}

/* The masters of what the gradient slab spans: every parameter's, or LoRA's adapters'
 * (param_mem holds them from param_off: model.h). */
static void *trained_masters(const struct am_model *m)
{
    return (char *)m->param_mem + (m->grad_off - m->param_off) * am_dtype_size(m->store_dt);
}

/* every parameter, or with LoRA the adapters alone (the gradient slab's span) */
static int rep_update(struct am_dp *d, float lr, char *err, size_t err_len)
{
    struct am_model *m = d->m;
    (void)err;
    (void)err_len;
    am_optim_step(&d->optim, trained_masters(m), m->grad_mem, AM_F32, am_model_sumsq(m), d->c.r->optim.max_grad_norm,
                  lr);
    return 0;
}

static void rep_bytes(const struct am_dp *d, struct am_dp_bytes *b)
{
    const struct am_model *m = d->m;
    size_t n = m->n_elems, lp = m->param_lp_mem ? am_dtype_size(m->act_dt) : 0;
    size_t glp = d->sync.lp_mem ? am_dtype_size(d->sync.reduce) : 0;
    /* the gradients and the optimizer's moments: every parameter's, or with LoRA the adapters' */
    b->weights = n * (am_dtype_size(m->store_dt) + lp);
    b->grads = m->grad_elems * (sizeof(float) + glp);
    b->optimizer = am_optim_bytes(&d->optim);
    b->gathered = 0;
}

static void rep_state(struct am_dp *d, struct am_train_state *st)
{
    struct am_model *m = d->m;
    st->m = m;
    st->fsdp = NULL;
    st->optim = &d->optim;
    /* the slab's [grad_off, +grad_elems): all of it, or LoRA's adapters */
    st->master = trained_masters(m);
    st->n = m->grad_elems;
    st->base = m->grad_off;
    /* every data-parallel and context-parallel rank but the first holds a copy; but LoRA's
     * adapters on the experts under ep (moe.h) differ between the ep ranks: the first holder of
     * each rank's (its expert-data-parallel rank 0) writes them, and only them (resume.c) */
    bool first = am_comm_rank(d->c.dp) == 0 && !(d->c.cp && am_comm_rank(d->c.cp) != 0);
    struct am_comm *edp = NULL;
    for (int g = 0; m->ep_comm && g < m->n_groups; g++)
        if (m->groups[g].kind == AM_PG_LORA && m->groups[g].shard == AM_SHARD_EXPERT)
            edp = m->groups[g].comm;
    st->experts_only = !first && edp && am_comm_rank(edp) == 0;
    st->writes = first || st->experts_only;
}

static const struct am_dp_ops replicated = {
    .sharded = false,
    .group_align = rep_group_align,
    .init = rep_init,
    .grad_sumsq = rep_grad_sumsq,
    .update = rep_update,
    .bytes = rep_bytes,
    .state = rep_state,
};

/* ---- sharded: each rank steps its shard of every group (fsdp.h) --------------------------- */

/* the groups padded to a multiple of the shard group's size */
static int sh_group_align(const struct am_dp *d) { return am_comm_size(d->c.shard); }

/* The gradient shards' dtype, the recipe's (grad_shard_dtype: FSDP2 keeps a bf16 parameter's
 * sharded gradient in bf16, also with FusedAdam's fp32 masters; megatron_fsdp fp32 main
 * gradients), from ZeRO stage 2, where the shards are the reduced gradients. */
static enum am_dtype sh_grad_dtype(const struct am_dp *d)
{
    return d->c.zero >= 2 ? d->c.r->grad_shard_dtype : AM_F32;
}

static int sh_init(struct am_dp *d, char *err, size_t err_len)
{
    const struct am_dp_config *c = &d->c;
    struct am_fsdp *f = &d->fsdp;
    if (am_fsdp_init(f, d->m, c->shard, c->zero, c->reshard_after_forward, sh_grad_dtype(d), err, err_len) < 0 ||
        optim_init(d, f->n_shard, err, err_len) < 0)
        return -1;
    /* from ZeRO stage 2 the gradients are sharded too: per-group buffers reduce-scattered into
     * the shards (grad_sync.h) */
    struct am_gsync_shards shards = {f->grads, f->n_shard, f->grad_dt, c->replicate};
    return am_gsync_init(&d->sync, d->m, c->grad_comm, c->overlap, c->reduce, c->zero >= 2 ? &shards : NULL, err,
                         err_len);
}

static int sh_group_use(struct am_dp *d, int group, bool backward, char *err, size_t err_len)
{
    return d->c.zero >= 3 ? am_fsdp_use(&d->fsdp, group, backward, err, err_len) : 0;
}

static int sh_grad_use(struct am_dp *d, int group, char *err, size_t err_len)
{
    return d->c.zero >= 2 ? am_gsync_use(&d->sync, group, err, err_len) : 0;
}

static bool sh_grads_each_pass(const struct am_dp *d) { return d->c.zero >= 2; }

static void sh_begin_step(struct am_dp *d) { am_fsdp_begin_step(&d->fsdp); }

static int sh_end_backward(struct am_dp *d, char *err, size_t err_len)
{
    if (am_fsdp_end_step(&d->fsdp, err, err_len) < 0)
        return -1;
    if (d->c.zero == 1)
        am_fsdp_take_grads(&d->fsdp);
    return 0;
}

/* HSDP's replicas whose experts' shards differ (expert parallelism with HSDP: the experts are
 * sharded over their expert-data-parallel group, across the replicas), else NULL */
static struct am_comm *expert_replicas(const struct am_dp *d)
{
    return d->c.zero >= 2 && d->m->ep_comm ? d->c.replicate : NULL;
}

static int sh_grad_sumsq(struct am_dp *d, char *err, size_t err_len)
{
    return am_model_grad_sumsq_shards(d->m, d->fsdp.grads, d->fsdp.grad_dt, d->fsdp.rank, d->c.shard,
                                      expert_replicas(d), err, err_len);
}

/* the shards alone; below stage 3 then gathered into the model */
static int sh_update(struct am_dp *d, float lr, char *err, size_t err_len)
{
    am_optim_step(&d->optim, d->fsdp.master, d->fsdp.grads, d->fsdp.grad_dt, am_model_sumsq(d->m),
                  d->c.r->optim.max_grad_norm, lr);
    return d->c.zero < 3 ? am_fsdp_publish(&d->fsdp, err, err_len) : 0;
}

/* stage 1 the full-size gradients (and their reduce_dtype copy), from stage 2 the per-group
 * buffers instead (grad_sync.h) */
static void sh_bytes(const struct am_dp *d, struct am_dp_bytes *b)
{
    size_t S = d->fsdp.n_shard, slab = d->m->slab_elems;
    b->weights = am_fsdp_weight_bytes(&d->fsdp);
    b->grads = (d->c.zero >= 2 ? 0 : slab * sizeof(float)) + am_gsync_bytes(&d->sync) +
               S * am_dtype_size(d->fsdp.grad_dt);
    b->optimizer = am_optim_bytes(&d->optim);
    b->gathered = am_fsdp_gathered_bytes(&d->fsdp);
}

static void sh_record(const struct am_dp *d, json_t *rec)
{
    json_object_set_new(rec, "gather_wait_s", json_real(d->fsdp.gather_wait_s));
}

static void sh_state(struct am_dp *d, struct am_train_state *st)
{
    st->m = d->m;
    st->fsdp = &d->fsdp;
    st->optim = &d->optim;
    st->master = d->fsdp.master;
    st->n = d->fsdp.n_shard;
    st->base = 0;
    /* HSDP's replicas hold copies of the first one's shards (but of the experts' with expert
     * parallelism: those a replica writes, resume.c) */
    st->writes = !d->c.replicate || am_comm_rank(d->c.replicate) == 0 || expert_replicas(d);
}

static int sh_restored(struct am_dp *d, char *err, size_t err_len)
{
    return d->c.zero < 3 ? am_fsdp_publish(&d->fsdp, err, err_len) : 0;
}

static int sh_gather_weights(struct am_dp *d, void **slab, char *err, size_t err_len)
{
    return d->c.zero >= 3 ? am_fsdp_gather_masters(&d->fsdp, slab, err, err_len) : 0;
}

static void sh_release_weights(struct am_dp *d, void *slab)
{
    if (d->c.zero >= 3)
        am_fsdp_release_masters(&d->fsdp, slab);
}

static const struct am_dp_ops sharded = {
    .sharded = true,
    .group_align = sh_group_align,
    .init = sh_init,
    .group_use = sh_group_use,
    .grad_use = sh_grad_use,
    .grads_each_pass = sh_grads_each_pass,
    .begin_step = sh_begin_step,
    .end_backward = sh_end_backward,
    .grad_sumsq = sh_grad_sumsq,
    .update = sh_update,
    .bytes = sh_bytes,
    .record = sh_record,
    .state = sh_state,
    .restored = sh_restored,
    .gather_weights = sh_gather_weights,
    .release_weights = sh_release_weights,
};

/* ---- LoRA's frozen base sharded, its adapters replicated ---------------------------------- */

/* The base's groups sharded as stage 3 shards them (fsdp.h: weights only, gathered before use);
 * the adapters whole, their gradients all-reduced and stepped as the replicated table's. */
static int lora_init(struct am_dp *d, char *err, size_t err_len)
{
    const struct am_dp_config *c = &d->c;
    if (am_fsdp_init(&d->fsdp, d->m, c->shard, 3, c->reshard_after_forward, AM_F32, err, err_len) < 0)
        return -1;
    return rep_init(d, err, err_len);
}

static int lora_group_use(struct am_dp *d, int group, bool backward, char *err, size_t err_len)
{
    return am_fsdp_use(&d->fsdp, group, backward, err, err_len);
}

static int lora_end_backward(struct am_dp *d, char *err, size_t err_len)
{
    return am_fsdp_end_step(&d->fsdp, err, err_len);
}

/* the base's shards (and their compute copy) and gathered groups, the adapters' as replicated */
static void lora_bytes(const struct am_dp *d, struct am_dp_bytes *b)
{
    const struct am_model *m = d->m;
    size_t lp = m->param_lp_mem ? am_dtype_size(m->act_dt) : 0;
    size_t glp = d->sync.lp_mem ? am_dtype_size(d->sync.reduce) : 0;
    b->weights = am_fsdp_weight_bytes(&d->fsdp) + m->grad_elems * (am_dtype_size(m->store_dt) + lp);
    b->grads = m->grad_elems * (sizeof(float) + glp);
    b->optimizer = am_optim_bytes(&d->optim);
    b->gathered = am_fsdp_gathered_bytes(&d->fsdp);
}

static const struct am_dp_ops lora_sharded = {
    .sharded = true,
    .group_align = sh_group_align,
    .init = lora_init,
    .group_use = lora_group_use,
    .begin_step = sh_begin_step,
    .end_backward = lora_end_backward,
    .grad_sumsq = rep_grad_sumsq,
    .update = rep_update,
    .bytes = lora_bytes,
    .record = sh_record,
    .state = rep_state,
};

/* ---- the interface ------------------------------------------------------------------------ */

void am_dp_choose(struct am_dp *d, const struct am_dp_config *c)
{
    d->c = *c;
    d->ops = c->zero >= 3 && c->lora ? &lora_sharded : c->zero >= 1 ? &sharded : &replicated;
}

int am_dp_group_align(const struct am_dp *d) { return d->ops->group_align(d); }

int am_dp_init(struct am_dp *d, struct am_model *m, char *err, size_t err_len)
{
    d->m = m;
    return d->ops->init(d, err, err_len);
}

void am_dp_free(struct am_dp *d)
{
    am_gsync_free(&d->sync);
    am_fsdp_free(&d->fsdp);
    am_optim_free(&d->optim);
}

int am_dp_group_use(struct am_dp *d, int group, bool backward, char *err, size_t err_len)
{
    return d->ops->group_use ? d->ops->group_use(d, group, backward, err, err_len) : 0;
}

int am_dp_grad_use(struct am_dp *d, int group, char *err, size_t err_len)
{
    return d->ops->grad_use ? d->ops->grad_use(d, group, err, err_len) : 0;
}

int am_dp_grad_ready(struct am_dp *d, int group, char *err, size_t err_len)
{
    return am_gsync_group(&d->sync, group, err, err_len);
}

bool am_dp_grads_each_pass(const struct am_dp *d) { return d->ops->grads_each_pass && d->ops->grads_each_pass(d); }

void am_dp_begin_step(struct am_dp *d)
{
    am_gsync_begin_step(&d->sync);
    if (d->ops->begin_step)
        d->ops->begin_step(d);
}

int am_dp_end_backward(struct am_dp *d, char *err, size_t err_len)
{
    if (am_gsync_finish(&d->sync, err, err_len) < 0)
        return -1;
    return d->ops->end_backward ? d->ops->end_backward(d, err, err_len) : 0;
}

int am_dp_grad_sumsq(struct am_dp *d, char *err, size_t err_len) { return d->ops->grad_sumsq(d, err, err_len); }

int am_dp_update(struct am_dp *d, float lr, char *err, size_t err_len) { return d->ops->update(d, lr, err, err_len); }

void am_dp_bytes(const struct am_dp *d, struct am_dp_bytes *b)
{
    d->ops->bytes(d, b);
    b->grad_buffers = am_gsync_buffer_bytes(&d->sync);
}

bool am_dp_sharded(const struct am_dp *d) { return d->ops->sharded; }

void am_dp_record(const struct am_dp *d, json_t *rec)
{
    if (d->ops->record)
        d->ops->record(d, rec);
}

void am_dp_state(struct am_dp *d, struct am_train_state *st) { d->ops->state(d, st); }

int am_dp_restored(struct am_dp *d, char *err, size_t err_len)
{
    return d->ops->restored ? d->ops->restored(d, err, err_len) : 0;
}

int am_dp_gather_weights(struct am_dp *d, void **slab, char *err, size_t err_len)
{
    *slab = NULL;
    return d->ops->gather_weights ? d->ops->gather_weights(d, slab, err, err_len) : 0;
}

void am_dp_release_weights(struct am_dp *d, void *slab)
{
    if (d->ops->release_weights)
        d->ops->release_weights(d, slab);
}
