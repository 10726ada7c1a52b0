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
 *
 * am_isend. NCCL runs the kernels of one communicator in the order they were enqueued, and a
 * send's kernel ends only when the peer has taken the data (beyond what NCCL buffers), so
 * two calls that must progress together (a ring: send to the right, receive from the left)
 * have to be in one NCCL group. An isend is therefore only kept (with the group's stream of
 * the moment) and enqueued at the next call on the context:
 *   - a send or recv on the same group takes the kept sends into its own NCCL group (calls
 *     to one peer run in order within a group), so its wait covers them too;
 *   - a collective on the group enqueues them first, in a group of their own, and runs
 *     after them;
 *   - a call on another group enqueues them first too, in a group of their own on their own
 *     communicator, so that a rank blocked on that group does not hold them back: a
 *     pipeline with one group per direction (activations forward, gradients backward)
 *     blocks receiving gradients while its activations still have to reach the next stage.
 *     They then run beside that call's kernels when the groups have different streams, and
 *     the group's own next receive waits behind them on the device: a group whose messages
 *     go around a ring should not be left for another group between its sends and receives;
 *   - am_send_wait enqueues what is left and waits for the streams of the sends.
 * Every enqueue is waited for until NCCL has issued it (NCCL takes no new group on any
 * communicator meanwhile). The first transfer between two ranks on a communicator also sets
 * up their connection, which needs the peer to enqueue its side.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comm_impl.h"

struct nccl_comm;

struct nccl_ctx {
    int device;
    struct nccl_comm *groups;   /* every group of the context: a call enqueues the others' sends */
};

/* A send started by am_isend, as it will be enqueued. */
struct nccl_send {
    const void *buf;
    size_t count;
    ncclDataType_t dt;
    int peer;
    cudaStream_t stream;        /* the group's stream when it was started */
};

struct nccl_comm {
    ncclComm_t comm;            /* NULL once aborted */
    int *barrier_buf;           /* one int on the device */
    struct nccl_comm *next;     /* in the context's list */
    struct nccl_send *sends;    /* am_isend's, oldest first, until send_drop; */
    size_t nsend, cap, nqueued; /* sends[0, nqueued) are enqueued */
    char queue_err[AM_COMM_ERR_LEN]; /* enqueuing them failed during another group's call */
    cudaStream_t comm_stream;   /* non-blocking collectives (made on the first), or NULL */
    cudaEvent_t ready;          /* recorded on the group's stream before each of them */
    cudaEvent_t tail;           /* recorded on comm_stream after each of them */
    /* am_comm_set_stream_after: the group's own stream (c->stream) waits for `after` */
    cudaStream_t own, after;
    cudaEvent_t after_ev;       /* recorded on `after`, waited for by own, before each call */
    /* non-blocking collectives whose end am_comm_wait left to the device (the group's stream
     * waits for them): their events, until nccl_stream_wait sees them complete */
    struct dev_wait {
        cudaEvent_t ev;
        uint64_t seq;
        const char *name;
    } *dev;
    size_t ndev, capdev;
};

static ncclDataType_t nccl_dtype(enum am_dtype t)
{
    switch (t) {
    case AM_F32: return ncclFloat32;
    case AM_BF16: return ncclBfloat16;
    case AM_F16: return ncclFloat16;
    case AM_I32: return ncclInt32;
    case AM_I64: return ncclInt64;
    case AM_F64: return ncclFloat64;
    }
    return ncclFloat32;
}

/* The NCCL reduction for op on a group of `size` ranks. On one rank the average is the value
 * itself, and it is asked for as a sum: NCCL 2.28.9's ncclAvg on a one-rank communicator left
 * garbage past the first 3 MiB of the buffer on an H200 (tests/comm/test-comm-nccl.sh 1). */
static ncclRedOp_t nccl_op(enum am_comm_op op, int size)
{
    switch (op) {
    case AM_SUM: return ncclSum;
    case AM_MAX: return ncclMax;
    case AM_AVG: return size == 1 ? ncclSum : ncclAvg;
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

/* Waits for the stream to drain (ev NULL) or for event ev, watching the communicator for
 * asynchronous errors. */
static int wait_done_for(struct am_comm *c, cudaStream_t s, cudaEvent_t ev, const char *what);
static int wait_done(struct am_comm *c, cudaStream_t s, cudaEvent_t ev)
{
    return wait_done_for(c, s, ev, "the other ranks to complete it");
}

/* ... naming what it waits for when it times out */
static int wait_done_for(struct am_comm *c, cudaStream_t s, cudaEvent_t ev, const char *what)
{
    struct nccl_comm *n = c->be;
    struct backoff b = {.start = am_comm_now(), .timeout = c->ctx->timeout_s};
    if (!n->comm)
        return am_comm_fail(c, "failed: the group's NCCL communicator was aborted while the call was under way");
    for (;;) {
        cudaError_t q = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
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
            return timed_out(c, what);
    }
}

static int wait_stream(struct am_comm *c, cudaStream_t s) { return wait_done(c, s, NULL); }

/* A blocking call on the group runs after its non-blocking collectives on the device. */
static int after_async(struct am_comm *c, cudaStream_t s)
{
    struct nccl_comm *n = c->be;
    cudaError_t ce = n->comm_stream ? cudaStreamWaitEvent(s, n->tail, 0) : cudaSuccess;
    if (ce != cudaSuccess)
        return am_comm_fail(c, "failed: ordering the call after the group's non-blocking collectives: %s",
                            cudaGetErrorString(ce));
    return 0;
}

static int nccl_ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

/* ncclGroupEnd after calls that returned r: r's error if they failed, else the group's result. */
static ncclResult_t group_end(ncclResult_t r)
{
    ncclResult_t e = ncclGroupEnd();
    return nccl_ok(r) ? e : r;
}

/* After enqueuing `what` returned r: 0 once NCCL has issued it, or -1 (communicator aborted). */
static int issued(struct am_comm *c, const char *what, ncclResult_t r)
{
    if (!nccl_ok(r))
        return nccl_fail(c, what, r);
    return r == ncclInProgress ? wait_issued(c, "NCCL to issue the operation") : 0;
}

/* Enqueues the group's kept sends, oldest first, inside the caller's NCCL group. */
static ncclResult_t enqueue_sends(struct nccl_comm *n)
{
    ncclResult_t r = ncclSuccess;
    for (; n->nqueued < n->nsend && nccl_ok(r); n->nqueued++) {
        const struct nccl_send *s = &n->sends[n->nqueued];
        if (s->count)
            r = ncclSend(s->buf, s->count, s->dt, s->peer, n->comm, s->stream);
    }
    return r;
}

/* The group's kept sends in an NCCL group of their own, issued (before a collective on the
 * group, and in am_send_wait). */
static int enqueue_own(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    if (n->nqueued == n->nsend)
        return 0;
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return nccl_fail(c, "ncclGroupStart", r);
    return issued(c, "ncclSend (pending sends)", group_end(enqueue_sends(n)));
}

/* Polls a communicator whose enqueue returned ncclInProgress: its state once NCCL is done
 * issuing, or ncclInProgress after the timeout or an abort of the context. */
static ncclResult_t settle(const struct am_comm_ctx *ctx, ncclComm_t comm)
{
    struct backoff b = {.start = am_comm_now(), .timeout = ctx->timeout_s};
    for (;;) {
        ncclResult_t st;
        ncclResult_t r = ncclCommGetAsyncError(comm, &st);
        if (r != ncclSuccess)
            return r;
        if (st != ncclInProgress)
            return st;
        if (am_comm_ctx_aborted(ctx) || backoff_wait(&b) < 0)
            return ncclInProgress;
    }
}

/* A group with a stream of its own (am_comm_set_stream_after): that stream waits for what
 * was enqueued on `after` so far (the kernels that wrote the buffers of the calls to come). */
static cudaError_t order_after(struct nccl_comm *n)
{
    cudaError_t ce = cudaSuccess;
    if (n->after && (ce = cudaEventRecord(n->after_ev, n->after)) == cudaSuccess)
        ce = cudaStreamWaitEvent(n->own, n->after_ev, 0);
    return ce;
}

/* Enqueuing group o's sends during a call on group c failed (r; ncclInProgress: not issued
 * in time): o keeps the message for its next call (am_send_wait names the send), and its
 * communicator is aborted. */
static void other_failed(const struct am_comm *c, struct nccl_comm *o, ncclResult_t r)
{
    const struct am_comm_ctx *ctx = c->ctx;
    const char *last = r == ncclInProgress ? NULL : ncclGetLastError(o->comm);
    char why[320];
    if (r != ncclInProgress)
        snprintf(why, sizeof(why), "%s", ncclGetErrorString(r));
    else if (am_comm_ctx_aborted(ctx))
        snprintf(why, sizeof(why), "aborted: %s", ctx->abort_reason);
    else
        snprintf(why, sizeof(why), "NCCL had not issued them after %g s (did the peer enqueue its side?)",
                 ctx->timeout_s);
    snprintf(o->queue_err, sizeof(o->queue_err), "enqueuing the group's pending sends during a call on group %s: %s%s%s",
             c->name, why, last && *last ? ": " : "", last ? last : "");
    ncclCommAbort(o->comm);
    o->comm = NULL;
}

/* The kept sends of the context's other groups, each group's in an NCCL group of its own,
 * issued (see the top of the file). A failure is the other group's, not this call's. */
static void enqueue_others(struct am_comm *c)
{
    const struct nccl_ctx *x = c->ctx->be;
    for (struct nccl_comm *o = x->groups; o; o = o->next) {
        if (o == c->be || !o->comm || o->nqueued == o->nsend)
            continue;
        cudaError_t ce = order_after(o);
        if (ce != cudaSuccess) {
            snprintf(o->queue_err, sizeof(o->queue_err), "ordering the group's pending sends after the compute stream "
                     "during a call on group %s: %s", c->name, cudaGetErrorString(ce));
            ncclCommAbort(o->comm);
            o->comm = NULL;
            continue;
        }
        ncclResult_t r = ncclGroupStart();
        if (r == ncclSuccess)
            r = group_end(enqueue_sends(o));
        if (r == ncclInProgress)
            r = settle(c->ctx, o->comm);
        if (r != ncclSuccess)
            other_failed(c, o, r);
    }
}

/* Before every call on the group: refused when its communicator is gone (with the reason
 * when another group's call failed to enqueue its sends); the device; the other groups'
 * kept sends enqueued. */
static int begin(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    const struct nccl_ctx *x = c->ctx->be;
    if (n->queue_err[0])
        return am_comm_fail(c, "failed: %s", n->queue_err);
    if (!n->comm)
        return am_comm_fail(c, "refused: the NCCL communicator was aborted");
    cudaError_t ce = cudaSetDevice(x->device);
    if (ce != cudaSuccess)
        return am_comm_fail(c, "failed: cudaSetDevice(%d): %s", x->device, cudaGetErrorString(ce));
    if ((ce = order_after(n)) != cudaSuccess)
        return am_comm_fail(c, "failed: ordering the group's stream after the compute stream: %s",
                            cudaGetErrorString(ce));
    enqueue_others(c);
    return 0;
}

/* am_isend: kept, to be enqueued at the group's next call (see the top of the file). */
static int keep_send(struct am_comm *c, const struct am_comm_call *call)
{
    struct nccl_comm *n = c->be;
    if (n->nsend == n->cap) {
        size_t cap = n->cap ? 2 * n->cap : 16;
        struct nccl_send *v = realloc(n->sends, cap * sizeof(*v));
        if (!v)
            return am_comm_fail(c, "failed: out of memory for %zu pending sends", cap);
        n->sends = v;
        n->cap = cap;
    }
    n->sends[n->nsend++] = (struct nccl_send){.buf = call->send, .count = call->count, .dt = nccl_dtype(call->dtype),
                                              .peer = call->peer, .stream = (cudaStream_t)c->stream};
    return 0;
}

/* send and recv: one NCCL group with the group's kept sends, then the wait for the stream. */
static int run_p2p(struct am_comm *c, const struct am_comm_call *call)
{
    struct nccl_comm *n = c->be;
    cudaStream_t s = (cudaStream_t)c->stream;
    ncclDataType_t dt = nccl_dtype(call->dtype);
    if (!call->count && n->nqueued == n->nsend)
        return 0;
    if (after_async(c, s) < 0)
        return -1;
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return nccl_fail(c, "ncclGroupStart", r);
    r = enqueue_sends(n);
    if (nccl_ok(r) && call->count)
        r = call->kind == AM_CALL_SEND ? ncclSend(call->send, call->count, dt, call->peer, n->comm, s)
                                       : ncclRecv(call->recv, call->count, dt, call->peer, n->comm, s);
    if (issued(c, am_comm_call_name(call->kind), group_end(r)) < 0)
        return -1;
    return wait_stream(c, s);
}

/* am_shift on stream s: one NCCL group of the send to the right and the receive from the
 * left (a copy on a group of one rank). */
static ncclResult_t enqueue_shift(struct am_comm *c, const struct am_comm_call *call, cudaStream_t s)
{
    struct nccl_comm *n = c->be;
    ncclDataType_t dt = nccl_dtype(call->dtype);
    if (!call->count)
        return ncclSuccess;
    if (c->size == 1)
        return cudaMemcpyAsync(call->recv, call->send, call->count * am_dtype_size(call->dtype),
                               cudaMemcpyDeviceToDevice, s) == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess)
        return r;
    r = ncclSend(call->send, call->count, dt, (c->rank + 1) % c->size, n->comm, s);
    if (r == ncclSuccess || r == ncclInProgress)
        r = ncclRecv(call->recv, call->count, dt, (c->rank + c->size - 1) % c->size, n->comm, s);
    ncclResult_t e = ncclGroupEnd();
    return r == ncclSuccess || r == ncclInProgress ? e : r;
}

/* The collectives (and barrier), after the group's kept sends. */
static int run_collective(struct am_comm *c, const struct am_comm_call *call)
{
    struct nccl_comm *n = c->be;
    cudaStream_t s = (cudaStream_t)c->stream;
    ncclDataType_t dt = nccl_dtype(call->dtype);
    size_t es = am_dtype_size(call->dtype);
    ncclResult_t r = ncclSuccess;
    cudaError_t ce;
    if (enqueue_own(c) < 0 || after_async(c, s) < 0)
        return -1;
    switch (call->kind) {
    case AM_CALL_ALLREDUCE:
        if (!call->count)
            return 0;
        r = ncclAllReduce(call->send, call->recv, call->count, dt, nccl_op(call->op, c->size), n->comm, s);
        break;
    case AM_CALL_REDUCE_SCATTER:
        if (!call->count)
            return 0;
        r = ncclReduceScatter(call->send, call->recv, call->count, dt, nccl_op(call->op, c->size), n->comm, s);
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
    case AM_CALL_SEND:      /* run_p2p */
    case AM_CALL_RECV:
    case AM_CALL_ISEND:     /* keep_send */
    case AM_CALL_SEND_WAIT: /* the front's own */
    case AM_CALL_STREAM_WAIT: /* nccl_stream_wait */
        return 0;
    case AM_CALL_SHIFT:
        r = enqueue_shift(c, call, s);
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
    if (issued(c, am_comm_call_name(call->kind), r) < 0)
        return -1;
    return wait_stream(c, s);
}

static int nccl_run(struct am_comm *c, const struct am_comm_call *call)
{
    if (call->kind == AM_CALL_ISEND)
        return keep_send(c, call);
    if (begin(c) < 0)
        return -1;
    if (call->kind == AM_CALL_SEND || call->kind == AM_CALL_RECV)
        return run_p2p(c, call);
    return run_collective(c, call);
}

/* Kept send i: what is left enqueued, then its stream drained (NCCL does not tell one send's
 * end from another's: the first wait covers the sends on that stream). */
static int nccl_send_wait(struct am_comm *c, size_t i)
{
    struct nccl_comm *n = c->be;
    if (begin(c) < 0 || enqueue_own(c) < 0)
        return -1;
    am_comm_waiting(c, n->sends[i].peer);
    if (wait_stream(c, n->sends[i].stream) < 0)
        return -1;
    am_comm_waiting(c, -1);
    return 0;
}

/* Sends never enqueued are simply forgotten (the group failed); enqueued ones are the
 * stream's, finished or aborted with the communicator. */
static void nccl_send_drop(struct am_comm *c, size_t k)
{
    struct nccl_comm *n = c->be;
    memmove(n->sends, n->sends + k, (n->nsend - k) * sizeof(*n->sends));
    n->nsend -= k;
    n->nqueued = n->nqueued > k ? n->nqueued - k : 0;
}

/* ---- non-blocking collectives --------------------------------------------------------------- */

/* The group's communication stream and its two events, made on the first request. */
static int comm_stream(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    cudaError_t ce = cudaSuccess;
    if (n->comm_stream)
        return 0;
    if ((ce = cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming)) != cudaSuccess ||
        (ce = cudaEventCreateWithFlags(&n->tail, cudaEventDisableTiming)) != cudaSuccess ||
        (ce = cudaStreamCreateWithFlags(&n->comm_stream, cudaStreamNonBlocking)) != cudaSuccess) {
        n->comm_stream = NULL;
        return am_comm_fail(c, "failed: making the group's communication stream: %s", cudaGetErrorString(ce));
    }
    return 0;
}

/* Enqueues the collective on the communication stream once the group's stream has reached
 * this point (after the group's kept sends); q->be is the event recorded after it. */
static int nccl_start(struct am_comm *c, struct am_comm_req *q)
{
    struct nccl_comm *n = c->be;
    const struct am_comm_call *call = &q->call;
    ncclDataType_t dt = nccl_dtype(call->dtype);
    ncclResult_t r = ncclSuccess;
    cudaEvent_t done = NULL;
    cudaError_t ce;
    if (begin(c) < 0 || enqueue_own(c) < 0 || comm_stream(c) < 0)
        return -1;
    cudaStream_t cs = n->comm_stream;
    if ((ce = cudaEventRecord(n->ready, (cudaStream_t)c->stream)) != cudaSuccess ||
        (ce = cudaStreamWaitEvent(cs, n->ready, 0)) != cudaSuccess ||
        (ce = cudaEventCreateWithFlags(&done, cudaEventDisableTiming)) != cudaSuccess)
        return am_comm_fail(c, "failed: ordering the communication stream after the group's stream: %s",
                            cudaGetErrorString(ce));
    if (call->count && call->kind == AM_CALL_ALLREDUCE)
        r = ncclAllReduce(call->send, call->recv, call->count, dt, nccl_op(call->op, c->size), n->comm, cs);
    else if (call->count && call->kind == AM_CALL_REDUCE_SCATTER)
        r = ncclReduceScatter(call->send, call->recv, call->count, dt, nccl_op(call->op, c->size), n->comm, cs);
    else if (call->count && call->kind == AM_CALL_ALLGATHER)
        r = ncclAllGather(call->send, call->recv, call->count, dt, n->comm, cs);
    else if (call->kind == AM_CALL_SHIFT)
        r = enqueue_shift(c, call, cs);
    if (issued(c, am_comm_name_of(call), r) < 0) {
        cudaEventDestroy(done);
        return -1;
    }
    if ((ce = cudaEventRecord(done, cs)) != cudaSuccess || (ce = cudaEventRecord(n->tail, cs)) != cudaSuccess) {
        cudaEventDestroy(done);
        return am_comm_fail(c, "failed: recording the end of the call: %s", cudaGetErrorString(ce));
    }
    q->be = (void *)done;
    return 0;
}

/* Complete: the event passed; failed: the communicator reported an error, or the context was
 * aborted (the communicator is then aborted too). */
static int nccl_req_test(struct am_comm *c, struct am_comm_req *q)
{
    struct nccl_comm *n = c->be;
    if (!n->comm) {
        q->rc = am_comm_fail(c, "failed: the group's NCCL communicator was aborted while the call was under way");
        return 1;
    }
    cudaError_t ce = cudaEventQuery((cudaEvent_t)q->be);
    if (ce == cudaSuccess) {
        q->rc = 0;
        return 1;
    }
    ncclResult_t st, r = ncclCommGetAsyncError(n->comm, &st);
    if (r != ncclSuccess)
        q->rc = nccl_fail(c, "ncclCommGetAsyncError", r);
    else if (st != ncclSuccess && st != ncclInProgress)
        q->rc = nccl_fail(c, "asynchronous NCCL error", st);
    else if (ce != cudaErrorNotReady)
        q->rc = am_comm_fail(c, "failed: CUDA error on the communication stream: %s", cudaGetErrorString(ce));
    else if (am_comm_ctx_aborted(c->ctx))
        q->rc = aborted(c);
    else
        return 0;
    return 1;
}

/* The event of request q, whose end the group's stream waits for on the device, kept for
 * nccl_stream_wait (which names the call if it never completes). Events already passed are
 * dropped when the list grows long (a group nobody calls am_comm_stream_wait on). 0, or -1
 * (no memory: the event stays the request's, and only the stream's wait covers it). */
static int keep_dev_wait(struct am_comm *c, const struct am_comm_req *q)
{
    struct nccl_comm *n = c->be;
    if (n->ndev >= 1024) {
        size_t k = 0;
        for (size_t i = 0; i < n->ndev; i++) {
            if (k == 0 && cudaEventQuery(n->dev[i].ev) == cudaSuccess) {
                cudaEventDestroy(n->dev[i].ev);
                continue;
            }
            n->dev[k++] = n->dev[i];
        }
        n->ndev = k;
        cudaGetLastError();
    }
    if (n->ndev == n->capdev) {
        size_t cap = n->capdev ? 2 * n->capdev : 64;
        struct dev_wait *v = realloc(n->dev, cap * sizeof(*v));
        if (!v)
            return -1;
        n->dev = v;
        n->capdev = cap;
    }
    n->dev[n->ndev++] = (struct dev_wait){.ev = (cudaEvent_t)q->be, .seq = q->call.seq,
                                          .name = am_comm_name_of(&q->call)};
    return 0;
}

static void drop_dev_waits(struct nccl_comm *n)
{
    for (size_t i = 0; i < n->ndev; i++)
        cudaEventDestroy(n->dev[i].ev);
    n->ndev = 0;
}

/* am_comm_stream_wait: the collectives left to the device, oldest first (a timeout names the
 * first that has not completed), then everything else on the group's stream. */
static int nccl_stream_wait(struct am_comm *c)
{
    struct nccl_comm *n = c->be;
    if (begin(c) < 0 || enqueue_own(c) < 0)
        return -1;
    for (size_t i = 0; i < n->ndev; i++) {
        char what[160];
        snprintf(what, sizeof(what), "%s #%llu to complete on the device", n->dev[i].name,
                 (unsigned long long)n->dev[i].seq);
        if (wait_done_for(c, NULL, n->dev[i].ev, what) < 0)
            return -1;
    }
    drop_dev_waits(n);
    return wait_done_for(c, (cudaStream_t)c->stream, NULL, "the group's stream to run what was enqueued on it");
}

/* am_comm_set_stream_after: a stream of the group's own, ordered after `after`. */
static int nccl_stream_after(struct am_comm *c, void *after)
{
    struct nccl_comm *n = c->be;
    struct nccl_ctx *x = c->ctx->be;
    cudaError_t ce = cudaSetDevice(x->device);
    if (ce == cudaSuccess && !n->own)
        ce = cudaStreamCreateWithFlags(&n->own, cudaStreamNonBlocking);
    if (ce == cudaSuccess && !n->after_ev)
        ce = cudaEventCreateWithFlags(&n->after_ev, cudaEventDisableTiming);
    if (ce != cudaSuccess)
        return am_comm_fail(c, "failed: making the group's own stream: %s", cudaGetErrorString(ce));
    n->after = (cudaStream_t)after;
    c->stream = n->own;
    return 0;
}

/* With a stream set on the group: that stream waits for the call on the device and the host
 * goes on (its end is seen by the group's next host wait); without one: the host waits. */
static int nccl_req_wait(struct am_comm *c, struct am_comm_req *q)
{
    cudaEvent_t done = (cudaEvent_t)q->be;
    if (nccl_req_test(c, q))
        return 1;
    if (c->stream) {
        cudaError_t ce = cudaStreamWaitEvent((cudaStream_t)c->stream, done, 0);
        q->rc = ce == cudaSuccess ? 0 : am_comm_fail(c, "failed: making the group's stream wait for the call: %s",
                                                     cudaGetErrorString(ce));
        if (q->rc == 0 && keep_dev_wait(c, q) == 0)
            q->be = NULL; /* its event is nccl_stream_wait's now */
        return 1;
    }
    q->rc = wait_done(c, NULL, done);
    if (q->rc < 0)
        q->timed_out = c->timed_out;
    return 1;
}

static void nccl_req_drop(struct am_comm *c, struct am_comm_req *q)
{
    (void)c;
    if (q->be)
        cudaEventDestroy((cudaEvent_t)q->be);
    q->be = NULL;
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
    struct nccl_ctx *x = c->ctx->be;
    if (!n)
        return;
    for (struct nccl_comm **p = &x->groups; *p; p = &(*p)->next)
        if (*p == n) {
            *p = n->next;
            break;
        }
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
    if (n->comm_stream) {
        cudaStreamDestroy(n->comm_stream);
        cudaEventDestroy(n->ready);
        cudaEventDestroy(n->tail);
    }
    drop_dev_waits(n);
    free(n->dev);
    if (n->own)
        cudaStreamDestroy(n->own);
    if (n->after_ev)
        cudaEventDestroy(n->after_ev);
    if (c->stream == n->own)
        c->stream = NULL;
    free(n->sends);
    free(n);
    c->be = NULL;
}

static int nccl_create_groups(struct am_comm_ctx *ctx, int n_groups, struct am_comm **groups)
{
    struct nccl_ctx *x = ctx->be;
    char key[AM_BOOT_MAX_KEY], why[512];
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
        if (am_boot_put(ctx->boot, key, &id, sizeof(id), why, sizeof(why)) < 0)
            return am_comm_ctx_fail(ctx, "create groups: group %s: publishing its NCCL id: %s", c->name, why);
    }
    if (am_boot_fence(ctx->boot, ctx->timeout_s, why, sizeof(why)) < 0)
        return am_comm_ctx_fail(ctx, "create groups: exchanging NCCL ids: %s", why);
    for (int g = 0; g < n_groups; g++) {
        struct am_comm *c = groups[g];
        if (!c)
            continue;
        void *val = NULL;
        size_t len = 0;
        snprintf(key, sizeof(key), "am.comm.nccl.%d", c->id);
        if (am_boot_get(ctx->boot, c->ranks[0], key, &val, &len, ctx->timeout_s, why, sizeof(why)) < 0)
            return am_comm_ctx_fail(ctx, "create groups: group %s: the NCCL id from rank %d: %s", c->name, c->ranks[0],
                                    why);
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
        n->next = x->groups;
        x->groups = n;
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
    .send_wait = nccl_send_wait,
    .send_drop = nccl_send_drop,
    .start = nccl_start,
    .req_test = nccl_req_test,
    .req_wait = nccl_req_wait,
    .req_drop = nccl_req_drop,
    .stream_after = nccl_stream_after,
    .stream_wait = nccl_stream_wait,
};
