/* groups.c - the communicators of a training rank (groups.h). */
#include "groups.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

int am_groups_build(struct am_groups *g, const struct am_rank_setup *s, enum am_comm_backend backend, int device,
                    struct am_flight *flight, const char *const *hosts, struct am_errors *err)
{
    /* HSDP adds the shard (dp_shard x cp) and replica groups, expert parallelism the ep groups
     * and their replicas' (expert-data-parallel) groups, context parallelism the ring and the
     * gradients' dp x cp */
    enum am_group kinds[10] = {AM_GROUP_DP, AM_GROUP_TP, AM_GROUP_PP, AM_GROUP_PP};
    const struct am_plan *p = &s->plan;
    int n_kinds = 4;
    if (p->dp_replicate > 1 && p->dp_shard * p->cp > 1) {
        kinds[n_kinds++] = AM_GROUP_DP_SHARD;
        kinds[n_kinds++] = AM_GROUP_DP_REPLICATE;
    }
    if (p->ep > 1) {
        kinds[n_kinds++] = AM_GROUP_EP;
        kinds[n_kinds++] = AM_GROUP_EP_SHARD;
    }
    if (p->cp > 1) {
        kinds[n_kinds++] = AM_GROUP_CP;
        kinds[n_kinds++] = AM_GROUP_DP_CP;
    }
    char msg[AM_COMM_ERR_LEN];
    memset(g, 0, sizeof(*g));
    g->ctx = am_comm_ctx_init(backend, s->boot, &s->info, device, s->timeout_s, msg, sizeof(msg));
    if (!g->ctx) {
        am_errorf(err, NULL, "%s", msg);
        return -1;
    }
    am_comm_ctx_set_flight(g->ctx, flight);
    if (hosts && am_comm_ctx_set_hosts(g->ctx, hosts, s->info.size, msg, sizeof(msg)) < 0) {
        am_errorf(err, NULL, "%s", msg);
        return -1;
    }
    if (am_place_groups(p, &s->place, kinds, n_kinds, &g->set, err) < 0)
        return -1;
    int n = g->set.n, pp_seen = 0;
    g->comms = calloc((size_t)n, sizeof(*g->comms));
    g->names = calloc((size_t)n, sizeof(*g->names));
    if (!g->comms || !g->names) {
        am_errorf(err, NULL, "out of memory for %d communicators", n);
        return -1;
    }
    for (int i = 0; i < n; i++) { /* the second set of pp groups (world / pp of each) is pp_grad */
        bool second = g->set.kinds[i] == AM_GROUP_PP && pp_seen++ >= p->world / p->pp;
        g->names[i] = second ? "pp_grad" : g->set.names[i];
    }
    if (am_comm_create_groups(g->ctx, n, g->set.groups, g->set.sizes, g->names, g->comms, msg, sizeof(msg)) < 0) {
        am_errorf(err, NULL, "%s", msg);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (!g->comms[i])
            continue;
        if (g->set.kinds[i] == AM_GROUP_DP)
            g->dp = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_TP)
            g->tp = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_PP && !g->pp)
            g->pp = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_PP)
            g->pp_grad = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_DP_SHARD)
            g->dp_shard = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_DP_REPLICATE)
            g->dp_replicate = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_EP)
            g->ep = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_EP_SHARD)
            g->edp = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_CP)
            g->cp = g->comms[i];
        else if (g->set.kinds[i] == AM_GROUP_DP_CP)
            g->dp_cp = g->comms[i];
    }
    if (!g->dp_cp) /* cp 1: the gradients are reduced over dp */
        g->dp_cp = g->dp;
    if (!g->dp_shard) /* no replica groups: the shard group is dp x cp (dp itself at cp 1) */
        g->dp_shard = g->dp_cp;
    return 0;
}

void am_groups_free(struct am_groups *g)
{
    for (int i = 0; g->comms && i < g->set.n; i++)
        am_comm_destroy(g->comms[i]);
    free(g->comms);
    free(g->names);
    am_group_set_free(&g->set);
    am_comm_ctx_fini(g->ctx);
    memset(g, 0, sizeof(*g));
}

int am_groups_job_max(struct am_comm *const job[4], void *a, void *b, size_t count, enum am_dtype t, void **out,
                      char *err, size_t err_len)
{
    for (int k = 0; k < 4; k++) {
        if (!job[k] || am_comm_size(job[k]) < 2)
            continue;
        if (am_allreduce(job[k], a, b, count, t, AM_MAX, err, err_len) < 0)
            return -1;
        void *x = a;
        a = b;
        b = x;
    }
    *out = a;
    return 0;
}
