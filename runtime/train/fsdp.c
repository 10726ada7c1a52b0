/* fsdp.c - fully sharded data parallelism over the shard group (fsdp.h). */
#include "fsdp.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

static struct am_tensor flat(void *p, const struct am_model *m, enum am_dtype dt, size_t n)
{
    return am_tensor_view(p, m->dev->device, dt, (int64_t)n, 0, 0, 0);
}

/* Where parameter p starts in the model's slabs, in elements. */
static size_t param_offset(const struct am_model *m, const struct am_param *p)
{
    (void)m;
    return p->slab_off;
}

int am_fsdp_init(struct am_fsdp *f, struct am_model *m, struct am_comm *comm, int stage, bool reshard_after_forward,
                 enum am_dtype grad_dt, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    memset(f, 0, sizeof(*f));
    f->m = m;
    f->stage = stage;
    f->grad_dt = grad_dt;
    f->comm = comm;
    f->rank = am_comm_rank(comm);
    f->size = am_comm_size(comm);
    size_t max_span = 0;
    for (int g = 0; g < m->n_groups; g++) {
        struct am_pgroup *G = &m->groups[g];
        if (G->kind == AM_PG_LORA) /* LoRA's adapters: whole on every rank, in the model's slabs */
            continue;
        /* LoRA's frozen base has no gradients to reduce-scatter */
        G->shard = stage >= 2 && !G->frozen ? AM_SHARD_SHARDED : AM_SHARD_REPLICATED;
        if (!G->comm) /* the group its shard spans: comm unless the caller chose another (experts: edp) */
            G->comm = comm;
        size_t ranks = (size_t)am_comm_size(G->comm);
        if (G->span % ranks)
            return am_fail(err, err_len, "fsdp: group %s spans %zu elements, not a multiple of the %zu ranks of its "
                           "shard group", G->name, G->span, ranks);
        G->shard_offset = f->n_shard;
        G->shard_elems = G->span / ranks;
        f->n_shard += G->shard_elems;
        if (G->span > max_span)
            max_span = G->span;
    }
    bool moe = false;
    int sharded = 0; /* the groups sharded: all but LoRA's adapters */
    for (int g = 0; g < m->n_groups; g++) {
        moe |= m->groups[g].kind == AM_PG_EXPERTS;
        sharded += m->groups[g].kind != AM_PG_LORA;
    }
    size_t cs = am_dtype_size(m->act_dt);
    f->slot_elems = max_span;
    /* the groups in use and the next ones prefetched: a layer, or a MoE layer and its experts
     * (twice: 4); the head and the embedding it shares (3) */
    f->n_slots = stage < 3 ? 0 : !reshard_after_forward ? sharded : moe ? 4 : m->embed && m->head == m->embed ? 3 : 2;
    f->slot_group = calloc((size_t)f->n_slots + 1, sizeof(*f->slot_group));
    f->slot_req = calloc((size_t)f->n_slots + 1, sizeof(*f->slot_req));
    f->slot_used = calloc((size_t)f->n_slots + 1, sizeof(*f->slot_used));
    if (!f->slot_group || !f->slot_req || !f->slot_used)
        return am_fail(err, err_len, "fsdp: out of memory for %d gathered buffers", f->n_slots);
    bool grads = m->sh.lora_r == 0; /* LoRA: every sharded group is the frozen base's */
    if (grads && grad_dt != AM_F32 && (grad_dt != AM_BF16 || stage < 2))
        return am_fail(err, err_len, "fsdp: gradient shards in %s at ZeRO stage %d: fp32, or bf16 from stage 2",
                       am_dtype_name(grad_dt), stage);
    /* stage 3 gathers a copy of the master shards in the compute dtype when it is not theirs */
    bool copy = m->act_dt != m->store_dt && stage >= 3;
    /* LoRA's frozen base keeps that copy alone: its masters never change, so the copy rounded
     * once is the one every step would round from them */
    bool masters = !(m->sh.lora_r > 0 && copy);
    size_t ws = am_dtype_size(m->store_dt);
    f->master = masters ? K->alloc(m->dev, f->n_shard * ws) : NULL;
    f->grads = grads ? K->alloc(m->dev, f->n_shard * am_dtype_size(grad_dt)) : NULL;
    if (f->n_slots)
        f->slot_mem = K->alloc(m->dev, (size_t)f->n_slots * f->slot_elems * cs);
    if (copy)
        f->master_lp = K->alloc(m->dev, f->n_shard * cs);
    if ((masters && !f->master) || (grads && !f->grads) || (f->n_slots && !f->slot_mem) || (copy && !f->master_lp))
        return am_fail(err, err_len, "fsdp: out of memory for the shards of %zu parameters and %d gathered groups of "
                       "%zu", f->n_shard, f->n_slots, f->slot_elems);
    for (int g = 0; g < m->n_groups; g++) { /* this rank's shard of what init or load wrote */
        const struct am_pgroup *G = &m->groups[g];
        if (G->kind == AM_PG_LORA)
            continue;
        size_t mine = G->offset + (size_t)am_comm_rank(G->comm) * G->shard_elems;
        struct am_tensor src = flat((char *)m->param_mem + mine * ws, m, m->store_dt, G->shard_elems);
        if (!masters) {
            struct am_tensor dst = flat((char *)f->master_lp + G->shard_offset * cs, m, m->act_dt, G->shard_elems);
            K->convert(m->dev, &dst, &src);
            continue;
        }
        struct am_tensor dst = flat((char *)f->master + G->shard_offset * ws, m, m->store_dt, G->shard_elems);
        K->copy(m->dev, &dst, &src);
    }
    if (stage < 3)
        return 0;
    if (am_model_drop_weights(m) < 0)
        return am_fail(err, err_len, "fsdp: out of memory for the %zu LoRA adapter weights kept whole", m->grad_elems);
    for (int s = 0; s < f->n_slots; s++)
        f->slot_group[s] = -1;
    return 0;
}

void am_fsdp_free(struct am_fsdp *f)
{
    if (!f->m)
        return;
    const struct am_model *m = f->m; /* requests still in flight went with their communicator */
    void *mem[] = {f->master, f->master_lp, f->grads, f->slot_mem};
    for (size_t i = 0; i < sizeof(mem) / sizeof(mem[0]); i++)
        if (mem[i])
            m->K->free(m->dev, mem[i]);
    free(f->slot_group);
    free(f->slot_req);
    free(f->slot_used);
    memset(f, 0, sizeof(*f));
}

size_t am_fsdp_weight_bytes(const struct am_fsdp *f)
{
    const struct am_model *m = f->m;
    size_t ws = am_dtype_size(m->store_dt);
    if (f->stage < 3) /* the model's full masters and compute copy, and the master shards */
        return m->slab_elems * (ws + (m->param_lp_mem ? am_dtype_size(m->act_dt) : 0)) + f->n_shard * ws;
    return f->n_shard * ((f->master ? ws : 0) + (f->master_lp ? am_dtype_size(m->act_dt) : 0));
}

int am_fsdp_publish(struct am_fsdp *f, char *err, size_t err_len)
{
    struct am_model *m = f->m;
    size_t ws = am_dtype_size(m->store_dt);
    for (int g = 0; g < m->n_groups; g++) {
        const struct am_pgroup *G = &m->groups[g];
        if (am_allgather(G->comm, (char *)f->master + G->shard_offset * ws, (char *)m->param_mem + G->offset * ws,
                         G->shard_elems, m->store_dt, err, err_len) < 0)
            return -1;
    }
    return 0;
}

void am_fsdp_take_grads(struct am_fsdp *f)
{
    const struct am_model *m = f->m;
    for (int g = 0; g < m->n_groups; g++) {
        const struct am_pgroup *G = &m->groups[g];
        struct am_tensor dst = flat((float *)f->grads + G->shard_offset, m, AM_F32, G->shard_elems);
        size_t mine = G->offset + (size_t)am_comm_rank(G->comm) * G->shard_elems;
        struct am_tensor src = flat((float *)m->grad_mem + mine, m, AM_F32, G->shard_elems);
        m->K->copy(m->dev, &dst, &src);
    }
}

size_t am_fsdp_gathered_bytes(const struct am_fsdp *f)
{
    return (size_t)f->n_slots * f->slot_elems * am_dtype_size(f->m->act_dt);
}

void am_fsdp_begin_step(struct am_fsdp *f)
{
    const struct am_model *m = f->m;
    f->gather_wait_s = 0;
    if (!f->master_lp || !f->master) /* the masters' dtype; or LoRA's frozen base, its compute copy made once */
        return;
    struct am_tensor w = flat(f->master, m, m->store_dt, f->n_shard), c = flat(f->master_lp, m, m->act_dt, f->n_shard);
    m->K->convert(m->dev, &c, &w);
}

int am_fsdp_end_step(struct am_fsdp *f, char *err, size_t err_len)
{
    int rc = 0;
    double t0 = am_mono_time();
    for (int s = 0; s < f->n_slots; s++) {
        if (am_comm_wait(f->slot_req[s], rc == 0 ? err : NULL, rc == 0 ? err_len : 0) < 0)
            rc = -1;
        f->slot_req[s] = NULL;
        f->slot_group[s] = -1;
    }
    f->gather_wait_s += am_mono_time() - t0;
    return rc;
}

static int slot_of(const struct am_fsdp *f, int group)
{
    for (int s = 0; s < f->n_slots; s++)
        if (f->slot_group[s] == group)
            return s;
    return -1;
}

/* A buffer for another group: an empty one, else the least recently used that holds none of
 * the pinned groups; -1 when there is none. */
static int free_slot(const struct am_fsdp *f, int pin0, int pin1, int pin2)
{
    int best = -1;
    for (int s = 0; s < f->n_slots; s++) {
        if (f->slot_group[s] < 0)
            return s;
        if (f->slot_group[s] == pin0 || f->slot_group[s] == pin1 || f->slot_group[s] == pin2)
            continue;
        if (best < 0 || f->slot_used[s] < f->slot_used[best])
            best = s;
    }
    return best;
}

/* Starts the all-gather of group g into buffer s (waiting first for what s still receives). */
static int start_gather(struct am_fsdp *f, int g, int s, char *err, size_t err_len)
{
    const struct am_model *m = f->m;
    const struct am_pgroup *G = &m->groups[g];
    size_t cs = am_dtype_size(m->act_dt);
    if (am_comm_wait(f->slot_req[s], err, err_len) < 0) {
        f->slot_req[s] = NULL;
        return -1;
    }
    f->slot_req[s] = NULL;
    f->slot_group[s] = g;
    f->slot_used[s] = ++f->tick;
    const char *src = (const char *)(f->master_lp ? f->master_lp : f->master) + G->shard_offset * cs;
    void *dst = (char *)f->slot_mem + (size_t)s * f->slot_elems * cs;
    if (am_iallgather(G->comm, src, dst, G->shard_elems, m->act_dt, &f->slot_req[s], err, err_len) < 0) {
        f->slot_group[s] = -1;
        return -1;
    }
    return 0;
}

/* Group g gathered (pinning pin while it chooses a buffer), its parameters' wc pointed at it. */
static int gather(struct am_fsdp *f, int g, int pin, char *err, size_t err_len)
{
    struct am_model *m = f->m;
    int s = slot_of(f, g);
    if (s < 0) {
        s = free_slot(f, g, pin, -1);
        if (start_gather(f, g, s, err, err_len) < 0)
            return -1;
    }
    if (f->slot_req[s]) {
        double t0 = am_mono_time();
        int rc = am_comm_wait(f->slot_req[s], err, err_len);
        f->slot_req[s] = NULL;
        f->gather_wait_s += am_mono_time() - t0;
        if (rc < 0) {
            f->slot_group[s] = -1;
            return -1;
        }
    }
    f->slot_used[s] = ++f->tick;
    const struct am_pgroup *G = &m->groups[g];
    size_t cs = am_dtype_size(m->act_dt);
    char *base = (char *)f->slot_mem + (size_t)s * f->slot_elems * cs;
    for (int i = G->first; i < G->first + G->n; i++)
        m->params[i].wc.data = base + (param_offset(m, &m->params[i]) - G->offset) * cs;
    return 0;
}

int am_fsdp_use(struct am_fsdp *f, int group, bool backward, char *err, size_t err_len)
{
    const struct am_model *m = f->m;
    int also = am_model_group_also(m, group);
    if (gather(f, group, also, err, err_len) < 0 || (also >= 0 && gather(f, also, group, err, err_len) < 0))
        return -1;
    /* the prefetch: the next group this pass reads, with its experts (the embedding's backward
     * reads no weights; an experts group comes with its layer) */
    int step = backward ? -1 : 1, next = group + step;
    while (next >= 0 && next < m->n_groups && m->groups[next].kind == AM_PG_EXPERTS)
        next += step;
    if (next < 0 || next >= m->n_groups || (backward && m->groups[next].kind != AM_PG_LAYER) ||
        m->groups[next].kind == AM_PG_LORA) /* LoRA's adapters (after the head) are not sharded */
        return 0;
    int s;
    if (slot_of(f, next) < 0 && (s = free_slot(f, group, also, -1)) >= 0 && start_gather(f, next, s, err, err_len) < 0)
        return -1;
    int nx = m->groups[next].kind == AM_PG_LAYER ? am_model_group_also(m, next) : -1;
    if (nx >= 0 && slot_of(f, nx) < 0 && (s = free_slot(f, group, also, next)) >= 0 &&
        start_gather(f, nx, s, err, err_len) < 0)
        return -1;
    return 0;
}

int am_fsdp_gather_masters(struct am_fsdp *f, void **slab, char *err, size_t err_len)
{
    struct am_model *m = f->m;
    size_t ws = am_dtype_size(m->store_dt);
    *slab = m->K->alloc(m->dev, m->slab_elems * ws);
    if (!*slab)
        return am_fail(err, err_len, "fsdp: out of memory for the %zu gathered weights of a checkpoint", m->slab_elems);
    for (int g = 0; g < m->n_groups; g++) {
        const struct am_pgroup *G = &m->groups[g];
        if (am_allgather(G->comm, (char *)f->master + G->shard_offset * ws, (char *)*slab + G->offset * ws,
                         G->shard_elems, m->store_dt, err, err_len) < 0)
            return -1;
    }
    for (int i = 0; i < m->n_params; i++)
        m->params[i].w.data = (char *)*slab + param_offset(m, &m->params[i]) * ws;
    return 0;
}

void am_fsdp_release_masters(struct am_fsdp *f, void *slab)
{
    struct am_model *m = f->m;
    for (int i = 0; i < m->n_params; i++)
        m->params[i].w.data = NULL;
    if (slab)
        m->K->free(m->dev, slab);
}
