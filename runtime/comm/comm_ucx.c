/* comm_ucx.c - the UCX backend (comm.h, comm_impl.h): host memory over UCP tagged messages.
 *
 * One UCP context per process with two workers: the calling thread's, for every blocking call
 * and isend, and the communication thread's, for the non-blocking collectives (am_iallreduce,
 * ...). Every rank publishes both addresses through the bootstrap at context creation;
 * am_comm_create_groups creates endpoints from the calling thread's worker to every peer that
 * shares a group with this rank, up front, and fetches the peers' other address, from which
 * the communication thread connects its worker on a group's first request (its worker is
 * touched by no other thread in between). UCX's threading rules: workers used from different
 * threads need a thread-safe context (ucp_params_t.mt_workers_shared = 1); a worker in
 * UCS_THREAD_MODE_SERIALIZED may be used by several threads one at a time (the thread's is
 * made and destroyed by the calling thread, while the communication thread is not running).
 *
 * The communication thread (started at the first request) takes requests from a queue, one at
 * a time, in issue order over all groups, and runs each with the blocking algorithms below on
 * its own copy of the group (its endpoints, requests, scratch space, message and broken state),
 * so the results are the blocking call's bits. It sleeps on a condition variable when the queue
 * is empty; while it runs a request it polls, yields and sleeps like every wait (below). Tags do
 * not collide with blocking calls: the two workers match messages apart. am_comm_wait sleeps
 * until the thread reports the request done, copying into the flight entry the peer the thread
 * waits for (only the calling thread writes the flight recorder).
 *
 * Tags keep groups and calls apart (64 bits):
 *   63      p2p flag (send/recv are numbered per pair of ranks and direction, collectives by
 *           the group's sequence number: see am_comm_call.seq)
 *   52..62  group id (11 bits: 2048 groups per process)
 *   36..51  that number (16 bits, wraps; collectives are blocking, so two in flight on one
 *           group are never 2^16 apart; isends can be, but messages with equal tags from one
 *           sender are matched in the order sent, which is the order of their numbers)
 *   20..35  source: the sender's rank in the group (groups up to 65536 ranks)
 *    0..19  sub-message index within the call (step * segments per chunk + segment; wraps, and
 *           UCX matches messages with equal tags from one sender in the order they were sent,
 *           which is the order the receiver posts them for any one step)
 *
 * Algorithms (p ranks, n elements):
 *   allreduce        recursive doubling (with a fold for p not a power of two) up to
 *                    AM_COMM_UCX_SMALL bytes; above it a ring: reduce-scatter then allgather,
 *                    2(p-1) steps, each chunk cut into segments of AM_COMM_UCX_SEGMENT bytes
 *                    that are forwarded as soon as they are reduced, so the reduction of one
 *                    segment overlaps the transfer of the next. Every rank ends with the same
 *                    bits (ring: the allgather copies one result; recursive doubling: the
 *                    host reductions are commutative bit for bit).
 *   reduce_scatter   ring, p-1 steps, segmented and pipelined the same way.
 *   allgather        Bruck (ceil(log2 p) rounds) up to AM_COMM_UCX_SMALL bytes in all, else a
 *                    ring, p-1 steps, segmented and pipelined.
 *   broadcast        binomial tree up to AM_COMM_UCX_SMALL bytes, else a segmented chain.
 *   alltoallv        every receive posted, then every send (one message per pair, empty ones
 *                    included, so mismatched counts are reported rather than waited for).
 *   barrier          dissemination, ceil(log2 p) rounds of empty messages.
 *   isend            the send posted as am_send posts it, its request kept in the group's
 *                    list of pending sends (apart from the call's requests, which every call
 *                    resets and waits for) until am_send_wait waits for it like any request;
 *                    every wait of every call polls the one worker, which moves it meanwhile.
 *
 * Waiting: every wait polls the worker, AM_COMM_UCX_POLLS times (default 8) between looks at
 * the clock; after AM_COMM_UCX_SPIN_US of no progress (default 0) it yields the CPU between
 * polls, and after 5 ms of no progress it sleeps (50 us doubling to 1 ms), so a rank stuck
 * behind a slow peer does not burn a core. Measured here, 8-byte allreduce on 2 ranks: 0.8 us
 * when each rank has a CPU (0.5 us spinning), 2.7 us when the two share one (105 us spinning
 * 50 us before yielding: a spinning rank holds the CPU its peer needs). Each wait gives up after the context's
 * timeout, with a message naming the call, the group and the peer it was waiting for (and its
 * host, am_comm_ctx_set_hosts), or at once after am_comm_ctx_abort (a watchdog); a copy
 * from a peer that died fails at once (see on_ucx_log). AM_COMM_UCX_PEER_ERRORS=1 turns on
 * UCX's peer error handling instead (dead peers are reported by UCX, but UCX 1.13 then moves
 * all small messages from shared memory to TCP).
 *
 * Tuning (environment, read at context creation): AM_COMM_UCX_SMALL (bytes, default 64 KiB; also
 * UCX's rendezvous threshold unless UCX_RNDV_THRESH is set),
 * AM_COMM_UCX_SEGMENT (bytes, default 256 KiB), AM_COMM_UCX_WINDOW (staging slots, default 4),
 * AM_COMM_UCX_POLLS, AM_COMM_UCX_SPIN_US, AM_COMM_UCX_PEER_ERRORS; UCX's own UCX_* variables
 * apply as usual.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include "comm_impl.h"

#define TAG_P2P (1ull << 63)
#define TAG_GROUP_SHIFT 52
#define TAG_SEQ_SHIFT 36
#define TAG_SRC_SHIFT 20
#define TAG_SUB_MASK 0xfffffull
#define MAX_GROUPS 2048
#define MAX_GROUP_SIZE 65536
#define ADDR_KEY "am.comm.ucx.addr"
#define ASYNC_ADDR_KEY "am.comm.ucx.async"

/* A worker and its endpoints: the calling thread's (main), or the communication thread's
 * (async), which runs the non-blocking collectives. Each is used by one thread at a time. */
struct ucx_lane {
    ucp_worker_h worker;
    ucp_address_t *addr;
    size_t addr_len;
    ucp_ep_h *eps;              /* by global rank; NULL where no group is shared (async: not yet
                                 * connected: the thread connects on a group's first request) */
    ucs_status_t *ep_status;    /* by global rank: UCS_OK, or why UCX gave up on the endpoint */
    int failed;                 /* a call failed: do not wait for peers at the end */
};

/* A request on the communication thread's queue. */
struct ucx_req {
    struct am_comm_req *q;
    struct ucx_req *next;
    int state;                  /* REQ_QUEUED, REQ_RUNNING, REQ_DONE (under the lock) */
};
enum { REQ_QUEUED, REQ_RUNNING, REQ_DONE };

struct ucx_ctx {
    ucp_context_h context;
    struct ucx_lane main, async;
    void **async_addr;          /* by global rank: the peer's async worker address (malloc) */
    size_t *async_addr_len;
    int peer_errors;            /* endpoints report peer failures (UCP_ERR_HANDLING_MODE_PEER) */
    int log_handler;            /* on_ucx_log is pushed */
    /* the communication thread (started at the first non-blocking collective) */
    pthread_mutex_t lock;
    pthread_cond_t work, done;  /* a request was queued (or stop); one completed */
    struct ucx_req *head, *tail;
    pthread_t thread;
    int thread_up, stop;
    size_t seg_bytes;           /* pipeline segment */
    size_t small_bytes;         /* latency algorithms up to this size */
    size_t window;              /* reduce-scatter staging slots, in segments */
    double spin_s;              /* busy polling before yielding */
    unsigned polls;             /* polls between looks at the clock */
};

struct xreq {
    void *req;                  /* NULL once complete */
    int peer;                   /* group rank */
    int is_recv;
    int done;
    ucs_status_t status;
    size_t expect, got;         /* receives: bytes posted for, bytes that came */
};

struct ucx_comm {
    struct ucx_lane *lane;      /* the worker this copy of the group runs on */
    struct am_comm *shadow;     /* the group as the communication thread runs it: its own
                                 * ucx_comm on the async lane, message and broken state */
    int connected;              /* async lane: the endpoints are made */
    ucp_ep_h *eps;              /* by group rank */
    struct xreq *reqs;          /* the current call's requests */
    size_t nreq, cap;
    struct xreq *sends;         /* am_isend's requests, oldest first, until send_drop */
    size_t nsend, send_cap;
    void *scratch;
    size_t scratch_len;
    char sink[8];               /* buffer for empty messages */
};

/* ---- small helpers ------------------------------------------------------------------- */

static inline int mod(int a, int p) { return ((a % p) + p) % p; }

static inline ucp_tag_t coll_tag(const struct am_comm *c, int src, size_t sub)
{
    return ((ucp_tag_t)(unsigned)c->id << TAG_GROUP_SHIFT) | ((c->call->seq & 0xffffull) << TAG_SEQ_SHIFT) |
           ((ucp_tag_t)(unsigned)src << TAG_SRC_SHIFT) | ((ucp_tag_t)sub & TAG_SUB_MASK);
}

static inline ucp_tag_t p2p_tag(const struct am_comm *c, int src)
{
    return TAG_P2P | ((ucp_tag_t)(unsigned)c->id << TAG_GROUP_SHIFT) | ((c->call->seq & 0xffffull) << TAG_SEQ_SHIFT) |
           ((ucp_tag_t)(unsigned)src << TAG_SRC_SHIFT);
}

static double env_num(const char *name, double def, double lo, double hi)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return def;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || v < lo || v > hi)
        return def;
    return v;
}

/* The call's scratch space, kept between calls (64-byte aligned, grown on demand). */
static void *scratch(struct am_comm *c, size_t len)
{
    struct ucx_comm *u = c->be;
    if (len <= u->scratch_len)
        return u->scratch;
    void *p = NULL;
    if (posix_memalign(&p, 64, len) != 0) {
        am_comm_fail(c, "failed: out of memory for %zu bytes of scratch space", len);
        return NULL;
    }
    free(u->scratch);
    u->scratch = p;
    u->scratch_len = len;
    return p;
}

/* ---- requests -------------------------------------------------------------------------- */

/* Appends a cleared request to the list *v (n used, cap allocated); its index, or -1. */
static long push_req(struct am_comm *c, struct xreq **v, size_t *n, size_t *cap)
{
    if (*n == *cap) {
        size_t want = *cap ? 2 * *cap : 64;
        struct xreq *r = realloc(*v, want * sizeof(*r));
        if (!r) {
            am_comm_fail(c, "failed: out of memory for %zu requests", want);
            return -1;
        }
        *v = r;
        *cap = want;
    }
    (*v)[*n] = (struct xreq){0};
    return (long)(*n)++;
}

static long new_req(struct am_comm *c)
{
    struct ucx_comm *u = c->be;
    return push_req(c, &u->reqs, &u->nreq, &u->cap);
}

/* Starts sending into request r (complete at once, or UCX's request to wait for). 0 or -1. */
static int start_send(struct am_comm *c, struct xreq *r, int peer, const void *buf, size_t len, ucp_tag_t tag)
{
    struct ucx_comm *u = c->be;
    r->peer = peer;
    ucp_request_param_t param = {.op_attr_mask = 0};
    ucs_status_ptr_t p = ucp_tag_send_nbx(u->eps[peer], len ? buf : u->sink, len, tag, &param);
    if (UCS_PTR_IS_ERR(p)) {
        char who[320];
        r->done = 1;
        return am_comm_fail(c, "failed sending %zu bytes to %s: %s", len, am_comm_peer_text(c, peer, who, sizeof(who)),
                            ucs_status_string(UCS_PTR_STATUS(p)));
    }
    if (p == NULL) {
        r->done = 1;
        r->status = UCS_OK;
    } else {
        r->req = p;
    }
    return 0;
}

static long post_send(struct am_comm *c, int peer, const void *buf, size_t len, ucp_tag_t tag)
{
    struct ucx_comm *u = c->be;
    long i = new_req(c);
    if (i < 0 || start_send(c, &u->reqs[i], peer, buf, len, tag) < 0)
        return -1;
    return i;
}

static long post_recv(struct am_comm *c, int peer, void *buf, size_t len, ucp_tag_t tag)
{
    struct ucx_comm *u = c->be;
    long i = new_req(c);
    if (i < 0)
        return -1;
    struct xreq *r = &u->reqs[i];
    r->peer = peer;
    r->is_recv = 1;
    r->expect = len;
    /* Always a request: UCX 1.13 leaves recv_info.tag_info unset on immediate completion,
     * and the received length is how mismatched counts are caught. */
    ucp_request_param_t param = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL};
    ucs_status_ptr_t p = ucp_tag_recv_nbx(u->lane->worker, len ? buf : u->sink, len, tag, (ucp_tag_t)-1, &param);
    if (UCS_PTR_IS_ERR(p) || p == NULL) {
        char who[320];
        r->done = 1;
        return am_comm_fail(c, "failed receiving %zu bytes from %s: %s", len,
                            am_comm_peer_text(c, peer, who, sizeof(who)),
                            p ? ucs_status_string(UCS_PTR_STATUS(p)) : "UCX returned no request");
    }
    r->req = p;
    return i;
}

/* 1 when complete (and the UCX request released). */
static int test_req(struct xreq *r)
{
    if (r->done)
        return 1;
    ucs_status_t st;
    if (r->is_recv) {
        ucp_tag_recv_info_t info = {0};
        st = ucp_tag_recv_request_test(r->req, &info);
        if (st != UCS_INPROGRESS)
            r->got = info.length;
    } else {
        st = ucp_request_check_status(r->req);
    }
    if (st == UCS_INPROGRESS)
        return 0;
    r->status = st;
    r->done = 1;
    ucp_request_free(r->req);
    r->req = NULL;
    return 1;
}

/* UCX calls this when it gives up on an endpoint (the peer died or became unreachable); the
 * requests on that endpoint then complete with an error and waits for the peer stop early. */
static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    *(ucs_status_t *)arg = status;
}

static int peer_gone(struct am_comm *c, const struct xreq *r)
{
    const struct ucx_comm *u = c->be;
    ucs_status_t st = u->lane->ep_status[c->ranks[r->peer]];
    if (st == UCS_OK)
        return 0;
    char who[320];
    return am_comm_fail(c, "failed: %s is gone (UCX: %s) while %s it", am_comm_peer_text(c, r->peer, who, sizeof(who)),
                        ucs_status_string(st), r->is_recv ? "receiving from" : "sending to");
}

static int req_result(struct am_comm *c, const struct xreq *r)
{
    char who[320];
    if (r->status != UCS_OK && peer_gone(c, r) < 0)
        return -1;
    if (r->status != UCS_OK)
        return am_comm_fail(c, "failed %s %s: %s (is that rank still alive?)",
                            r->is_recv ? "receiving from" : "sending to", am_comm_peer_text(c, r->peer, who, sizeof(who)),
                            ucs_status_string(r->status));
    if (r->is_recv && r->got != r->expect)
        return am_comm_fail(c, "failed: %s sent %zu bytes where %zu were expected (every rank must pass matching "
                            "counts)", am_comm_peer_text(c, r->peer, who, sizeof(who)), r->got, r->expect);
    return 0;
}

/* The slow path of wait_xreq: progress, then yield, then sleep. r stays valid meanwhile (no
 * request is posted during a wait). */
static int wait_slow(struct am_comm *c, struct xreq *r)
{
    const struct ucx_ctx *x = c->ctx->be;
    ucp_worker_h worker = ((struct ucx_comm *)c->be)->lane->worker;
    double start = am_comm_now(), last = start, timeout = c->ctx->timeout_s;
    unsigned polls = 0, busy = 0;
    long sleep_ns = 50000;
    for (;;) {
        busy |= ucp_worker_progress(worker);
        if (test_req(r))
            return req_result(c, r);
        if (++polls < x->polls)
            continue;
        polls = 0;
        double now = am_comm_now();
        if (busy) {
            last = now;
            busy = 0;
            sleep_ns = 50000;
        }
        if (peer_gone(c, r) < 0)
            return -1;
        if (am_comm_ctx_aborted(c->ctx))
            return am_comm_fail_aborted(c);
        if (now - start > timeout) {
            char who[320];
            c->timed_out = 1;
            return am_comm_fail(c, "timed out after %g s waiting for %s%s", timeout,
                                am_comm_peer_text(c, r->peer, who, sizeof(who)), r->is_recv ? "" : " to take its data");
        }
        double idle = now - last;
        if (idle < x->spin_s)
            continue;
        if (idle < 5e-3) {
            sched_yield();
            polls = x->polls - 1; /* look at the clock again after the next poll */
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 1000000)
            sleep_ns *= 2;
        polls = x->polls - 1;
    }
}

/* Waits for request r: progress, then yield, then sleep; fails after the timeout, or at
 * once when the context is aborted (a watchdog, from another thread). */
static int wait_xreq(struct am_comm *c, struct xreq *r)
{
    if (test_req(r))
        return req_result(c, r);
    am_comm_waiting(c, r->peer);
    int rc = wait_slow(c, r);
    if (rc == 0)
        am_comm_waiting(c, -1); /* after a failure the recorder keeps whom it waited for */
    return rc;
}

/* Waits for request i of the call in progress. */
static int wait_req(struct am_comm *c, long i)
{
    struct ucx_comm *u = c->be;
    return wait_xreq(c, &u->reqs[i]);
}

static int wait_all(struct am_comm *c)
{
    struct ucx_comm *u = c->be;
    for (size_t i = 0; i < u->nreq; i++)
        if (wait_req(c, (long)i) < 0)
            return -1;
    return 0;
}

/* Lets go of the n requests of v that are still posted: receives are cancelled so that UCX
 * writes into no buffer later; sends cannot be (UCX 1.13 cancels receives only), so UCX
 * finishes or fails them on its own, reading their buffers until then. */
static void drop_reqs(struct am_comm *c, struct xreq *v, size_t n)
{
    ucp_worker_h worker = ((struct ucx_comm *)c->be)->lane->worker;
    for (size_t i = 0; i < n; i++) {
        struct xreq *r = &v[i];
        if (r->done || !r->req)
            continue;
        if (r->is_recv)
            ucp_request_cancel(worker, r->req);
        ucp_request_free(r->req);
        r->req = NULL;
        r->done = 1;
    }
}

/* After a failure: the call's requests. */
static void drop_all(struct am_comm *c)
{
    struct ucx_comm *u = c->be;
    drop_reqs(c, u->reqs, u->nreq);
    u->nreq = 0;
}

/* ---- layout of a buffer cut into p chunks and chunks cut into segments ----------------- */

struct layout {
    size_t n, base, rem;        /* chunk i: base + (i < rem) elements */
    size_t seg;                 /* elements per segment */
    size_t es;
};

static size_t ch_off(const struct layout *l, int ch) { return (size_t)ch * l->base + ((size_t)ch < l->rem ? (size_t)ch : l->rem); }
static size_t ch_len(const struct layout *l, int ch) { return l->base + ((size_t)ch < l->rem); }
static size_t ch_nseg(const struct layout *l, int ch) { return (ch_len(l, ch) + l->seg - 1) / l->seg; }
static size_t seg_len(const struct layout *l, int ch, size_t k)
{
    size_t len = ch_len(l, ch) - k * l->seg;
    return len < l->seg ? len : l->seg;
}
/* byte offset of segment k of chunk ch in the full buffer */
static size_t seg_at(const struct layout *l, int ch, size_t k) { return (ch_off(l, ch) + k * l->seg) * l->es; }

static size_t seg_elems(const struct am_comm *c, size_t es)
{
    const struct ucx_ctx *x = c->ctx->be;
    size_t s = x->seg_bytes / es;
    return s ? s : 1;
}

/* ---- allreduce ------------------------------------------------------------------------------ */

/* Recursive doubling; p not a power of two: the first 2*rem ranks fold pairwise first. */
static int allreduce_rd(struct am_comm *c, const char *send, char *dst, size_t n, enum am_dtype t,
                        enum am_comm_op op)
{
    int p = c->size, r = c->rank;
    size_t bytes = n * am_dtype_size(t);
    char *tmp = scratch(c, bytes);
    if (!tmp)
        return -1;
    if (send != dst)
        memcpy(dst, send, bytes);
    int pof2 = 1;
    while (pof2 * 2 <= p)
        pof2 *= 2;
    int rem = p - pof2, newrank;
    long i;
    if (r < 2 * rem) {
        if (r % 2 == 0) {
            if ((i = post_send(c, r + 1, dst, bytes, coll_tag(c, r, 0))) < 0 || wait_req(c, i) < 0)
                return -1;
            newrank = -1;
        } else {
            if ((i = post_recv(c, r - 1, tmp, bytes, coll_tag(c, r - 1, 0))) < 0 || wait_req(c, i) < 0)
                return -1;
            am_comm_reduce(dst, dst, tmp, n, t, op);
            newrank = r / 2;
        }
    } else {
        newrank = r - rem;
    }
    if (newrank >= 0) {
        size_t step = 1;
        for (int mask = 1; mask < pof2; mask <<= 1, step++) {
            int nd = newrank ^ mask, peer = nd < rem ? nd * 2 + 1 : nd + rem;
            long ri = post_recv(c, peer, tmp, bytes, coll_tag(c, peer, step));
            long si = ri < 0 ? -1 : post_send(c, peer, dst, bytes, coll_tag(c, r, step));
            if (si < 0 || wait_req(c, ri) < 0 || wait_req(c, si) < 0)
                return -1;
            am_comm_reduce(dst, dst, tmp, n, t, op);
        }
    }
    if (r < 2 * rem) {
        if (r % 2)
            i = post_send(c, r - 1, dst, bytes, coll_tag(c, r, 0xffff));
        else
            i = post_recv(c, r + 1, dst, bytes, coll_tag(c, r + 1, 0xffff));
        if (i < 0 || wait_req(c, i) < 0)
            return -1;
    }
    if (op == AM_AVG)
        am_comm_scale(dst, n, t, p);
    return 0;
}

/* Ring allreduce. Step t (0 <= t < 2(p-1)) sends chunk (r - t) to the right and receives chunk
 * (r - t - 1) from the left. Steps below p-1 reduce what comes in (dst = send + incoming: each
 * chunk is reduced once per rank, so send is never copied); the later steps pass the finished
 * chunks around, received straight into dst. Segment k of the chunk received at step t is
 * forwarded at step t+1 as soon as it is ready. Incoming partial sums land in a small ring of
 * `window` segment-sized slots that stays in cache, receives posted in the same order as the
 * left neighbour sends. */
struct ring_ar {
    struct am_comm *c;
    struct layout l;
    int p, r, left, right, T;
    size_t K, window;
    const char *send;
    char *dst, *slots;
    long *sidx, *ridx;          /* [t * K + k]: request of that send / receive, -1 if none */
    int next_t;                 /* the next reduce-scatter receive to post: (next_t, next_k) */
    size_t next_k, posted, consumed;
    enum am_dtype t;
    enum am_comm_op op;
};

static int ar_rc(const struct ring_ar *g, int step) { return mod(g->r - step - 1, g->p); }

/* Posts reduce-scatter receives until `window` are outstanding. */
static int ar_post_rs(struct ring_ar *g)
{
    size_t es = g->l.es;
    while (g->posted - g->consumed < g->window) {
        while (g->next_t < g->p - 1 && g->next_k >= ch_nseg(&g->l, ar_rc(g, g->next_t))) {
            g->next_t++;
            g->next_k = 0;
        }
        if (g->next_t >= g->p - 1)
            return 0;
        int ch = ar_rc(g, g->next_t);
        size_t sub = (size_t)g->next_t * g->K + g->next_k, slot = g->posted % g->window;
        long i = post_recv(g->c, g->left, g->slots + slot * g->l.seg * es, seg_len(&g->l, ch, g->next_k) * es,
                           coll_tag(g->c, g->left, sub));
        if (i < 0)
            return -1;
        g->ridx[sub] = i;
        g->next_k++;
        g->posted++;
    }
    return 0;
}

/* Posts the allgather-phase receive of segment k at step u (>= p-1) straight into dst, once
 * the send that read that region (step u+1-p) is done. */
static int ar_post_ag(struct ring_ar *g, int u, size_t k)
{
    int ch = ar_rc(g, u);
    if (k >= ch_nseg(&g->l, ch))
        return 0;
    long prev = g->sidx[(size_t)(u + 1 - g->p) * g->K + k];
    if (prev >= 0 && wait_req(g->c, prev) < 0)
        return -1;
    size_t sub = (size_t)u * g->K + k;
    g->ridx[sub] = post_recv(g->c, g->left, g->dst + seg_at(&g->l, ch, k), seg_len(&g->l, ch, k) * g->l.es,
                             coll_tag(g->c, g->left, sub));
    return g->ridx[sub] < 0 ? -1 : 0;
}

static int allreduce_ring(struct am_comm *c, const char *send, char *dst, size_t n, enum am_dtype t,
                          enum am_comm_op op)
{
    const struct ucx_ctx *x = c->ctx->be;
    struct ring_ar g = {.c = c, .p = c->size, .r = c->rank, .send = send, .dst = dst, .t = t, .op = op};
    size_t es = am_dtype_size(t);
    g.left = mod(g.r - 1, g.p);
    g.right = mod(g.r + 1, g.p);
    g.T = 2 * (g.p - 1);
    g.l = (struct layout){.n = n, .base = n / (size_t)g.p, .rem = n % (size_t)g.p, .seg = seg_elems(c, es), .es = es};
    size_t maxch = g.l.base + (g.l.rem != 0);
    g.K = (maxch + g.l.seg - 1) / g.l.seg;
    g.window = x->window < g.K ? x->window : g.K;
    size_t slot_bytes = (g.window * g.l.seg * es + 63) & ~(size_t)63, nidx = (size_t)g.T * g.K;
    char *mem = scratch(c, slot_bytes + 2 * nidx * sizeof(long));
    if (!mem)
        return -1;
    g.slots = mem;
    g.sidx = (long *)(mem + slot_bytes);
    g.ridx = g.sidx + nidx;
    for (size_t i = 0; i < 2 * nidx; i++)
        g.sidx[i] = -1;
    if (ar_post_rs(&g) < 0)
        return -1;
    for (size_t k = 0; k < ch_nseg(&g.l, g.r); k++)
        if ((g.sidx[k] = post_send(c, g.right, send + seg_at(&g.l, g.r, k), seg_len(&g.l, g.r, k) * es,
                                   coll_tag(c, g.r, k))) < 0)
            return -1;
    for (int s = 0; s < g.T; s++) {
        int ch = ar_rc(&g, s);
        size_t nk = ch_nseg(&g.l, ch);
        for (size_t k = 0; k < nk; k++) {
            if (wait_req(c, g.ridx[(size_t)s * g.K + k]) < 0)
                return -1;
            char *seg = dst + seg_at(&g.l, ch, k);
            size_t len = seg_len(&g.l, ch, k);
            if (s < g.p - 1) {
                size_t slot = g.consumed++ % g.window;
                am_comm_reduce(seg, send + seg_at(&g.l, ch, k), g.slots + slot * g.l.seg * es, len, t, op);
                if (s == g.p - 2 && op == AM_AVG)
                    am_comm_scale(seg, len, t, g.p);
                if (ar_post_rs(&g) < 0)
                    return -1;
            }
            if (s + 1 < g.T) {
                size_t sub = (size_t)(s + 1) * g.K + k;
                if ((g.sidx[sub] = post_send(c, g.right, seg, len * es, coll_tag(c, g.r, sub))) < 0)
                    return -1;
                if (s + 1 >= g.p - 1 && ar_post_ag(&g, s + 1, k) < 0)
                    return -1;
            }
        }
        if (s + 1 < g.T && s + 1 >= g.p - 1)
            for (size_t k = nk; k < ch_nseg(&g.l, ar_rc(&g, s + 1)); k++)
                if (ar_post_ag(&g, s + 1, k) < 0)
                    return -1;
    }
    return wait_all(c);
}

static int do_allreduce(struct am_comm *c, const struct am_comm_call *call)
{
    const struct ucx_ctx *x = c->ctx->be;
    size_t bytes = call->count * am_dtype_size(call->dtype);
    if (c->size == 1) {
        if (call->send != call->recv)
            memcpy(call->recv, call->send, bytes);
        return 0;
    }
    if (bytes <= x->small_bytes || call->count < (size_t)c->size)
        return allreduce_rd(c, call->send, call->recv, call->count, call->dtype, call->op);
    return allreduce_ring(c, call->send, call->recv, call->count, call->dtype, call->op);
}

/* ---- reduce_scatter ------------------------------------------------------------------------ */

/* Ring: step t sends the partial sum of block (r - t - 1) and receives that of block
 * (r - t - 2), adds its own contribution and forwards it at step t+1; at the last step the
 * block is r's own and goes to recv. Partial sums alternate between two block-sized buffers;
 * what comes in lands in `window` segment-sized slots, as in the ring allreduce. */
static int do_reduce_scatter(struct am_comm *c, const struct am_comm_call *call)
{
    const struct ucx_ctx *x = c->ctx->be;
    int p = c->size, r = c->rank, left = mod(r - 1, p), right = mod(r + 1, p), T = p - 1;
    enum am_dtype t = call->dtype;
    size_t n = call->count, es = am_dtype_size(t);
    const char *send = call->send;
    char *recv = call->recv;
    if (p == 1) {
        if (send != recv)
            memcpy(recv, send, n * es);
        return 0;
    }
    struct layout l = {.n = n * (size_t)p, .base = n, .rem = 0, .seg = seg_elems(c, es), .es = es};
    size_t K = (n + l.seg - 1) / l.seg, W = x->window < K ? x->window : K;
    size_t blk = (n * es + 63) & ~(size_t)63, slot_bytes = (W * l.seg * es + 63) & ~(size_t)63;
    size_t nidx = (size_t)T * K, total = (size_t)T * K, posted = 0, consumed = 0;
    char *mem = scratch(c, slot_bytes + (p > 2 ? 2 * blk : 0) + 2 * nidx * sizeof(long));
    if (!mem)
        return -1;
    char *slots = mem, *acc[2] = {mem + slot_bytes, mem + slot_bytes + blk};
    long *sidx = (long *)(mem + slot_bytes + (p > 2 ? 2 * blk : 0)), *ridx = sidx + nidx;
    /* receives in the order the left neighbour sends: (step, segment), `window` ahead */
#define POST_AHEAD()                                                                                        \
    for (; posted < total && posted - consumed < W; posted++) {                                            \
        int ch_ = mod(r - (int)(posted / K) - 2, p);                                                        \
        size_t k_ = posted % K;                                                                             \
        if ((ridx[posted] = post_recv(c, left, slots + (posted % W) * l.seg * es, seg_len(&l, ch_, k_) * es, \
                                      coll_tag(c, left, posted))) < 0)                                      \
            return -1;                                                                                      \
    }
    POST_AHEAD();
    for (size_t k = 0; k < K; k++) {
        int ch = mod(r - 1, p);
        if ((sidx[k] = post_send(c, right, send + seg_at(&l, ch, k), seg_len(&l, ch, k) * es, coll_tag(c, r, k))) < 0)
            return -1;
    }
    for (int s = 0; s < T; s++) {
        int ch = mod(r - s - 2, p), last = s == T - 1;
        char *out = last ? recv : acc[s % 2];
        for (size_t k = 0; k < K; k++) {
            size_t len = seg_len(&l, ch, k), at = k * l.seg * es, idx = (size_t)s * K + k;
            if (wait_req(c, ridx[idx]) < 0)
                return -1;
            if (!last && s >= 2 && wait_req(c, sidx[(size_t)(s - 1) * K + k]) < 0) /* acc[s%2] sent at s-1 */
                return -1;
            am_comm_reduce(out + at, send + seg_at(&l, ch, k), slots + (consumed++ % W) * l.seg * es, len, t,
                           call->op);
            POST_AHEAD();
            if (last) {
                if (call->op == AM_AVG)
                    am_comm_scale(out + at, len, t, p);
                continue;
            }
            if ((sidx[idx + K] = post_send(c, right, out + at, len * es, coll_tag(c, r, idx + K))) < 0)
                return -1;
        }
    }
#undef POST_AHEAD
    return wait_all(c);
}

/* ---- allgather ----------------------------------------------------------------------------- */

/* Bruck: ceil(log2 p) rounds; in the round of distance d every rank sends the min(d, p - d)
 * blocks it holds to rank r - d and receives as many from rank r + d. Blocks accumulate in
 * scratch rotated by r (slot i holds rank r + i's block) and are put in place at the end. */
static int allgather_bruck(struct am_comm *c, const char *send, char *recv, size_t n, size_t es)
{
    int p = c->size, r = c->rank;
    size_t bb = n * es;
    char *tmp = scratch(c, (size_t)p * bb);
    if (!tmp)
        return -1;
    memcpy(tmp, send, bb);
    size_t round = 0;
    for (int d = 1; d < p; d <<= 1, round++) {
        int cnt = d < p - d ? d : p - d, to = mod(r - d, p), from = mod(r + d, p);
        long ri = post_recv(c, from, tmp + (size_t)d * bb, (size_t)cnt * bb, coll_tag(c, from, round));
        long si = ri < 0 ? -1 : post_send(c, to, tmp, (size_t)cnt * bb, coll_tag(c, r, round));
        if (si < 0 || wait_req(c, ri) < 0 || wait_req(c, si) < 0)
            return -1;
    }
    for (int i = 0; i < p; i++)
        memmove(recv + (size_t)mod(r + i, p) * bb, tmp + (size_t)i * bb, bb);
    return 0;
}

/* Ring: step t sends block (r - t) and receives block (r - t - 1), forwarding each segment at
 * the next step as soon as it arrives. */
static int do_allgather(struct am_comm *c, const struct am_comm_call *call)
{
    int p = c->size, r = c->rank, left = mod(r - 1, p), right = mod(r + 1, p), T = p - 1;
    size_t n = call->count, es = am_dtype_size(call->dtype);
    const char *send = call->send;
    char *recv = call->recv, *mine = recv + (size_t)r * n * es;
    if (p == 1) {
        if (send != mine)
            memcpy(mine, send, n * es);
        return 0;
    }
    if (n * es * (size_t)p <= ((const struct ucx_ctx *)c->ctx->be)->small_bytes)
        return allgather_bruck(c, send, recv, n, es);
    struct layout l = {.n = n * (size_t)p, .base = n, .rem = 0, .seg = seg_elems(c, es), .es = es};
    size_t K = (n + l.seg - 1) / l.seg;
    long *ridx = scratch(c, (size_t)T * K * sizeof(long));
    if (!ridx)
        return -1;
    int ch0 = mod(r - 1, p);
    for (size_t k = 0; k < K; k++)
        if (post_send(c, right, send + k * l.seg * es, seg_len(&l, r, k) * es, coll_tag(c, r, k)) < 0 ||
            (ridx[k] = post_recv(c, left, recv + seg_at(&l, ch0, k), seg_len(&l, ch0, k) * es, coll_tag(c, left, k))) < 0)
            return -1;
    if (send != mine)
        memcpy(mine, send, n * es);
    for (int s = 0; s < T; s++) {
        int ch = mod(r - s - 1, p), next = mod(r - s - 2, p);
        for (size_t k = 0; k < K; k++) {
            if (wait_req(c, ridx[(size_t)s * K + k]) < 0)
                return -1;
            if (s + 1 == T)
                continue;
            size_t sub = (size_t)(s + 1) * K + k, len = seg_len(&l, ch, k) * es;
            if (post_send(c, right, recv + seg_at(&l, ch, k), len, coll_tag(c, r, sub)) < 0 ||
                (ridx[sub] = post_recv(c, left, recv + seg_at(&l, next, k), len, coll_tag(c, left, sub))) < 0)
                return -1;
        }
    }
    return wait_all(c);
}

/* ---- broadcast ----------------------------------------------------------------------------- */

static int do_broadcast(struct am_comm *c, const struct am_comm_call *call)
{
    const struct ucx_ctx *x = c->ctx->be;
    int p = c->size, r = c->rank, root = call->peer, v = mod(r - root, p);
    size_t es = am_dtype_size(call->dtype), bytes = call->count * es;
    char *buf = call->recv;
    if (p == 1)
        return 0;
    if (bytes <= x->small_bytes) { /* binomial tree over ranks relative to the root */
        int mask = 1;
        while (mask < p) {
            if (v & mask) {
                int src = mod(v - mask + root, p);
                long i = post_recv(c, src, buf, bytes, coll_tag(c, src, 0));
                if (i < 0 || wait_req(c, i) < 0)
                    return -1;
                break;
            }
            mask <<= 1;
        }
        for (mask >>= 1; mask > 0; mask >>= 1)
            if (v + mask < p && post_send(c, mod(v + mask + root, p), buf, bytes, coll_tag(c, r, 0)) < 0)
                return -1;
        return wait_all(c);
    }
    /* chain root -> root+1 -> ...: each segment is forwarded as soon as it arrives */
    struct layout l = {.n = call->count, .base = call->count, .rem = 0, .seg = seg_elems(c, es), .es = es};
    size_t K = ch_nseg(&l, 0);
    int prev = mod(r - 1, p), next = mod(r + 1, p);
    if (v == 0) {
        for (size_t k = 0; k < K; k++)
            if (post_send(c, next, buf + seg_at(&l, 0, k), seg_len(&l, 0, k) * es, coll_tag(c, r, k)) < 0)
                return -1;
        return wait_all(c);
    }
    for (size_t k = 0; k < K; k++)
        if (post_recv(c, prev, buf + seg_at(&l, 0, k), seg_len(&l, 0, k) * es, coll_tag(c, prev, k)) < 0)
            return -1;
    for (size_t k = 0; k < K; k++) {
        if (wait_req(c, (long)k) < 0)
            return -1;
        if (v < p - 1 && post_send(c, next, buf + seg_at(&l, 0, k), seg_len(&l, 0, k) * es, coll_tag(c, r, k)) < 0)
            return -1;
    }
    return wait_all(c);
}

/* ---- alltoallv, barrier, send/recv --------------------------------------------------------- */

static int do_alltoallv(struct am_comm *c, const struct am_comm_call *call)
{
    int p = c->size, r = c->rank;
    size_t es = am_dtype_size(call->dtype);
    const char *send = call->send;
    char *recv = call->recv;
    if (call->send_counts[r] != call->recv_counts[r])
        return am_comm_fail(c, "failed: this rank sends %zu elements to itself but expects %zu", call->send_counts[r],
                            call->recv_counts[r]);
    for (int i = 1; i < p; i++) {
        int src = mod(r - i, p);
        if (post_recv(c, src, recv + call->recv_displs[src] * es, call->recv_counts[src] * es, coll_tag(c, src, 0)) < 0)
            return -1;
    }
    for (int i = 1; i < p; i++) {
        int to = mod(r + i, p);
        if (post_send(c, to, send + call->send_displs[to] * es, call->send_counts[to] * es, coll_tag(c, r, 0)) < 0)
            return -1;
    }
    if (call->send_counts[r])
        memmove(recv + call->recv_displs[r] * es, send + call->send_displs[r] * es, call->send_counts[r] * es);
    return wait_all(c);
}

static int do_barrier(struct am_comm *c)
{
    int p = c->size, r = c->rank;
    size_t round = 0;
    for (int d = 1; d < p; d <<= 1, round++) {
        int to = mod(r + d, p), from = mod(r - d, p);
        long ri = post_recv(c, from, NULL, 0, coll_tag(c, from, round));
        long si = ri < 0 ? -1 : post_send(c, to, NULL, 0, coll_tag(c, r, round));
        if (si < 0 || wait_req(c, ri) < 0 || wait_req(c, si) < 0)
            return -1;
    }
    return 0;
}

static int do_p2p(struct am_comm *c, const struct am_comm_call *call)
{
    size_t bytes = call->count * am_dtype_size(call->dtype);
    int peer = call->peer;
    long i;
    if (call->kind == AM_CALL_SEND)
        i = post_send(c, peer, call->send, bytes, p2p_tag(c, c->rank));
    else
        i = post_recv(c, peer, call->recv, bytes, p2p_tag(c, peer));
    return i < 0 ? -1 : wait_req(c, i);
}

/* am_shift: the receive from the left posted first, then the send to the right. */
static int do_shift(struct am_comm *c, const struct am_comm_call *call)
{
    int p = c->size, r = c->rank, left = mod(r - 1, p), right = mod(r + 1, p);
    size_t bytes = call->count * am_dtype_size(call->dtype);
    if (p == 1) {
        memcpy(call->recv, call->send, bytes);
        return 0;
    }
    if (post_recv(c, left, call->recv, bytes, coll_tag(c, left, 0)) < 0 ||
        post_send(c, right, call->send, bytes, coll_tag(c, r, 0)) < 0)
        return -1;
    return wait_all(c);
}

/* am_isend: posted like a send, kept in u->sends (the numbering and the tag are the same). */
static int do_isend(struct am_comm *c, const struct am_comm_call *call)
{
    struct ucx_comm *u = c->be;
    long i = push_req(c, &u->sends, &u->nsend, &u->send_cap);
    if (i < 0)
        return -1;
    if (start_send(c, &u->sends[i], call->peer, call->send, call->count * am_dtype_size(call->dtype),
                   p2p_tag(c, c->rank)) < 0) {
        u->nsend--; /* the front keeps only posted sends: the lists stay in step */
        return -1;
    }
    return 0;
}

/* ---- the backend ------------------------------------------------------------------------------ */

static int ucx_run(struct am_comm *c, const struct am_comm_call *call)
{
    struct ucx_comm *u = c->be;
    int rc = 0;
    u->nreq = 0;
    switch (call->kind) {
    case AM_CALL_ALLREDUCE:
        rc = call->count ? do_allreduce(c, call) : 0;
        break;
    case AM_CALL_REDUCE_SCATTER:
        rc = call->count ? do_reduce_scatter(c, call) : 0;
        break;
    case AM_CALL_ALLGATHER:
        rc = call->count ? do_allgather(c, call) : 0;
        break;
    case AM_CALL_ALLTOALLV:
        rc = do_alltoallv(c, call);
        break;
    case AM_CALL_BROADCAST:
        rc = call->count ? do_broadcast(c, call) : 0;
        break;
    case AM_CALL_SEND:
    case AM_CALL_RECV:
        rc = do_p2p(c, call);
        break;
    case AM_CALL_BARRIER:
        rc = do_barrier(c);
        break;
    case AM_CALL_ISEND:
        rc = do_isend(c, call);
        break;
    case AM_CALL_SHIFT:
        rc = call->count ? do_shift(c, call) : 0;
        break;
    case AM_CALL_SEND_WAIT: /* the front's own */
    case AM_CALL_STREAM_WAIT: /* NCCL's only: the front never hands it to UCX */
        break;
    }
    if (rc < 0) {
        drop_all(c);
        u->lane->failed = 1;
    }
    u->nreq = 0;
    return rc;
}

/* Pending send i: waited for as any request is (timeout, abort, a peer that is gone). */
static int ucx_send_wait(struct am_comm *c, size_t i)
{
    struct ucx_comm *u = c->be;
    if (wait_xreq(c, &u->sends[i]) == 0)
        return 0;
    u->lane->failed = 1;
    return -1;
}

static void ucx_send_drop(struct am_comm *c, size_t n)
{
    struct ucx_comm *u = c->be;
    drop_reqs(c, u->sends, n);
    memmove(u->sends, u->sends + n, (u->nsend - n) * sizeof(*u->sends));
    u->nsend -= n;
}

static void ucx_ctx_fini(struct am_comm_ctx *ctx);

/* UCX's shared-memory transports cannot report a dead peer (UCP_ERR_HANDLING_MODE_PEER would
 * move every small message to TCP: 15 times the latency, half the bandwidth, measured), so the
 * endpoints run without peer error handling. Then a peer that dies while its data is being
 * copied with CMA (process_vm_readv/writev: ESRCH) is a FATAL log message, and UCX's default
 * log handler aborts this process. This handler, consulted first, lets that one message pass
 * as an error instead: the copy fails, its request completes with an error, and the call
 * reports the operation, the group and the peer. Every other message goes on to UCX's own
 * handlers. Stateless; pushed at context creation, popped at its end. */
static ucs_log_func_rc_t on_ucx_log(const char *file, unsigned line, const char *function, ucs_log_level_t level,
                                    const ucs_log_component_config_t *comp, const char *fmt, va_list ap)
{
    (void)line;
    (void)function;
    (void)comp;
    (void)ap;
    if (level != UCS_LOG_LEVEL_FATAL || !file || !fmt)
        return UCS_LOG_FUNC_RC_CONTINUE;
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (strcmp(base, "cma_ep.c") != 0 || strncmp(fmt, "%s(pid=%d", 9) != 0)
        return UCS_LOG_FUNC_RC_CONTINUE;
    return UCS_LOG_FUNC_RC_STOP;
}

/* A lane's worker (the calling thread's: SINGLE; the communication thread's: SERIALIZED, as it
 * is made and destroyed here and used by that thread in between) and its address; -1 with
 * ctx->err. */
static int lane_init(struct am_comm_ctx *ctx, struct ucx_lane *l, ucs_thread_mode_t mode, const char *which)
{
    struct ucx_ctx *x = ctx->be;
    ucs_status_t st;
    if (!(l->eps = calloc((size_t)ctx->info.size, sizeof(ucp_ep_h))) ||
        !(l->ep_status = calloc((size_t)ctx->info.size, sizeof(ucs_status_t))))
        return am_comm_ctx_fail(ctx, "UCX context: out of memory");
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = mode};
    if ((st = ucp_worker_create(x->context, &wp, &l->worker)) != UCS_OK) {
        l->worker = NULL;
        return am_comm_ctx_fail(ctx, "UCX context: ucp_worker_create (%s) failed: %s", which, ucs_status_string(st));
    }
    if ((st = ucp_worker_get_address(l->worker, &l->addr, &l->addr_len)) != UCS_OK) {
        l->addr = NULL;
        return am_comm_ctx_fail(ctx, "UCX context: ucp_worker_get_address (%s) failed: %s", which,
                                ucs_status_string(st));
    }
    if (l->addr_len > AM_BOOT_MAX_VALUE)
        return am_comm_ctx_fail(ctx, "UCX context: the %s worker address has %zu bytes, more than the bootstrap "
                                "carries (%d)", which, l->addr_len, AM_BOOT_MAX_VALUE);
    return 0;
}

static int ucx_ctx_init(struct am_comm_ctx *ctx, int device)
{
    (void)device;
    struct ucx_ctx *x = calloc(1, sizeof(*x));
    ucp_config_t *config = NULL;
    ucs_status_t st;
    int rc = -1;
    if (!x)
        return am_comm_ctx_fail(ctx, "UCX context: out of memory");
    ctx->be = x;
    pthread_mutex_init(&x->lock, NULL);
    pthread_cond_init(&x->work, NULL);
    pthread_cond_init(&x->done, NULL);
    if (!(x->async_addr = calloc((size_t)ctx->info.size, sizeof(void *))) ||
        !(x->async_addr_len = calloc((size_t)ctx->info.size, sizeof(size_t)))) {
        am_comm_ctx_fail(ctx, "UCX context: out of memory");
        goto out;
    }
    x->seg_bytes = (size_t)env_num("AM_COMM_UCX_SEGMENT", 256 << 10, 64, 1 << 30);
    x->window = (size_t)env_num("AM_COMM_UCX_WINDOW", 4, 1, 1 << 20);
    x->peer_errors = env_num("AM_COMM_UCX_PEER_ERRORS", 0, 0, 1) != 0;
    ucs_log_push_handler(on_ucx_log);
    x->log_handler = 1;
    x->small_bytes = (size_t)env_num("AM_COMM_UCX_SMALL", 64 << 10, 0, 1 << 30);
    /* Yield early: ranks share CPUs whenever the machine is busy, even with fewer ranks than
     * CPUs (see "Waiting" above). */
    x->spin_s = env_num("AM_COMM_UCX_SPIN_US", 0, 0, 1e7) * 1e-6;
    x->polls = (unsigned)env_num("AM_COMM_UCX_POLLS", 8, 1, 1e6);
    if ((st = ucp_config_read(NULL, NULL, &config)) != UCS_OK) {
        am_comm_ctx_fail(ctx, "UCX context: reading the UCX configuration (UCX_* variables) failed: %s",
                         ucs_status_string(st));
        goto out;
    }
    /* Messages up to the small-algorithm size go eagerly: UCX's automatic threshold (16 KiB
     * here) sends 16-64 KiB messages by rendezvous over CMA, 2-4 times slower between two
     * processes on one machine (measured); the pipeline's 256 KiB segments stay rendezvous
     * (one copy). UCX_RNDV_THRESH, when set, wins. */
    if (!getenv("UCX_RNDV_THRESH")) {
        char thresh[32];
        snprintf(thresh, sizeof(thresh), "%zu", (x->small_bytes > 4096 ? x->small_bytes : 4096) + 1);
        ucp_config_modify(config, "RNDV_THRESH", thresh);
    }
    /* Two workers used from two threads: the context must be thread safe (UCX's rule,
     * ucp_params_t.mt_workers_shared); each worker is used by one thread at a time. */
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                                         UCP_PARAM_FIELD_ESTIMATED_NUM_PPN | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                           .features = UCP_FEATURE_TAG,
                           .mt_workers_shared = 1,
                           .estimated_num_eps = (size_t)ctx->info.size,
                           .estimated_num_ppn = (size_t)(ctx->info.local_size > 0 ? ctx->info.local_size : 1)};
    if ((st = ucp_init(&params, config, &x->context)) != UCS_OK) {
        am_comm_ctx_fail(ctx, "UCX context: ucp_init failed: %s", ucs_status_string(st));
        x->context = NULL;
        goto out;
    }
    if (lane_init(ctx, &x->main, UCS_THREAD_MODE_SINGLE, "calling thread") < 0 ||
        lane_init(ctx, &x->async, UCS_THREAD_MODE_SERIALIZED, "communication thread") < 0)
        goto out;
    /* the peers that share a group with this rank fetch them in am_comm_create_groups */
    char why[512];
    if (am_boot_put(ctx->boot, ADDR_KEY, x->main.addr, x->main.addr_len, why, sizeof(why)) < 0 ||
        am_boot_put(ctx->boot, ASYNC_ADDR_KEY, x->async.addr, x->async.addr_len, why, sizeof(why)) < 0 ||
        am_boot_fence(ctx->boot, ctx->timeout_s, why, sizeof(why)) < 0) {
        am_comm_ctx_fail(ctx, "UCX context: publishing this rank's worker addresses: %s", why);
        goto out;
    }
    rc = 0;
out:
    if (config)
        ucp_config_release(config);
    if (rc < 0) {
        ucx_ctx_fini(ctx);
        ctx->be = NULL;
    }
    return rc;
}

/* Polls a UCX request to completion for at most limit_s seconds (shutdown paths). */
static void finish_request(ucp_worker_h w, ucs_status_ptr_t p, double limit_s)
{
    if (p == NULL || UCS_PTR_IS_ERR(p))
        return;
    double end = am_comm_now() + limit_s;
    while (ucp_request_check_status(p) == UCS_INPROGRESS && am_comm_now() < end)
        if (!ucp_worker_progress(w))
            sched_yield();
    ucp_request_free(p);
}

/* Delivers what is still in flight (unless a peer already failed the lane), then closes the
 * endpoints without waiting for the peers, and the worker. */
static void lane_fini(struct am_comm_ctx *ctx, struct ucx_lane *l)
{
    double limit = ctx->timeout_s < 5 ? ctx->timeout_s : 5;
    if (l->worker) {
        ucp_request_param_t fp = {.op_attr_mask = 0};
        if (!l->failed)
            finish_request(l->worker, ucp_worker_flush_nbx(l->worker, &fp), limit);
        for (int r = 0; l->eps && r < ctx->info.size; r++) {
            if (!l->eps[r])
                continue;
            ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
            finish_request(l->worker, ucp_ep_close_nbx(l->eps[r], &cp), limit);
        }
        if (l->addr)
            ucp_worker_release_address(l->worker, l->addr);
        ucp_worker_destroy(l->worker);
    }
    free(l->eps);
    free(l->ep_status);
}

static void ucx_ctx_fini(struct am_comm_ctx *ctx)
{
    struct ucx_ctx *x = ctx->be;
    if (!x)
        return;
    if (x->thread_up) { /* it ends after the request it runs; queued ones are given up */
        pthread_mutex_lock(&x->lock);
        x->stop = 1;
        pthread_cond_broadcast(&x->work);
        pthread_mutex_unlock(&x->lock);
        pthread_join(x->thread, NULL);
    }
    lane_fini(ctx, &x->async);
    lane_fini(ctx, &x->main);
    if (x->context)
        ucp_cleanup(x->context);
    if (x->log_handler)
        ucs_log_pop_handler();
    for (int r = 0; x->async_addr && r < ctx->info.size; r++)
        free(x->async_addr[r]);
    free(x->async_addr);
    free(x->async_addr_len);
    pthread_cond_destroy(&x->work);
    pthread_cond_destroy(&x->done);
    pthread_mutex_destroy(&x->lock);
    free(x);
    ctx->be = NULL;
}

/* The memory of one copy of a group (its UCX requests already let go of). */
static void comm_free(struct ucx_comm *u)
{
    if (!u)
        return;
    free(u->eps);
    free(u->reqs);
    free(u->sends);
    free(u->scratch);
    free(u);
}

static void ucx_destroy(struct am_comm *c)
{
    struct ucx_comm *u = c->be;
    if (!u)
        return;
    if (u->nreq)
        drop_all(c);
    ucx_send_drop(c, u->nsend);
    if (u->shadow) { /* the front dropped its requests: the thread no longer runs the group */
        comm_free(u->shadow->be);
        free(u->shadow);
    }
    comm_free(u);
    c->be = NULL;
}

static struct ucx_comm *comm_new(struct ucx_lane *lane, int size)
{
    struct ucx_comm *u = calloc(1, sizeof(*u));
    if (u && !(u->eps = calloc((size_t)size, sizeof(ucp_ep_h)))) {
        free(u);
        return NULL;
    }
    if (u)
        u->lane = lane;
    return u;
}

/* An endpoint to peer (global rank) at addr on the lane's worker; UCS_OK or why not. */
static ucs_status_t ep_create(struct ucx_ctx *x, struct ucx_lane *l, int peer, const void *addr)
{
    /* With peer error handling a dead peer fails the requests on its endpoint (and the wait
     * names it) instead of UCX aborting this process. */
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = addr};
    if (x->peer_errors) {
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep.err_handler.cb = on_ep_error;
        ep.err_handler.arg = &l->ep_status[peer];
    }
    ucs_status_t st = ucp_ep_create(l->worker, &ep, &l->eps[peer]);
    if (st != UCS_OK)
        l->eps[peer] = NULL;
    return st;
}

/* The group's copy for the communication thread: the same group, its own state; its
 * endpoints are made by the thread itself (connect_shadow). */
static int make_shadow(struct am_comm_ctx *ctx, struct am_comm *c)
{
    struct ucx_ctx *x = ctx->be;
    struct am_comm *s = calloc(1, sizeof(*s));
    struct ucx_comm *su = s ? comm_new(&x->async, c->size) : NULL;
    if (!su) {
        free(s);
        return am_comm_ctx_fail(ctx, "create groups: out of memory for group %s", c->name);
    }
    s->ctx = ctx;
    s->id = c->id;
    memcpy(s->name, c->name, sizeof(s->name));
    s->rank = c->rank;
    s->size = c->size;
    s->ranks = c->ranks;
    s->be = su;
    ((struct ucx_comm *)c->be)->shadow = s;
    return 0;
}

static int ucx_create_groups(struct am_comm_ctx *ctx, int n_groups, struct am_comm **groups)
{
    struct ucx_ctx *x = ctx->be;
    int me = ctx->info.rank;
    char why[512];
    if (ctx->n_groups + n_groups > MAX_GROUPS)
        return am_comm_ctx_fail(ctx, "create groups: %d groups in all is more than the UCX backend's %d",
                                ctx->n_groups + n_groups, MAX_GROUPS);
    for (int g = 0; g < n_groups; g++) {
        struct am_comm *c = groups[g];
        if (!c)
            continue;
        if (c->size > MAX_GROUP_SIZE)
            return am_comm_ctx_fail(ctx, "create groups: group %s has %d ranks, more than the UCX backend's %d",
                                    c->name, c->size, MAX_GROUP_SIZE);
        struct ucx_comm *u = comm_new(&x->main, c->size);
        if (!u)
            return am_comm_ctx_fail(ctx, "create groups: out of memory for group %s", c->name);
        c->be = u;
        if (make_shadow(ctx, c) < 0)
            return -1;
        for (int i = 0; i < c->size; i++) {
            int peer = c->ranks[i];
            if (peer == me)
                continue;
            if (!x->async_addr[peer] && am_boot_get(ctx->boot, peer, ASYNC_ADDR_KEY, &x->async_addr[peer],
                                                    &x->async_addr_len[peer], ctx->timeout_s, why, sizeof(why)) < 0)
                return am_comm_ctx_fail(ctx, "create groups: group %s: the UCX address of rank %d's communication "
                                        "thread: %s", c->name, peer, why);
            if (!x->main.eps[peer]) {
                void *addr = NULL;
                size_t len = 0;
                if (am_boot_get(ctx->boot, peer, ADDR_KEY, &addr, &len, ctx->timeout_s, why, sizeof(why)) < 0)
                    return am_comm_ctx_fail(ctx, "create groups: group %s: the UCX address of rank %d: %s", c->name,
                                            peer, why);
                ucs_status_t st = ep_create(x, &x->main, peer, addr);
                free(addr);
                if (st != UCS_OK)
                    return am_comm_ctx_fail(ctx, "create groups: group %s: UCX endpoint to rank %d: %s", c->name, peer,
                                            ucs_status_string(st));
            }
            u->eps[i] = x->main.eps[peer];
        }
    }
    return 0;
}

/* ---- the communication thread: non-blocking collectives ---------------------------------- */

/* The thread's endpoints for the group, made on its first request (the worker is the
 * thread's alone). */
static int connect_shadow(struct am_comm *s)
{
    struct ucx_ctx *x = s->ctx->be;
    struct ucx_comm *su = s->be;
    for (int i = 0; i < s->size && !su->connected; i++) {
        int peer = s->ranks[i];
        if (i == s->rank)
            continue;
        if (!x->async.eps[peer]) {
            ucs_status_t st = ep_create(x, &x->async, peer, x->async_addr[peer]);
            if (st != UCS_OK) {
                char who[320];
                return am_comm_fail(s, "failed: UCX endpoint to the communication thread of %s: %s",
                                    am_comm_peer_text(s, i, who, sizeof(who)), ucs_status_string(st));
            }
        }
        su->eps[i] = x->async.eps[peer];
    }
    su->connected = 1;
    return 0;
}

/* Runs request q on the group's copy s, as a blocking call runs on the group: refused when
 * an earlier request of the group failed or the context was aborted; 0 or -1 (s->err). */
static int lane_run(struct am_comm *s, struct am_comm_req *q)
{
    s->call = &q->call;
    s->timed_out = 0;
    s->waiting_out = &q->waiting_for;
    int rc;
    if (s->broken)
        rc = am_comm_fail(s, "refused: the group failed earlier (%s)", s->first_err);
    else if (am_comm_ctx_aborted(s->ctx))
        rc = am_comm_fail_aborted(s);
    else if (connect_shadow(s) < 0)
        rc = -1;
    else
        rc = q->stall ? am_comm_stall(s) : ucx_run(s, &q->call);
    if (rc < 0 && !s->broken) {
        s->broken = 1;
        snprintf(s->first_err, sizeof(s->first_err), "%s", s->err);
    }
    q->rc = rc;
    q->timed_out = s->timed_out;
    if (rc < 0)
        snprintf(q->err, sizeof(q->err), "%s", s->err);
    s->call = NULL;
    s->waiting_out = NULL;
    return rc;
}

/* Takes queued requests one at a time, in issue order, and runs them; sleeps when there are
 * none. */
static void *lane_main(void *arg)
{
    struct am_comm_ctx *ctx = arg;
    struct ucx_ctx *x = ctx->be;
    pthread_mutex_lock(&x->lock);
    for (;;) {
        while (!x->head && !x->stop)
            pthread_cond_wait(&x->work, &x->lock);
        if (x->stop)
            break;
        struct ucx_req *r = x->head;
        x->head = r->next;
        if (!x->head)
            x->tail = NULL;
        r->state = REQ_RUNNING;
        pthread_mutex_unlock(&x->lock);
        struct am_comm *s = ((struct ucx_comm *)r->q->c->be)->shadow;
        lane_run(s, r->q);
        pthread_mutex_lock(&x->lock);
        r->state = REQ_DONE;
        pthread_cond_broadcast(&x->done);
    }
    pthread_mutex_unlock(&x->lock);
    return NULL;
}

/* Queues q for the communication thread (started on the first request). */
static int ucx_start(struct am_comm *c, struct am_comm_req *q)
{
    struct ucx_ctx *x = c->ctx->be;
    struct ucx_req *r = calloc(1, sizeof(*r));
    if (!r)
        return am_comm_fail(c, "failed: out of memory for a request");
    if (!x->thread_up) {
        int e = pthread_create(&x->thread, NULL, lane_main, c->ctx);
        if (e != 0) {
            free(r);
            return am_comm_fail(c, "failed: cannot start the communication thread: %s", strerror(e));
        }
        x->thread_up = 1;
    }
    r->q = q;
    q->be = r;
    pthread_mutex_lock(&x->lock);
    if (x->tail)
        x->tail->next = r;
    else
        x->head = r;
    x->tail = r;
    pthread_cond_signal(&x->work);
    pthread_mutex_unlock(&x->lock);
    return 0;
}

/* After completion: a failure's message becomes the group's. */
static int req_done(struct am_comm *c, struct am_comm_req *q)
{
    if (q->rc < 0)
        snprintf(c->err, sizeof(c->err), "%s", q->err);
    return 1;
}

static int ucx_req_test(struct am_comm *c, struct am_comm_req *q)
{
    struct ucx_ctx *x = c->ctx->be;
    struct ucx_req *r = q->be;
    pthread_mutex_lock(&x->lock);
    int done = r->state == REQ_DONE;
    pthread_mutex_unlock(&x->lock);
    return done ? req_done(c, q) : 0;
}

/* Sleeps until the thread completes q (its waits have the timeout and see an abort), showing
 * in the flight entry (the calling thread's to write) the peer the thread waits for. */
static int ucx_req_wait(struct am_comm *c, struct am_comm_req *q)
{
    struct ucx_ctx *x = c->ctx->be;
    struct ucx_req *r = q->be;
    pthread_mutex_lock(&x->lock);
    while (r->state != REQ_DONE) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&x->done, &x->lock, &ts);
        if (r->state != REQ_DONE)
            am_comm_waiting(c, atomic_load_explicit(&q->waiting_for, memory_order_relaxed));
    }
    pthread_mutex_unlock(&x->lock);
    return req_done(c, q);
}

/* Forgets q: taken off the queue when it has not started, waited for when it runs. */
static void ucx_req_drop(struct am_comm *c, struct am_comm_req *q)
{
    struct ucx_ctx *x = c->ctx->be;
    struct ucx_req *r = q->be;
    if (!r)
        return;
    pthread_mutex_lock(&x->lock);
    if (r->state == REQ_QUEUED) {
        struct ucx_req **p = &x->head, *prev = NULL;
        for (; *p && *p != r; prev = *p, p = &(*p)->next)
            ;
        if (*p) {
            *p = r->next;
            if (x->tail == r)
                x->tail = prev;
        }
    }
    while (r->state == REQ_RUNNING)
        pthread_cond_wait(&x->done, &x->lock);
    pthread_mutex_unlock(&x->lock);
    free(r);
    q->be = NULL;
}

const struct am_comm_ops am_comm_ucx_backend = {
    .name = "UCX",
    .ctx_init = ucx_ctx_init,
    .ctx_fini = ucx_ctx_fini,
    .create_groups = ucx_create_groups,
    .destroy = ucx_destroy,
    .run = ucx_run,
    .send_wait = ucx_send_wait,
    .send_drop = ucx_send_drop,
    .start = ucx_start,
    .req_test = ucx_req_test,
    .req_wait = ucx_req_wait,
    .req_drop = ucx_req_drop,
};
