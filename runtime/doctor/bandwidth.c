/* bandwidth.c - am-doctor's communicator check (doctor.h): a short all-reduce in every NVLink
 * domain of two or more ranks (the links tensor-parallel groups use) and one across nodes
 * (the lowest rank of every node: the links data and pipeline parallelism use), over the
 * job's transport: NCCL on device memory when the rank has a GPU and a CUDA device (and
 * AM_DEVICE is not "cpu"), else UCX on host memory. Each rank records its time inside each
 * timed call; rank 0 turns those into bus bandwidth and names the slow node (report.c).
 *
 * Groups, in this order on every rank: one "domain" group per domain in the order of its
 * lowest rank, then "nodes". The domain tests run at once (the groups are disjoint), then
 * the nodes test; a bootstrap fence separates the phases (not a barrier on the
 * communicators: after a rank failed to answer, they may not work). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef AM_DOC_CUDA
#include <cuda_runtime_api.h>
#endif

#include "doctor.h"
#include "util.h"

struct groups {
    int n;
    int **members;
    int *sizes;
    const char **names;
    int *kinds, *index;
};

static void groups_free(struct groups *g)
{
    for (int i = 0; i < g->n; i++)
        free(g->members[i]);
    free(g->members);
    free(g->sizes);
    free(g->names);
    free(g->kinds);
    free(g->index);
}

static int groups_add(struct groups *g, int kind, int index, const char *name, const int *m, int n)
{
    int k = g->n;
    g->members = realloc(g->members, sizeof(*g->members) * (k + 1));
    g->sizes = realloc(g->sizes, sizeof(*g->sizes) * (k + 1));
    g->names = realloc(g->names, sizeof(*g->names) * (k + 1));
    g->kinds = realloc(g->kinds, sizeof(*g->kinds) * (k + 1));
    g->index = realloc(g->index, sizeof(*g->index) * (k + 1));
    if (!g->members || !g->sizes || !g->names || !g->kinds || !g->index)
        return -1;
    g->members[k] = malloc(sizeof(int) * n);
    if (!g->members[k])
        return -1;
    memcpy(g->members[k], m, sizeof(int) * n);
    g->sizes[k] = n;
    g->names[k] = name;
    g->kinds[k] = kind;
    g->index[k] = index;
    g->n++;
    return 0;
}

/* The same groups on every rank, from every rank's host, node and domain. */
static int build_groups(const struct am_doc_rank *all, int n, struct groups *g)
{
    int *m = malloc(sizeof(int) * n), *seen = calloc(n, sizeof(int)), rc = -1;
    if (!m || !seen)
        goto out;
    int domains = 0;
    for (int r = 0; r < n; r++) {
        if (seen[r])
            continue;
        int k = 0;
        for (int q = r; q < n; q++)
            if (!seen[q] && strcmp(all[q].domain, all[r].domain) == 0) {
                seen[q] = 1;
                m[k++] = q;
            }
        if (k >= 2 && groups_add(g, 1, domains++, "domain", m, k) < 0)
            goto out;
    }
    int k = 0;
    for (int r = 0; r < n; r++) {
        int first = 1;
        for (int q = 0; q < r; q++)
            first &= all[q].node_id != all[r].node_id;
        if (first)
            m[k++] = r;
    }
    if (k >= 2 && groups_add(g, 2, 0, "nodes", m, k) < 0)
        goto out;
    rc = 0;
out:
    free(m);
    free(seen);
    return rc;
}

static void pause_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

/* One test: an untimed all-reduce (connections), then AM_DOC_ITERS timed ones. */
static void run_test(struct am_comm *c, void *buf, size_t count, int kind, int index, const struct am_doc_fault *f,
                     int rank, struct am_doc_bw *bw)
{
    char err[AM_COMM_ERR_LEN];
    bw->kind = kind;
    bw->group = index;
    bw->size = am_comm_size(c);
    bw->bytes = (double)count * 4;
    if (am_allreduce(c, buf, buf, count, AM_F32, AM_SUM, err, sizeof(err)) < 0)
        goto failed;
    if (f->rank == rank && f->skip) {
        bw->absent = 1;
        return;
    }
    for (int i = 0; i < AM_DOC_ITERS; i++) {
        if (f->rank == rank && f->slow_s > 0)
            pause_s(f->slow_s);
        double t0 = am_doc_now();
        if (am_allreduce(c, buf, buf, count, AM_F32, AM_SUM, err, sizeof(err)) < 0)
            goto failed;
        bw->call_s[i] = am_doc_now() - t0;
    }
    return;
failed:
    bw->failed = 1;
    snprintf(bw->err, sizeof(bw->err), "%s", err);
}

int am_doc_bandwidth(struct am_rank_setup *s, const struct am_doc_rank *all, struct am_doc_rank *d,
                     const struct am_doc_opts *o, const struct am_doc_fault *f, char *err, size_t err_len)
{
    int n = s->info.size, rc = -1;
    enum am_comm_backend backend = AM_COMM_UCX;
    int device = -1;
#ifdef AM_DOC_CUDA
    const char *want = getenv("AM_DEVICE");
    int devices = 0;
    if ((!want || strcmp(want, "cpu") != 0) && s->topo.gpu.device >= 0 && cudaGetDeviceCount(&devices) == cudaSuccess &&
        devices > 0) {
        backend = AM_COMM_NCCL;
        device = s->topo.gpu.device % devices;
        cudaSetDevice(device);
    }
#endif
    snprintf(d->transport, sizeof(d->transport), "%s", backend == AM_COMM_NCCL ? "nccl" : "ucx");
    struct groups g = {0};
    struct am_comm **comms = NULL;
    struct am_comm_ctx *ctx = NULL;
    void *buf = NULL;
    size_t count = o->bytes / 4;
    if (build_groups(all, n, &g) < 0 || !(comms = calloc(g.n, sizeof(*comms)))) {
        am_fail(err, err_len, "communicator check: out of memory");
        goto out;
    }
    double timeout = o->timeout_s > 0 ? o->timeout_s : s->timeout_s > 0 && s->timeout_s < 60 ? s->timeout_s : 60;
    ctx = am_comm_ctx_init(backend, s->boot, &s->info, device, timeout, err, err_len);
    if (!ctx)
        goto out;
    const char **hosts = malloc(sizeof(*hosts) * n);
    if (hosts) {
        for (int r = 0; r < n; r++)
            hosts[r] = all[r].host;
        am_comm_ctx_set_hosts(ctx, hosts, n, err, err_len);
        free(hosts);
    }
    if (g.n > 0 &&
        am_comm_create_groups(ctx, g.n, (const int *const *)g.members, g.sizes, g.names, comms, err, err_len) < 0)
        goto out;
#ifdef AM_DOC_CUDA
    if (backend == AM_COMM_NCCL) {
        if (cudaMalloc(&buf, count * 4) != cudaSuccess) {
            buf = NULL;
            am_fail(err, err_len, "communicator check: cudaMalloc of %zu bytes failed", count * 4);
            goto out;
        }
        cudaMemset(buf, 0, count * 4);
    }
#endif
    if (!buf && !(buf = calloc(count, 4))) {
        am_fail(err, err_len, "communicator check: out of memory for %zu bytes", count * 4);
        goto out;
    }
    for (int phase = 1; phase <= 2; phase++) {
        for (int i = 0; i < g.n; i++)
            if (g.kinds[i] == phase && comms[i])
                run_test(comms[i], buf, count, phase, g.index[i], f, s->info.rank, &d->bw[phase - 1]);
        if (am_boot_fence(s->boot, s->timeout_s, err, err_len) < 0)
            goto out;
    }
    rc = 0;
out:
    if (buf) {
#ifdef AM_DOC_CUDA
        if (backend == AM_COMM_NCCL)
            cudaFree(buf);
        else
#endif
            free(buf);
    }
    for (int i = 0; comms && i < g.n; i++)
        if (comms[i])
            am_comm_destroy(comms[i]);
    free(comms);
    if (ctx)
        am_comm_ctx_fini(ctx);
    groups_free(&g);
    return rc;
}
