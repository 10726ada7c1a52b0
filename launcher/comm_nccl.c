/* comm_nccl.c - the NCCL backend (comm.h, comm_impl.h): device memory, one NCCL communicator
 * per group.
 *
 * Creation: the group's rank 0 makes a unique id; all groups' ids travel in one bootstrap
 * round (put, one fence, get); then every rank initialises its groups' communicators in group
 * order (the same order on every rank, so initialisations never wait on each other in a
 * cycle). Communicators are non-blocking (config.blocking = 0): every NCCL call may return
 * ncclInProgress, and we poll ncclCommGetAsyncError against the context's timeout.
 *
 * Operations are enqueued on the group's stream (am_comm_set_stream; default: the legacy
 * default stream) and the call then waits, polling cudaStreamQuery and the communicator's
 * async error, so the interface stays blocking like the UCX backend's. On a timeout or an
 * error the communicator is aborted (ncclCommAbort) and the group is broken.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comm_impl.h"

struct nccl_ctx {
    int device;
};

struct nccl_comm {
    ncclComm_t comm;            /* NULL once aborted */
    int *barrier_buf;           /* one int on the device */
};

static ncclDataType_t nccl_dtype(enum am_comm_dtype t)
{
    switch (t) {
    case AM_F32: return ncclFloat32;
    case AM_BF16: return ncclBfloat16;
    case AM_F16: return ncclFloat16;
    case AM_I32: return ncclInt32;
    case AM_I64: return ncclInt64;
    }
    return ncclFloat32;
}

static ncclRedOp_t nccl_op(enum am_comm_op op)
{
    switch (op) {
    case AM_SUM: return ncclSum;
    case AM_MAX: return ncclMax;
    case AM_AVG: return ncclAvg;
    }
    return ncclSum;
}

/* Backs off while waiting: spin briefly, then yield, then sleep up to 1 ms. */
struct backoff {
    double start, timeout;
    unsigned polls;
};

static int backoff_wait(struct backoff *b)
{
    double now = am_comm_now(), waited = now - b->start;
    if (waited > b->timeout)
        return -1;
    b->polls++;
    if (waited < 50e-6)
        return 0;
    if (waited < 5e-3) {
        sched_yield();
        return 0;
    }
    long ns = waited < 0.1 ? 100000 : 1000000;
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
    return 0;
}

/* "global 0, 1, 2" (the first 8) for messages: NCCL does not say which peer is missing. */
static void peers_text(const struct am_comm *c, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < c->size && i < 8 && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%d", i ? ", " : "", c->ranks[i]);
    if (c->size > 8 && at < len)
        snprintf(buf + at, len - at, ", ...");
}

static void abort_comm(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    if (n && n->comm) {
        ncclCommAbort(n->comm);
        n->comm = NULL;
    }
}

static int nccl_fail(struct am_comm *c, const char *what, ncclResult_t r)
{
    struct nccl_comm *n = c->be;
    const char *last = n && n->comm ? ncclGetLastError(n->comm) : ncclGetLastError(NULL);
    am_comm_fail(c, "failed: %s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
    abort_comm(c);
    return -1;
}

static int timed_out(struct am_comm *c, const char *waiting_for)
{
    char peers[160];
    peers_text(c, peers, sizeof(peers));
    c->timed_out = 1;
    am_comm_fail(c, "timed out after %g s waiting for %s (NCCL does not tell which peer is missing; the group's "
                 "ranks are global %s)", c->ctx->timeout_s, waiting_for, peers);
    abort_comm(c);
    return -1;
}

/* am_comm_ctx_abort was called (a watchdog): abort the communicator, fail the call. */
static int aborted(struct am_comm *c)
{
    am_comm_fail_aborted(c);
    abort_comm(c);
    return -1;
}

/* Waits until the communicator's pending NCCL call has been issued (not ncclInProgress). */
static int wait_issued(struct am_comm *c, const char *what)
{
    struct nccl_comm *n = c->be;
    struct backoff b = {.start = am_comm_now(), .timeout = c->ctx->timeout_s};
    for (;;) {
        ncclResult_t st;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &st);
        if (r != ncclSuccess)
            return nccl_fail(c, "ncclCommGetAsyncError", r);
        if (st == ncclSuccess)
            return 0;
        if (st != ncclInProgress)
            return nccl_fail(c, what, st);
        if (am_comm_ctx_aborted(c->ctx))
            return aborted(c);
        if (backoff_wait(&b) < 0)
            return timed_out(c, what);
    }
}

/* Waits for the stream to drain, watching the communicator for asynchronous errors. */
static int wait_stream(struct am_comm *c, cudaStream_t s)
{
    struct nccl_comm *n = c->be;
    struct backoff b = {.start = am_comm_now(), .timeout = c->ctx->timeout_s};
    for (;;) {
        cudaError_t q = cudaStreamQuery(s);
        ncclResult_t st;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &st);
        if (r != ncclSuccess)
            return nccl_fail(c, "ncclCommGetAsyncError", r);
        if (st != ncclSuccess && st != ncclInProgress)
            return nccl_fail(c, "asynchronous NCCL error", st);
        if (q == cudaSuccess)
            return 0;
        if (q != cudaErrorNotReady) {
            am_comm_fail(c, "failed: CUDA error on the group's stream: %s", cudaGetErrorString(q));
            abort_comm(c);
            return -1;
        }
        if (am_comm_ctx_aborted(c->ctx))
            return aborted(c);
        if (backoff_wait(&b) < 0)
            return timed_out(c, "the other ranks to complete it");
    }
}

static int nccl_run(struct am_comm *c, const struct am_comm_call *call)
{
    struct nccl_comm *n = c->be;
    struct nccl_ctx *x = c->ctx->be;
    cudaStream_t s = (cudaStream_t)c->stream;
    ncclDataType_t dt = nccl_dtype(call->dtype);
    size_t es = am_comm_dtype_size(call->dtype);
    ncclResult_t r = ncclSuccess;
    if (!n->comm)
        return am_comm_fail(c, "refused: the NCCL communicator was aborted");
    cudaError_t ce = cudaSetDevice(x->device);
    if (ce != cudaSuccess)
        return am_comm_fail(c, "failed: cudaSetDevice(%d): %s", x->device, cudaGetErrorString(ce));
    switch (call->kind) {
    case AM_CALL_ALLREDUCE:
        if (!call->count)
            return 0;
        r = ncclAllReduce(call->send, call->recv, call->count, dt, nccl_op(call->op), n->comm, s);
        break;
    case AM_CALL_REDUCE_SCATTER:
        if (!call->count)
            return 0;
        r = ncclReduceScatter(call->send, call->recv, call->count, dt, nccl_op(call->op), n->comm, s);
        break;
    case AM_CALL_ALLGATHER:
        if (!call->count)
            return 0;
        r = ncclAllGather(call->send, call->recv, call->count, dt, n->comm, s);
        break;
    case AM_CALL_BROADCAST:
        if (!call->count)
            return 0;
        r = ncclBroadcast(call->recv, call->recv, call->count, dt, call->peer, n->comm, s);
        break;
    case AM_CALL_SEND:
        if (!call->count)
            return 0;
        r = ncclSend(call->send, call->count, dt, call->peer, n->comm, s);
        break;
    case AM_CALL_RECV:
        if (!call->count)
            return 0;
        r = ncclRecv(call->recv, call->count, dt, call->peer, n->comm, s);
        break;
    case AM_CALL_BARRIER:
        r = ncclAllReduce(n->barrier_buf, n->barrier_buf, 1, ncclInt32, ncclSum, n->comm, s);
        break;
    case AM_CALL_ALLTOALLV: {
        int me = c->rank;
        if (call->send_counts[me] != call->recv_counts[me])
            return am_comm_fail(c, "failed: this rank sends %zu elements to itself but expects %zu",
                                call->send_counts[me], call->recv_counts[me]);
        if (call->send_counts[me]) {
            ce = cudaMemcpyAsync((char *)call->recv + call->recv_displs[me] * es,
                                 (const char *)call->send + call->send_displs[me] * es, call->send_counts[me] * es,
                                 cudaMemcpyDeviceToDevice, s);
            if (ce != cudaSuccess)
                return am_comm_fail(c, "failed: copying this rank's own block: %s", cudaGetErrorString(ce));
        }
        if ((r = ncclGroupStart()) != ncclSuccess)
            return nccl_fail(c, "ncclGroupStart", r);
        for (int j = 0; j < c->size && (r == ncclSuccess || r == ncclInProgress); j++) {
            if (j == me)
                continue;
            if (call->send_counts[j])
                r = ncclSend((const char *)call->send + call->send_displs[j] * es, call->send_counts[j], dt, j,
                             n->comm, s);
            if ((r == ncclSuccess || r == ncclInProgress) && call->recv_counts[j])
                r = ncclRecv((char *)call->recv + call->recv_displs[j] * es, call->recv_counts[j], dt, j, n->comm, s);
        }
        ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess || r == ncclInProgress)
            r = e;
        break;
    }
    }
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(c, am_comm_call_name(call->kind), r);
    if (r == ncclInProgress && wait_issued(c, "NCCL to issue the operation") < 0)
        return -1;
    return wait_stream(c, s);
}

static int nccl_ctx_init(struct am_comm_ctx *ctx, int device)
{
    int ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess)
        return am_comm_ctx_fail(ctx, "NCCL context: no usable CUDA device on %s: %s", ctx->info.host,
                                cudaGetErrorString(ce));
    if (device < 0 || device >= ndev)
        return am_comm_ctx_fail(ctx, "NCCL context: device %d does not exist on %s (it has %d visible GPU%s; "
                                "NCCL needs one GPU per rank)", device, ctx->info.host, ndev, ndev == 1 ? "" : "s");
    if ((ce = cudaSetDevice(device)) != cudaSuccess)
        return am_comm_ctx_fail(ctx, "NCCL context: cudaSetDevice(%d): %s", device, cudaGetErrorString(ce));
    struct nccl_ctx *x = calloc(1, sizeof(*x));
    if (!x)
        return am_comm_ctx_fail(ctx, "NCCL context: out of memory");
    x->device = device;
    ctx->be = x;
    return 0;
}

static void nccl_ctx_fini(struct am_comm_ctx *ctx)
{
    free(ctx->be);
    ctx->be = NULL;
}

static void nccl_destroy(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    if (!n)
        return;
    if (n->comm) {
        if (c->broken) {
            ncclCommAbort(n->comm);
        } else {
            /* finalize (flushes, may need the peers), bounded; abort if it does not finish */
            double end = am_comm_now() + (c->ctx->timeout_s < 10 ? c->ctx->timeout_s : 10);
            ncclResult_t st = ncclInProgress, r = ncclCommFinalize(n->comm);
            while ((r == ncclSuccess || r == ncclInProgress) && am_comm_now() < end &&
                   ncclCommGetAsyncError(n->comm, &st) == ncclSuccess && st == ncclInProgress)
                sched_yield();
            if (st == ncclSuccess)
                ncclCommDestroy(n->comm);
            else
                ncclCommAbort(n->comm);
        }
    }
    if (n->barrier_buf)
        cudaFree(n->barrier_buf);
    free(n);
    c->be = NULL;
}

static int nccl_create_groups(struct am_comm_ctx *ctx, int n_groups, struct am_comm **groups)
{
    struct nccl_ctx *x = ctx->be;
    char key[AM_BOOT_MAX_KEY];
    cudaError_t ce = cudaSetDevice(x->device);
    if (ce != cudaSuccess)
        return am_comm_ctx_fail(ctx, "create groups: cudaSetDevice(%d): %s", x->device, cudaGetErrorString(ce));
    /* one bootstrap round for all groups: each group's rank 0 publishes its id */
    for (int g = 0; g < n_groups; g++) {
        struct am_comm *c = groups[g];
        if (!c || c->rank != 0)
            continue;
        ncclUniqueId id;
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess)
            return am_comm_ctx_fail(ctx, "create groups: group %s: ncclGetUniqueId: %s", c->name, ncclGetErrorString(r));
        snprintf(key, sizeof(key), "am.comm.nccl.%d", c->id);
        if (am_boot_put(ctx->boot, key, &id, sizeof(id)) < 0)
            return am_comm_ctx_fail(ctx, "create groups: group %s: publishing its NCCL id: %s", c->name,
                                    am_boot_error(ctx->boot));
    }
    if (am_boot_fence(ctx->boot, ctx->timeout_s) < 0)
        return am_comm_ctx_fail(ctx, "create groups: exchanging NCCL ids: %s", am_boot_error(ctx->boot));
    for (int g = 0; g < n_groups; g++) {
        struct am_comm *c = groups[g];
        if (!c)
            continue;
        void *val = NULL;
        size_t len = 0;
        snprintf(key, sizeof(key), "am.comm.nccl.%d", c->id);
        if (am_boot_get(ctx->boot, c->ranks[0], key, &val, &len, ctx->timeout_s) < 0)
            return am_comm_ctx_fail(ctx, "create groups: group %s: the NCCL id from rank %d: %s", c->name, c->ranks[0],
                                    am_boot_error(ctx->boot));
        ncclUniqueId id;
        int ok = len == sizeof(id);
        if (ok)
            memcpy(&id, val, sizeof(id));
        free(val);
        if (!ok)
            return am_comm_ctx_fail(ctx, "create groups: group %s: the NCCL id from rank %d has %zu bytes, not %zu",
                                    c->name, c->ranks[0], len, sizeof(id));
        struct nccl_comm *n = calloc(1, sizeof(*n));
        if (!n)
            return am_comm_ctx_fail(ctx, "create groups: out of memory");
        c->be = n;
        if ((ce = cudaMalloc((void **)&n->barrier_buf, sizeof(int))) != cudaSuccess ||
            (ce = cudaMemset(n->barrier_buf, 0, sizeof(int))) != cudaSuccess)
            return am_comm_ctx_fail(ctx, "create groups: group %s: cudaMalloc: %s", c->name, cudaGetErrorString(ce));
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        cfg.commName = c->name;
        ncclResult_t r = ncclCommInitRankConfig(&n->comm, c->size, id, c->rank, &cfg);
        if (r != ncclSuccess && r != ncclInProgress) {
            const char *last = ncclGetLastError(NULL);
            n->comm = NULL;
            return am_comm_ctx_fail(ctx, "create groups: group %s (%d ranks): ncclCommInitRankConfig: %s%s%s", c->name,
                                    c->size, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
        }
        struct backoff b = {.start = am_comm_now(), .timeout = ctx->timeout_s};
        for (;;) {
            ncclResult_t st;
            if ((r = ncclCommGetAsyncError(n->comm, &st)) != ncclSuccess)
                st = r;
            if (st == ncclSuccess)
                break;
            if (st != ncclInProgress || backoff_wait(&b) < 0) {
                char peers[160];
                peers_text(c, peers, sizeof(peers));
                const char *last = ncclGetLastError(n->comm);
                am_comm_ctx_fail(ctx, "create groups: group %s (%d ranks: global %s): NCCL initialisation %s%s%s",
                                 c->name, c->size, peers, st == ncclInProgress ? "timed out" : ncclGetErrorString(st),
                                 last && *last ? ": " : "", last ? last : "");
                ncclCommAbort(n->comm);
                n->comm = NULL;
                return -1;
            }
        }
    }
    return 0;
}

const struct am_comm_ops am_comm_nccl_backend = {
    .name = "NCCL",
    .ctx_init = nccl_ctx_init,
    .ctx_fini = nccl_ctx_fini,
    .create_groups = nccl_create_groups,
    .destroy = nccl_destroy,
    .run = nccl_run,
};
