/* comm_ucx.c - the UCX backend (comm.h, comm_impl.h): host memory over UCP tagged messages.
 *
 * One UCP context and worker per process; every rank publishes its worker address through
 * the bootstrap at context creation, and am_comm_create_groups creates endpoints to every
 * peer that shares a group with this rank, up front.
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

struct ucx_ctx {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_address_t *addr;
    size_t addr_len;
    ucp_ep_h *eps;              /* by global rank; NULL where no group is shared */
    ucs_status_t *ep_status;    /* by global rank: UCS_OK, or why UCX gave up on the endpoint */
    int peer_errors;            /* endpoints report peer failures (UCP_ERR_HANDLING_MODE_PEER) */
    int log_handler;            /* on_ucx_log is pushed */
    int failed;                 /* a call failed: do not wait for peers at the end */
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
    struct ucx_ctx *x = c->ctx->be;
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
    ucs_status_ptr_t p = ucp_tag_recv_nbx(x->worker, len ? buf : u->sink, len, tag, (ucp_tag_t)-1, &param);
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
    const struct ucx_ctx *x = c->ctx->be;
    ucs_status_t st = x->ep_status[c->ranks[r->peer]];
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
    struct ucx_ctx *x = c->ctx->be;
    double start = am_comm_now(), last = start, timeout = c->ctx->timeout_s;
    unsigned polls = 0, busy = 0;
    long sleep_ns = 50000;
    for (;;) {
        busy |= ucp_worker_progress(x->worker);
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
    struct ucx_ctx *x = c->ctx->be;
    for (size_t i = 0; i < n; i++) {
        struct xreq *r = &v[i];
        if (r->done || !r->req)
            continue;
        if (r->is_recv)
            ucp_request_cancel(x->worker, r->req);
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
static int allreduce_rd(struct am_comm *c, const char *send, char *dst, size_t n, enum am_comm_dtype t,
                        enum am_comm_op op)
{
    int p = c->size, r = c->rank;
    size_t bytes = n * am_comm_dtype_size(t);
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
    enum am_comm_dtype t;
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

static int allreduce_ring(struct am_comm *c, const char *send, char *dst, size_t n, enum am_comm_dtype t,
                          enum am_comm_op op)
{
    const struct ucx_ctx *x = c->ctx->be;
    struct ring_ar g = {.c = c, .p = c->size, .r = c->rank, .send = send, .dst = dst, .t = t, .op = op};
    size_t es = am_comm_dtype_size(t);
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
    size_t bytes = call->count * am_comm_dtype_size(call->dtype);
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
    enum am_comm_dtype t = call->dtype;
    size_t n = call->count, es = am_comm_dtype_size(t);
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
    size_t n = call->count, es = am_comm_dtype_size(call->dtype);
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
    size_t es = am_comm_dtype_size(call->dtype), bytes = call->count * es;
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
    size_t es = am_comm_dtype_size(call->dtype);
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
    size_t bytes = call->count * am_comm_dtype_size(call->dtype);
    int peer = call->peer;
    long i;
    if (call->kind == AM_CALL_SEND)
        i = post_send(c, peer, call->send, bytes, p2p_tag(c, c->rank));
    else
        i = post_recv(c, peer, call->recv, bytes, p2p_tag(c, peer));
    return i < 0 ? -1 : wait_req(c, i);
}

/* am_isend: posted like a send, kept in u->sends (the numbering and the tag are the same). */
static int do_isend(struct am_comm *c, const struct am_comm_call *call)
{
    struct ucx_comm *u = c->be;
    long i = push_req(c, &u->sends, &u->nsend, &u->send_cap);
    if (i < 0)
        return -1;
    if (start_send(c, &u->sends[i], call->peer, call->send, call->count * am_comm_dtype_size(call->dtype),
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
    case AM_CALL_SEND_WAIT: /* the front's own */
        break;
    }
    if (rc < 0) {
        drop_all(c);
        ((struct ucx_ctx *)c->ctx->be)->failed = 1;
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
    ((struct ucx_ctx *)c->ctx->be)->failed = 1;
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

static int ucx_ctx_init(struct am_comm_ctx *ctx, int device)
{
    (void)device;
    struct ucx_ctx *x = calloc(1, sizeof(*x));
    ucp_config_t *config = NULL;
    ucs_status_t st;
    int rc = -1;
    if (!x || !(x->eps = calloc((size_t)ctx->info.size, sizeof(ucp_ep_h))) ||
        !(x->ep_status = calloc((size_t)ctx->info.size, sizeof(ucs_status_t)))) {
        if (x)
            free(x->eps);
        free(x);
        return am_comm_ctx_fail(ctx, "UCX context: out of memory");
    }
    ctx->be = x;
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
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                                         UCP_PARAM_FIELD_ESTIMATED_NUM_PPN,
                           .features = UCP_FEATURE_TAG,
                           .estimated_num_eps = (size_t)ctx->info.size,
                           .estimated_num_ppn = (size_t)(ctx->info.local_size > 0 ? ctx->info.local_size : 1)};
    if ((st = ucp_init(&params, config, &x->context)) != UCS_OK) {
        am_comm_ctx_fail(ctx, "UCX context: ucp_init failed: %s", ucs_status_string(st));
        goto out;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(x->context, &wp, &x->worker)) != UCS_OK) {
        am_comm_ctx_fail(ctx, "UCX context: ucp_worker_create failed: %s", ucs_status_string(st));
        goto out;
    }
    if ((st = ucp_worker_get_address(x->worker, &x->addr, &x->addr_len)) != UCS_OK) {
        am_comm_ctx_fail(ctx, "UCX context: ucp_worker_get_address failed: %s", ucs_status_string(st));
        goto out;
    }
    if (x->addr_len > AM_BOOT_MAX_VALUE) {
        am_comm_ctx_fail(ctx, "UCX context: the worker address has %zu bytes, more than the bootstrap carries (%d)",
                         x->addr_len, AM_BOOT_MAX_VALUE);
        goto out;
    }
    /* the peers that share a group with this rank fetch it in am_comm_create_groups */
    if (am_boot_put(ctx->boot, ADDR_KEY, x->addr, x->addr_len) < 0 || am_boot_fence(ctx->boot, ctx->timeout_s) < 0) {
        am_comm_ctx_fail(ctx, "UCX context: publishing this rank's worker address: %s", am_boot_error(ctx->boot));
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

static void ucx_ctx_fini(struct am_comm_ctx *ctx)
{
    struct ucx_ctx *x = ctx->be;
    if (!x)
        return;
    double limit = ctx->timeout_s < 5 ? ctx->timeout_s : 5;
    if (x->worker) {
        /* deliver what is still in flight (unless a peer already failed us), then close
         * without waiting for the peers */
        ucp_request_param_t fp = {.op_attr_mask = 0};
        if (!x->failed)
            finish_request(x->worker, ucp_worker_flush_nbx(x->worker, &fp), limit);
        for (int r = 0; r < ctx->info.size; r++) {
            if (!x->eps[r])
                continue;
            ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
            finish_request(x->worker, ucp_ep_close_nbx(x->eps[r], &cp), limit);
        }
        if (x->addr)
            ucp_worker_release_address(x->worker, x->addr);
        ucp_worker_destroy(x->worker);
    }
    if (x->context)
        ucp_cleanup(x->context);
    if (x->log_handler)
        ucs_log_pop_handler();
    free(x->eps);
    free(x->ep_status);
    free(x);
    ctx->be = NULL;
}

static void ucx_destroy(struct am_comm *c)
{
    struct ucx_comm *u = c->be;
    if (!u)
        return;
    if (u->nreq)
        drop_all(c);
    ucx_send_drop(c, u->nsend);
    free(u->eps);
    free(u->reqs);
    free(u->sends);
    free(u->scratch);
    free(u);
    c->be = NULL;
}

static int ucx_create_groups(struct am_comm_ctx *ctx, int n_groups, struct am_comm **groups)
{
    struct ucx_ctx *x = ctx->be;
    int me = ctx->info.rank;
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
        struct ucx_comm *u = calloc(1, sizeof(*u));
        if (!u || !(u->eps = calloc((size_t)c->size, sizeof(ucp_ep_h)))) {
            if (u) {
                c->be = u;
                ucx_destroy(c);
            }
            return am_comm_ctx_fail(ctx, "create groups: out of memory for group %s", c->name);
        }
        c->be = u;
        for (int i = 0; i < c->size; i++) {
            int peer = c->ranks[i];
            if (peer == me)
                continue;
            if (!x->eps[peer]) {
                void *addr = NULL;
                size_t len = 0;
                if (am_boot_get(ctx->boot, peer, ADDR_KEY, &addr, &len, ctx->timeout_s) < 0)
                    return am_comm_ctx_fail(ctx, "create groups: group %s: the UCX address of rank %d: %s", c->name,
                                            peer, am_boot_error(ctx->boot));
                /* With peer error handling a dead peer fails the requests on its endpoint
                 * (and the wait names it) instead of UCX aborting this process. */
                ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = addr};
                if (x->peer_errors) {
                    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
                    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
                    ep.err_handler.cb = on_ep_error;
                    ep.err_handler.arg = &x->ep_status[peer];
                }
                ucs_status_t st = ucp_ep_create(x->worker, &ep, &x->eps[peer]);
                free(addr);
                if (st != UCS_OK) {
                    x->eps[peer] = NULL;
                    return am_comm_ctx_fail(ctx, "create groups: group %s: UCX endpoint to rank %d: %s", c->name, peer,
                                            ucs_status_string(st));
                }
            }
            u->eps[i] = x->eps[peer];
        }
    }
    return 0;
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
};
