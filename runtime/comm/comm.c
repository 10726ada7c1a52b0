/* comm.c - the generic front of the communicators (comm.h): argument checks, sequence
 * numbers and messages; the backends do the communication (comm_impl.h), and the UCX
 * transport combines what it receives with the host reductions of comm_reduce.c. */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_impl.h"
#include "util.h"

/* ---- names ------------------------------------------------------------------------ */

const char *am_comm_op_name(enum am_comm_op op)
{
    switch (op) {
    case AM_SUM: return "sum";
    case AM_MAX: return "max";
    case AM_AVG: return "avg";
    }
    return "unknown op";
}

double am_comm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- messages ------------------------------------------------------------------------ */

const char *am_comm_call_name(enum am_comm_kind k)
{
    switch (k) {
    case AM_CALL_ALLREDUCE: return "allreduce";
    case AM_CALL_REDUCE_SCATTER: return "reduce_scatter";
    case AM_CALL_ALLGATHER: return "allgather";
    case AM_CALL_ALLTOALLV: return "alltoallv";
    case AM_CALL_BROADCAST: return "broadcast";
    case AM_CALL_SEND: return "send";
    case AM_CALL_RECV: return "recv";
    case AM_CALL_BARRIER: return "barrier";
    case AM_CALL_ISEND: return "isend";
    case AM_CALL_SEND_WAIT: return "send_wait";
    case AM_CALL_STREAM_WAIT: return "stream_wait";
    case AM_CALL_SHIFT: return "shift";
    }
    return "operation";
}

const char *am_comm_name_of(const struct am_comm_call *call)
{
    if (call->nonblocking) {
        switch (call->kind) {
        case AM_CALL_ALLREDUCE: return "iallreduce";
        case AM_CALL_REDUCE_SCATTER: return "ireduce_scatter";
        case AM_CALL_ALLGATHER: return "iallgather";
        case AM_CALL_SHIFT: return "ishift";
        default: break;
        }
    }
    return am_comm_call_name(call->kind);
}

int am_comm_fail(struct am_comm *c, const char *fmt, ...)
{
    char what[AM_COMM_ERR_LEN - 160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    const struct am_comm_call *call = c->call;
    if (call && (call->kind == AM_CALL_SEND || call->kind == AM_CALL_ISEND || call->kind == AM_CALL_RECV))
        snprintf(c->err, sizeof(c->err), "%s #%llu %s rank %d on group %s (%d rank%s) %s", am_comm_call_name(call->kind),
                 (unsigned long long)call->seq, call->kind == AM_CALL_RECV ? "from" : "to", call->peer, c->name,
                 c->size, c->size == 1 ? "" : "s", what);
    else if (call && call->kind == AM_CALL_SEND_WAIT) /* nothing pending: no send to name */
        snprintf(c->err, sizeof(c->err), "send_wait on group %s (%d rank%s) %s", c->name, c->size,
                 c->size == 1 ? "" : "s", what);
    else if (call)
        snprintf(c->err, sizeof(c->err), "%s #%llu on group %s (%d rank%s) %s", am_comm_name_of(call),
                 (unsigned long long)call->seq, c->name, c->size, c->size == 1 ? "" : "s", what);
    else
        snprintf(c->err, sizeof(c->err), "group %s (%d rank%s): %s", c->name, c->size, c->size == 1 ? "" : "s",
                 what);
    return -1;
}

const char *am_comm_peer_text(const struct am_comm *c, int peer, char *buf, size_t len)
{
    int g = peer >= 0 && peer < c->size ? c->ranks[peer] : -1;
    const struct am_comm_ctx *ctx = c->ctx;
    if (g >= 0 && ctx->hosts && g < ctx->n_hosts && ctx->hosts[g][0])
        snprintf(buf, len, "rank %d (global %d on %s)", peer, g, ctx->hosts[g]);
    else
        snprintf(buf, len, "rank %d (global %d)", peer, g);
    return buf;
}

void am_comm_waiting(struct am_comm *c, int peer)
{
    if (c->waiting_out) {
        atomic_store_explicit(c->waiting_out, peer, memory_order_relaxed);
        return;
    }
    if (c->ctx->flight && c->flight_id)
        am_flight_waiting(c->ctx->flight, c->flight_id, peer >= 0 && peer < c->size ? c->ranks[peer] : -1);
}

int am_comm_fail_aborted(struct am_comm *c)
{
    return am_comm_fail(c, "aborted: %s", c->ctx->abort_reason);
}

int am_comm_ctx_fail(struct am_comm_ctx *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof(ctx->err), fmt, ap);
    va_end(ap);
    return -1;
}

/* An argument error: the call is not numbered and the group stays usable. */
static int arg_fail(struct am_comm *c, const char *name, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int arg_fail(struct am_comm *c, const char *name, const char *fmt, ...)
{
    char what[AM_COMM_ERR_LEN - 160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    snprintf(c->err, sizeof(c->err), "%s on group %s (%d rank%s): %s", name, c->name, c->size,
             c->size == 1 ? "" : "s", what);
    return -1;
}

/* The end of every public call on a group: on -1, the call's message (the group's, c->err)
 * goes to the caller's buffer (comm.h: nothing is left for the caller to fetch). err may be
 * NULL (err_len 0): the message is dropped. */
static int result(const struct am_comm *c, int rc, char *err, size_t err_len)
{
    if (rc < 0 && err && err_len)
        am_fail(err, err_len, "%s", c ? c->err : "communicators: no group (NULL handle)");
    return rc;
}

/* ---- context and groups ------------------------------------------------------------- */

static const struct am_comm_ops *backend_ops(enum am_comm_backend b)
{
    switch (b) {
    case AM_COMM_UCX:
#ifdef AM_HAVE_UCX
        return &am_comm_ucx_backend;
#else
        return NULL;
#endif
    case AM_COMM_NCCL:
#ifdef AM_HAVE_NCCL
        return &am_comm_nccl_backend;
#else
        return NULL;
#endif
    }
    return NULL;
}

struct am_comm_ctx *am_comm_ctx_init(enum am_comm_backend backend, struct am_boot *boot,
                                     const struct am_boot_info *info, int device, double timeout_s,
                                     char *err, size_t err_len)
{
    const struct am_comm_ops *ops = backend_ops(backend);
    const char *bname = backend == AM_COMM_UCX ? "UCX" : backend == AM_COMM_NCCL ? "NCCL" : "unknown";
    if (!ops) {
        snprintf(err, err_len, "communicators: the %s backend was not built into this program (%s)", bname,
                 backend == AM_COMM_NCCL ? "configure found no CUDA toolkit with nccl.h; see --with-cuda"
                                         : "configure found no UCX; install libucx-dev");
        return NULL;
    }
    if (!boot || !info) {
        snprintf(err, err_len, "communicators: %s context needs a bootstrap (am_boot_init)", bname);
        return NULL;
    }
    if (!(timeout_s > 0) || timeout_s > 1e7) {
        snprintf(err, err_len, "communicators: timeout %g s is not a positive number of seconds", timeout_s);
        return NULL;
    }
    struct am_comm_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        snprintf(err, err_len, "communicators: out of memory");
        return NULL;
    }
    ctx->ops = ops;
    ctx->backend = backend;
    ctx->boot = boot;
    ctx->info = *info;
    ctx->timeout_s = timeout_s;
    if (ops->ctx_init(ctx, device) < 0) {
        snprintf(err, err_len, "%s", ctx->err);
        free(ctx);
        return NULL;
    }
    return ctx;
}

void am_comm_ctx_fini(struct am_comm_ctx *ctx)
{
    if (!ctx)
        return;
    ctx->ops->ctx_fini(ctx);
    for (int r = 0; ctx->hosts && r < ctx->n_hosts; r++)
        free(ctx->hosts[r]);
    free(ctx->hosts);
    free(ctx);
}

void am_comm_ctx_set_flight(struct am_comm_ctx *ctx, struct am_flight *f)
{
    if (ctx)
        ctx->flight = f;
}

int am_comm_ctx_set_hosts(struct am_comm_ctx *ctx, const char *const *hosts, int n, char *err, size_t err_len)
{
    if (!ctx)
        return am_fail(err, err_len, "communicators: no context (NULL)");
    if (n < 0)
        return am_fail(err, err_len, "host names: %d hosts", n);
    char **h = calloc((size_t)n + 1, sizeof(*h));
    if (!h)
        return am_fail(err, err_len, "host names: out of memory");
    for (int r = 0; r < n; r++) {
        if (!(h[r] = strdup(hosts[r] ? hosts[r] : ""))) {
            for (int q = 0; q < r; q++)
                free(h[q]);
            free(h);
            return am_fail(err, err_len, "host names: out of memory");
        }
    }
    for (int r = 0; ctx->hosts && r < ctx->n_hosts; r++)
        free(ctx->hosts[r]);
    free(ctx->hosts);
    ctx->hosts = h;
    ctx->n_hosts = n;
    return 0;
}

void am_comm_ctx_abort(struct am_comm_ctx *ctx, const char *reason)
{
    if (!ctx || atomic_load(&ctx->aborted))
        return;
    snprintf(ctx->abort_reason, sizeof(ctx->abort_reason), "%s", reason && *reason ? reason : "the context was aborted");
    atomic_store(&ctx->aborted, 1);
}

int am_comm_ctx_aborted(const struct am_comm_ctx *ctx)
{
    return ctx && atomic_load_explicit(&ctx->aborted, memory_order_acquire);
}

void am_comm_inject_stall(struct am_comm *c, uint64_t seq)
{
    if (c)
        c->stall_seq = seq;
}

void am_comm_inject_kill(struct am_comm *c, uint64_t seq)
{
    if (c)
        c->kill_seq = seq;
}

/* am_comm_inject_kill: the process dies inside the call, a second after it began (so that the
 * group's other ranks, which may be a little behind, are in the call too, waiting for it). */
static int am_comm_die(void)
{
    struct timespec ts = {1, 0};
    nanosleep(&ts, NULL);
    raise(SIGKILL);
    for (;;)
        pause();
    return -1;
}

double am_comm_ctx_busy_s(const struct am_comm_ctx *ctx)
{
    return ctx ? ctx->busy_s : 0;
}

static void group_free(struct am_comm *c)
{
    if (!c)
        return;
    free(c->pending);
    free(c->reqs);
    free(c->ranks);
    free(c->sent);
    free(c->received);
    free(c);
}

int am_comm_create_groups(struct am_comm_ctx *ctx, int n_groups, const int *const *groups,
                          const int *group_sizes, const char *const *names, struct am_comm **out, char *err,
                          size_t err_len)
{
    if (!ctx)
        return am_fail(err, err_len, "communicators: no context (NULL)");
    int world = ctx->info.size, me = ctx->info.rank, rc = -1;
    char *seen = NULL;
    struct am_comm **mine = NULL;
    if (n_groups < 0 || (n_groups > 0 && (!groups || !group_sizes || !names || !out))) {
        am_comm_ctx_fail(ctx, "create groups: %d groups with %s", n_groups, n_groups < 0 ? "a negative count" : "a NULL array");
        goto out;
    }
    for (int g = 0; g < n_groups; g++)
        out[g] = NULL;
    seen = calloc((size_t)world, 1);
    mine = calloc((size_t)n_groups + 1, sizeof(*mine));
    if (!seen || !mine) {
        am_comm_ctx_fail(ctx, "create groups: out of memory");
        goto out;
    }
    /* Check every group on every rank, so that all ranks fail alike on a bad table. */
    for (int g = 0; g < n_groups; g++) {
        const char *name = names[g] ? names[g] : "(unnamed)";
        if (group_sizes[g] < 1 || group_sizes[g] > world || !groups[g]) {
            am_comm_ctx_fail(ctx, "create groups: group %d (%s) has %d ranks; it needs 1 to %d (the world size)", g, name,
                             group_sizes[g], world);
            goto out;
        }
        memset(seen, 0, (size_t)world);
        for (int i = 0; i < group_sizes[g]; i++) {
            int r = groups[g][i];
            if (r < 0 || r >= world) {
                am_comm_ctx_fail(ctx, "create groups: group %d (%s) lists rank %d, outside 0..%d", g, name, r, world - 1);
                goto out;
            }
            if (seen[r]) {
                am_comm_ctx_fail(ctx, "create groups: group %d (%s) lists rank %d twice", g, name, r);
                goto out;
            }
            seen[r] = 1;
        }
    }
    for (int g = 0; g < n_groups; g++) {
        int pos = -1;
        for (int i = 0; i < group_sizes[g]; i++)
            if (groups[g][i] == me)
                pos = i;
        if (pos < 0)
            continue;
        struct am_comm *c = calloc(1, sizeof(*c));
        if (c)
            mine[g] = c;
        if (!c || !(c->ranks = malloc((size_t)group_sizes[g] * sizeof(int))) ||
            !(c->sent = calloc((size_t)group_sizes[g], sizeof(uint64_t))) ||
            !(c->received = calloc((size_t)group_sizes[g], sizeof(uint64_t)))) {
            am_comm_ctx_fail(ctx, "create groups: out of memory");
            goto out;
        }
        c->ctx = ctx;
        c->id = ctx->n_groups + g;
        snprintf(c->name, sizeof(c->name), "%s", names[g] ? names[g] : "(unnamed)");
        c->rank = pos;
        c->size = group_sizes[g];
        memcpy(c->ranks, groups[g], (size_t)c->size * sizeof(int));
    }
    if (ctx->ops->create_groups(ctx, n_groups, mine) < 0)
        goto out;
    ctx->n_groups += n_groups;
    for (int g = 0; g < n_groups; g++) {
        out[g] = mine[g];
        mine[g] = NULL;
    }
    rc = 0;
out:
    for (int g = 0; mine && g < n_groups; g++)
        am_comm_destroy(mine[g]);
    free(mine);
    free(seen);
    if (rc < 0)
        am_fail(err, err_len, "%s", ctx->err);
    return rc;
}

void am_comm_destroy(struct am_comm *c)
{
    if (!c)
        return;
    /* sends that am_send_wait never completed are given up: the backend drops them */
    for (size_t i = 0; c->ctx->flight && i < c->n_pending; i++)
        if (c->pending[i].flight_id)
            am_flight_end(c->ctx->flight, c->pending[i].flight_id, AM_FLIGHT_FAILED);
    /* so are requests never waited for (their handles die with the group) */
    for (size_t i = 0; i < c->n_reqs; i++) {
        struct am_comm_req *q = c->reqs[i];
        if (c->ctx->flight && q->flight_id)
            am_flight_end(c->ctx->flight, q->flight_id, AM_FLIGHT_FAILED);
        if (c->be)
            c->ctx->ops->req_drop(c, q);
        free(q);
    }
    c->n_reqs = 0;
    if (c->be)
        c->ctx->ops->destroy(c);
    group_free(c);
}

int am_comm_rank(const struct am_comm *c) { return c ? c->rank : -1; }
int am_comm_size(const struct am_comm *c) { return c ? c->size : 0; }
const char *am_comm_name(const struct am_comm *c) { return c ? c->name : "(none)"; }
uint64_t am_comm_seq(const struct am_comm *c) { return c ? c->seq : 0; }

enum am_comm_backend am_comm_ctx_backend(const struct am_comm_ctx *ctx) { return ctx->backend; }

void am_comm_set_stream(struct am_comm *c, void *stream)
{
    if (c)
        c->stream = stream;
}

/* ---- the calls -------------------------------------------------------------------------- */

/* The call as the flight recorder keeps it: count in elements (alltoallv: sent), the peer
 * as a global rank (send/isend/recv: the peer; broadcast: the root). */
static uint64_t flight_begin(struct am_comm *c, const struct am_comm_call *call)
{
    struct am_flight_op op = {.op = am_comm_name_of(call), .dtype = am_dtype_name(call->dtype),
                              .group = c->name, .gid = c->id, .seq = call->seq, .count = call->count,
                              .bytes = call->bytes, .peer = -1};
    switch (call->kind) {
    case AM_CALL_ALLREDUCE:
    case AM_CALL_REDUCE_SCATTER:
        op.redop = am_comm_op_name(call->op);
        break;
    case AM_CALL_ALLTOALLV:
        op.count = 0;
        for (int j = 0; j < c->size; j++)
            op.count += call->send_counts[j];
        break;
    case AM_CALL_BROADCAST:
    case AM_CALL_SEND:
    case AM_CALL_ISEND:
    case AM_CALL_RECV:
        op.peer = c->ranks[call->peer];
        break;
    case AM_CALL_BARRIER:
    case AM_CALL_STREAM_WAIT:
        op.dtype = NULL;
        break;
    case AM_CALL_ALLGATHER:
    case AM_CALL_SHIFT:
    case AM_CALL_SEND_WAIT: /* not recorded: it ends its isends' entries */
        break;
    }
    uint64_t id = am_flight_begin(c->ctx->flight, &op);
    am_flight_start(c->ctx->flight, id);
    return id;
}

/* am_comm_inject_stall: blocks, as a hung kernel would, until the context is aborted. */
int am_comm_stall(struct am_comm *c)
{
    while (!am_comm_ctx_aborted(c->ctx)) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return am_comm_fail_aborted(c);
}

/* The broken-group and aborted-context rules: 0, or -1 with the call refused. A refusal
 * does not break the group again (its first error stays the one repeated). */
static int refused(struct am_comm *c)
{
    if (c->broken)
        return am_comm_fail(c, "refused: the group failed earlier (%s)", c->first_err);
    if (am_comm_ctx_aborted(c->ctx))
        return am_comm_fail_aborted(c);
    return 0;
}

/* The backend failed the call in progress: the group is broken, its message repeated. */
static void break_group(struct am_comm *c)
{
    c->broken = 1;
    snprintf(c->first_err, sizeof(c->first_err), "%s", c->err);
}

/* Ends flight entry id (0: none) with the outcome of a call that returned rc. */
static void flight_end(struct am_comm *c, uint64_t id, int rc)
{
    if (!id)
        return;
    enum am_flight_state st = AM_FLIGHT_COMPLETED;
    if (rc < 0)
        st = c->timed_out ? AM_FLIGHT_TIMED_OUT : am_comm_ctx_aborted(c->ctx) ? AM_FLIGHT_ABORTED : AM_FLIGHT_FAILED;
    am_flight_end(c->ctx->flight, id, st);
}

/* Room for one more pending send, before the isend is posted (so that a posted send is
 * never lost for want of memory). */
static int reserve_pending(struct am_comm *c)
{
    if (c->n_pending < c->cap_pending)
        return 0;
    size_t cap = c->cap_pending ? 2 * c->cap_pending : 16;
    struct am_comm_pending *p = realloc(c->pending, cap * sizeof(*p));
    if (!p)
        return am_comm_fail(c, "failed: out of memory for %zu pending sends", cap);
    c->pending = p;
    c->cap_pending = cap;
    return 0;
}

/* One call: numbered, recorded, refused or run. A posted isend joins c->pending with its
 * flight entry still open; every other call ends its entry here. */
static int run_call(struct am_comm *c, struct am_comm_call *call)
{
    int collective = call->kind != AM_CALL_SEND && call->kind != AM_CALL_ISEND && call->kind != AM_CALL_RECV &&
                     call->kind != AM_CALL_STREAM_WAIT;
    if (call->kind == AM_CALL_SEND || call->kind == AM_CALL_ISEND)
        call->seq = ++c->sent[call->peer];
    else if (call->kind == AM_CALL_RECV)
        call->seq = ++c->received[call->peer];
    else if (call->kind == AM_CALL_STREAM_WAIT)
        call->seq = c->seq; /* the group's last collective: what the wait is after */
    else
        call->seq = ++c->seq;
    c->call = call;
    c->timed_out = 0;
    c->flight_id = c->ctx->flight ? flight_begin(c, call) : 0;
    int rc = refused(c);
    if (rc == 0) {
        if (call->kind == AM_CALL_ISEND && reserve_pending(c) < 0)
            rc = -1;
        else
            rc = collective && c->kill_seq == call->seq      ? am_comm_die()
                 : collective && c->stall_seq == call->seq     ? am_comm_stall(c)
                 : call->kind == AM_CALL_STREAM_WAIT             ? c->ctx->ops->stream_wait(c)
                                                                 : c->ctx->ops->run(c, call);
        if (rc < 0)
            break_group(c);
    }
    if (rc == 0 && call->kind == AM_CALL_ISEND) {
        c->pending[c->n_pending++] = (struct am_comm_pending){.call = *call, .flight_id = c->flight_id};
        if (c->flight_id)
            am_flight_post(c->ctx->flight, c->flight_id);
    } else
        flight_end(c, c->flight_id, rc);
    return rc;
}

/* am_send_wait(_keep): each pending send in turn, oldest first, but the newest call->count,
 * is waited for (c->call names it in messages, c->flight_id is its entry) and its flight
 * entry ended; after the first failure all others are given up (entries failed, or aborted),
 * and the message stays the first failure's. Then the backend forgets the ones done. With
 * nothing to wait for: only the refusal rules. */
static int wait_pending(struct am_comm *c, const struct am_comm_call *call)
{
    c->call = call;
    c->timed_out = 0;
    size_t keep = call->count;
    if (c->n_pending <= keep)
        return refused(c);
    size_t n = c->n_pending - keep;
    int rc = 0;
    for (size_t i = 0; i < c->n_pending; i++) {
        if (i >= n && rc == 0)
            break;
        const struct am_comm_pending *p = &c->pending[i];
        if (rc == 0) {
            c->call = &p->call;
            c->flight_id = p->flight_id;
            if (p->flight_id) /* the rank waits for it from now: the watchdog times it */
                am_flight_start(c->ctx->flight, p->flight_id);
            rc = refused(c);
            if (rc == 0 && (rc = c->ctx->ops->send_wait(c, i)) < 0)
                break_group(c);
            flight_end(c, p->flight_id, rc);
            c->timed_out = 0; /* the sends given up after it did not time out themselves */
        } else {
            flight_end(c, p->flight_id, -1);
        }
    }
    if (rc < 0)
        n = c->n_pending;
    c->ctx->ops->send_drop(c, n);
    memmove(c->pending, c->pending + n, (c->n_pending - n) * sizeof(*c->pending));
    c->n_pending -= n;
    return rc;
}

/* The one place every checked call passes: numbering, the flight recorder (before run()
 * and after, with its outcome; an isend's entry stays open until am_send_wait ends it), the
 * broken-group and aborted-context rules, the backend, and the time spent (busy_s). */
static int am_comm_dispatch(struct am_comm *c, struct am_comm_call *call)
{
    double t0 = am_comm_now();
    int rc = call->kind == AM_CALL_SEND_WAIT ? wait_pending(c, call) : run_call(c, call);
    c->ctx->busy_s += am_comm_now() - t0;
    c->flight_id = 0;
    c->call = NULL;
    return rc;
}

static int check_common(struct am_comm *c, const char *k, enum am_dtype t)
{
    if ((unsigned)t > AM_F64)
        return arg_fail(c, k, "dtype %d is not one of fp32, bf16, fp16, int32, int64, fp64", (int)t);
    return 0;
}

static int check_op(struct am_comm *c, const char *k, enum am_dtype t, enum am_comm_op op)
{
    if (check_common(c, k, t) < 0)
        return -1;
    if ((unsigned)op > AM_AVG)
        return arg_fail(c, k, "reduction %d is not one of sum, max, avg", (int)op);
    return 0;
}

/* n elements of size es, times mult, in bytes; -1 on overflow. */
static int bytes_of(size_t n, size_t mult, size_t es, size_t *out)
{
    if (mult && n > SIZE_MAX / mult)
        return -1;
    n *= mult;
    if (n > (SIZE_MAX >> 1) / es)
        return -1;
    *out = n * es;
    return 0;
}

static int overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return alen && blen && x < y + blen && y < x + alen;
}

/* The checks of allreduce, reduce_scatter and allgather, blocking or not; fills *call. */
static int prep_allreduce(struct am_comm *c, struct am_comm_call *call, const void *send, void *recv, size_t count,
                          enum am_dtype t, enum am_comm_op op)
{
    const char *k = am_comm_name_of(call);
    size_t bytes;
    if (check_op(c, k, t, op) < 0)
        return -1;
    if (bytes_of(count, 1, am_dtype_size(t), &bytes) < 0)
        return arg_fail(c, k, "%zu %s elements overflow", count, am_dtype_name(t));
    if (count && (!send || !recv))
        return arg_fail(c, k, "%s buffer is NULL for %zu elements", !send ? "send" : "recv", count);
    if (send != recv && overlaps(send, bytes, recv, bytes))
        return arg_fail(c, k, "send and recv buffers overlap without being the same (in place: send == recv)");
    *call = (struct am_comm_call){.kind = call->kind, .nonblocking = call->nonblocking, .send = send, .recv = recv,
                                  .count = count, .dtype = t, .op = op, .bytes = bytes};
    return 0;
}

static int prep_reduce_scatter(struct am_comm *c, struct am_comm_call *call, const void *send, void *recv,
                               size_t count, enum am_dtype t, enum am_comm_op op)
{
    const char *k = am_comm_name_of(call);
    size_t bytes, full;
    if (check_op(c, k, t, op) < 0)
        return -1;
    size_t es = am_dtype_size(t);
    if (bytes_of(count, 1, es, &bytes) < 0 || bytes_of(count, (size_t)c->size, es, &full) < 0)
        return arg_fail(c, k, "%zu %s elements per rank times %d ranks overflow", count, am_dtype_name(t), c->size);
    if (count && (!send || !recv))
        return arg_fail(c, k, "%s buffer is NULL for %zu elements", !send ? "send" : "recv", count);
    if ((const char *)recv != (const char *)send + (size_t)c->rank * bytes && overlaps(send, full, recv, bytes))
        return arg_fail(c, k, "recv overlaps send without being its own block (in place: recv == send + rank * count)");
    *call = (struct am_comm_call){.kind = call->kind, .nonblocking = call->nonblocking, .send = send, .recv = recv,
                                  .count = count, .dtype = t, .op = op, .bytes = full};
    return 0;
}

static int prep_allgather(struct am_comm *c, struct am_comm_call *call, const void *send, void *recv, size_t count,
                          enum am_dtype t)
{
    const char *k = am_comm_name_of(call);
    size_t bytes, full;
    if (check_common(c, k, t) < 0)
        return -1;
    size_t es = am_dtype_size(t);
    if (bytes_of(count, 1, es, &bytes) < 0 || bytes_of(count, (size_t)c->size, es, &full) < 0)
        return arg_fail(c, k, "%zu %s elements per rank times %d ranks overflow", count, am_dtype_name(t), c->size);
    if (count && (!send || !recv))
        return arg_fail(c, k, "%s buffer is NULL for %zu elements", !send ? "send" : "recv", count);
    if ((const char *)send != (const char *)recv + (size_t)c->rank * bytes && overlaps(send, bytes, recv, full))
        return arg_fail(c, k, "send overlaps recv without being this rank's block (in place: send == recv + rank * count)");
    *call = (struct am_comm_call){.kind = call->kind, .nonblocking = call->nonblocking, .send = send, .recv = recv,
                                  .count = count, .dtype = t, .bytes = full};
    return 0;
}

int am_allreduce(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                 enum am_comm_op op, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_ALLREDUCE};
    int rc = !c || prep_allreduce(c, &call, send, recv, count, t, op) < 0 ? -1 : am_comm_dispatch(c, &call);
    return result(c, rc, err, err_len);
}

int am_reduce_scatter(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                      enum am_comm_op op, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_REDUCE_SCATTER};
    int rc = !c || prep_reduce_scatter(c, &call, send, recv, count, t, op) < 0 ? -1 : am_comm_dispatch(c, &call);
    return result(c, rc, err, err_len);
}

int am_allgather(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t, char *err,
                 size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_ALLGATHER};
    int rc = !c || prep_allgather(c, &call, send, recv, count, t) < 0 ? -1 : am_comm_dispatch(c, &call);
    return result(c, rc, err, err_len);
}

/* The checks of shift, blocking or not; fills *call. */
static int prep_shift(struct am_comm *c, struct am_comm_call *call, const void *send, void *recv, size_t count,
                      enum am_dtype t)
{
    const char *k = am_comm_name_of(call);
    size_t bytes;
    if (check_common(c, k, t) < 0)
        return -1;
    if (bytes_of(count, 1, am_dtype_size(t), &bytes) < 0)
        return arg_fail(c, k, "%zu %s elements overflow", count, am_dtype_name(t));
    if (count && (!send || !recv))
        return arg_fail(c, k, "%s buffer is NULL for %zu elements", !send ? "send" : "recv", count);
    if (overlaps(send, bytes, recv, bytes))
        return arg_fail(c, k, "send and recv buffers overlap (a shift reads one while the other is written)");
    *call = (struct am_comm_call){.kind = AM_CALL_SHIFT, .nonblocking = call->nonblocking, .send = send, .recv = recv,
                                  .count = count, .dtype = t, .bytes = bytes};
    return 0;
}

int am_shift(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t, char *err,
             size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_SHIFT};
    int rc = !c || prep_shift(c, &call, send, recv, count, t) < 0 ? -1 : am_comm_dispatch(c, &call);
    return result(c, rc, err, err_len);
}

static int alltoallv(struct am_comm *c, const void *send, const size_t *send_counts, const size_t *send_displs,
                     void *recv, const size_t *recv_counts, const size_t *recv_displs, enum am_dtype t)
{
    const enum am_comm_kind k = AM_CALL_ALLTOALLV;
    const char *nm = am_comm_call_name(k);
    if (!c)
        return -1;
    if (check_common(c, nm, t) < 0)
        return -1;
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return arg_fail(c, nm, "a count or displacement array is NULL");
    size_t es = am_dtype_size(t), total = 0;
    for (int j = 0; j < c->size; j++) {
        size_t end;
        if (send_displs[j] > SIZE_MAX - send_counts[j] || bytes_of(send_displs[j] + send_counts[j], 1, es, &end) < 0 ||
            recv_displs[j] > SIZE_MAX - recv_counts[j] || bytes_of(recv_displs[j] + recv_counts[j], 1, es, &end) < 0)
            return arg_fail(c, nm, "counts and displacements for group rank %d overflow", j);
        if ((send_counts[j] && !send) || (recv_counts[j] && !recv))
            return arg_fail(c, nm, "%s buffer is NULL but group rank %d has %zu elements", send_counts[j] && !send ? "send" : "recv",
                            j, send_counts[j] && !send ? send_counts[j] : recv_counts[j]);
        total += send_counts[j];
    }
    if (send && recv && send == recv)
        return arg_fail(c, nm, "in-place alltoallv (send == recv) is not supported");
    struct am_comm_call call = {.kind = k, .send = send, .recv = recv, .dtype = t, .send_counts = send_counts,
                                .send_displs = send_displs, .recv_counts = recv_counts, .recv_displs = recv_displs,
                                .bytes = total * es};
    return am_comm_dispatch(c, &call);
}

int am_alltoallv(struct am_comm *c, const void *send, const size_t *send_counts, const size_t *send_displs,
                 void *recv, const size_t *recv_counts, const size_t *recv_displs, enum am_dtype t, char *err,
                 size_t err_len)
{
    return result(c, alltoallv(c, send, send_counts, send_displs, recv, recv_counts, recv_displs, t), err, err_len);
}

static int broadcast(struct am_comm *c, void *buf, size_t count, enum am_dtype t, int root)
{
    const enum am_comm_kind k = AM_CALL_BROADCAST;
    const char *nm = am_comm_call_name(k);
    size_t bytes;
    if (!c)
        return -1;
    if (check_common(c, nm, t) < 0)
        return -1;
    if (root < 0 || root >= c->size)
        return arg_fail(c, nm, "root %d is outside the group's ranks 0..%d", root, c->size - 1);
    if (bytes_of(count, 1, am_dtype_size(t), &bytes) < 0)
        return arg_fail(c, nm, "%zu %s elements overflow", count, am_dtype_name(t));
    if (count && !buf)
        return arg_fail(c, nm, "buffer is NULL for %zu elements", count);
    struct am_comm_call call = {.kind = k, .recv = buf, .count = count, .dtype = t, .peer = root, .bytes = bytes};
    return am_comm_dispatch(c, &call);
}

int am_broadcast(struct am_comm *c, void *buf, size_t count, enum am_dtype t, int root, char *err, size_t err_len)
{
    return result(c, broadcast(c, buf, count, t, root), err, err_len);
}

static int p2p(struct am_comm *c, enum am_comm_kind k, const void *sbuf, void *rbuf, size_t count,
               enum am_dtype t, int peer)
{
    const char *nm = am_comm_call_name(k);
    size_t bytes;
    if (!c)
        return -1;
    if (check_common(c, nm, t) < 0)
        return -1;
    if (peer < 0 || peer >= c->size)
        return arg_fail(c, nm, "peer %d is outside the group's ranks 0..%d", peer, c->size - 1);
    if (peer == c->rank && k == AM_CALL_ISEND)
        return arg_fail(c, nm, "peer %d is this rank itself (nothing would receive it: a recv from itself is refused)",
                        peer);
    if (peer == c->rank)
        return arg_fail(c, nm, "peer %d is this rank itself (a blocking %s to itself never completes)", peer,
                        am_comm_call_name(k));
    if (bytes_of(count, 1, am_dtype_size(t), &bytes) < 0)
        return arg_fail(c, nm, "%zu %s elements overflow", count, am_dtype_name(t));
    if (count && !sbuf && !rbuf)
        return arg_fail(c, nm, "buffer is NULL for %zu elements", count);
    struct am_comm_call call = {.kind = k, .send = sbuf, .recv = rbuf, .count = count, .dtype = t, .peer = peer,
                                .bytes = bytes};
    return am_comm_dispatch(c, &call);
}

int am_send(struct am_comm *c, const void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len)
{
    return result(c, p2p(c, AM_CALL_SEND, buf, NULL, count, t, peer), err, err_len);
}

int am_recv(struct am_comm *c, void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len)
{
    return result(c, p2p(c, AM_CALL_RECV, NULL, buf, count, t, peer), err, err_len);
}

int am_isend(struct am_comm *c, const void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len)
{
    return result(c, p2p(c, AM_CALL_ISEND, buf, NULL, count, t, peer), err, err_len);
}

int am_send_wait_keep(struct am_comm *c, size_t keep, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_SEND_WAIT, .count = keep};
    return result(c, c ? am_comm_dispatch(c, &call) : -1, err, err_len);
}

int am_send_wait(struct am_comm *c, char *err, size_t err_len) { return am_send_wait_keep(c, 0, err, err_len); }

int am_comm_set_stream_after(struct am_comm *c, void *after, char *err, size_t err_len)
{
    if (!c || !c->ctx->ops->stream_after)
        return 0;
    c->call = NULL;
    if (c->ctx->ops->stream_after(c, after) < 0)
        return result(c, -1, err, err_len);
    return 0;
}

int am_comm_stream_wait(struct am_comm *c, char *err, size_t err_len)
{
    if (!c || !c->ctx->ops->stream_wait || !c->stream)
        return 0; /* UCX, or nothing enqueued on a stream of the caller's: nothing to wait for */
    struct am_comm_call call = {.kind = AM_CALL_STREAM_WAIT};
    return result(c, am_comm_dispatch(c, &call), err, err_len);
}

int am_barrier(struct am_comm *c, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_BARRIER};
    return result(c, c ? am_comm_dispatch(c, &call) : -1, err, err_len);
}

/* ---- non-blocking collectives ----------------------------------------------------------- */

/* Room for one more request of the group, before anything is numbered or started. */
static int reserve_req(struct am_comm *c)
{
    if (c->n_reqs < c->cap_reqs)
        return 0;
    size_t cap = c->cap_reqs ? 2 * c->cap_reqs : 16;
    struct am_comm_req **v = realloc(c->reqs, cap * sizeof(*v));
    if (!v)
        return -1;
    c->reqs = v;
    c->cap_reqs = cap;
    return 0;
}

/* A checked non-blocking collective: numbered like a blocking one, recorded (posted once the
 * backend started it), started; the request joins the group's list. */
static int issue_call(struct am_comm *c, struct am_comm_call *call, struct am_comm_req **out)
{
    struct am_comm_req *q = calloc(1, sizeof(*q));
    if (!q || reserve_req(c) < 0) {
        free(q);
        return arg_fail(c, am_comm_name_of(call), "out of memory for a request");
    }
    call->seq = ++c->seq;
    c->call = call;
    c->timed_out = 0;
    c->flight_id = c->ctx->flight ? flight_begin(c, call) : 0;
    q->c = c;
    q->call = *call;
    q->flight_id = c->flight_id;
    q->stall = c->stall_seq == call->seq;
    atomic_init(&q->waiting_for, -1);
    int rc = refused(c);
    if (rc == 0 && (rc = c->ctx->ops->start(c, q)) < 0)
        break_group(c);
    if (rc < 0) {
        flight_end(c, q->flight_id, rc);
        free(q);
        return -1;
    }
    if (q->flight_id)
        am_flight_post(c->ctx->flight, q->flight_id);
    c->reqs[c->n_reqs++] = q;
    *out = q;
    return 0;
}

static int issue(struct am_comm *c, struct am_comm_call *call, struct am_comm_req **out)
{
    double t0 = am_comm_now();
    int rc = issue_call(c, call, out);
    c->ctx->busy_s += am_comm_now() - t0;
    c->flight_id = 0;
    c->call = NULL;
    return rc;
}

/* The request's outcome, once the backend reports it complete: the group broken on a failure
 * (its message in c->err), the flight entry ended; then the request is released. */
static int finish_req(struct am_comm *c, struct am_comm_req *q)
{
    int rc = q->rc;
    if (rc < 0) {
        c->timed_out = q->timed_out;
        if (!c->broken)
            break_group(c);
    }
    flight_end(c, q->flight_id, rc);
    c->ctx->ops->req_drop(c, q);
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i] == q) {
            memmove(c->reqs + i, c->reqs + i + 1, (c->n_reqs - i - 1) * sizeof(*c->reqs));
            c->n_reqs--;
            break;
        }
    free(q);
    return rc;
}

/* Waits for (block) or tests q: 1 and its result in *rc when complete (q released), else 0. */
static int complete_req(struct am_comm_req *q, int block, int *rc)
{
    struct am_comm *c = q->c;
    double t0 = am_comm_now();
    c->call = &q->call;
    c->flight_id = q->flight_id;
    c->timed_out = 0;
    if (block && q->flight_id) /* the rank waits for it from now: the watchdog times it */
        am_flight_start(c->ctx->flight, q->flight_id);
    int done = block ? (c->ctx->ops->req_wait(c, q), 1) : c->ctx->ops->req_test(c, q);
    if (done)
        *rc = finish_req(c, q);
    c->ctx->busy_s += am_comm_now() - t0;
    c->flight_id = 0;
    c->call = NULL;
    return done;
}

/* The checks every non-blocking call starts with: *req cleared, the group and the request
 * pointer present (op names the call in the message). */
static int req_ok(struct am_comm *c, struct am_comm_req **req, const char *op)
{
    if (req)
        *req = NULL;
    if (!c)
        return -1;
    if (!req)
        return arg_fail(c, op, "the request pointer is NULL");
    return 0;
}

int am_iallreduce(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                  enum am_comm_op op, struct am_comm_req **req, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_ALLREDUCE, .nonblocking = 1};
    int rc = req_ok(c, req, "iallreduce") < 0 || prep_allreduce(c, &call, send, recv, count, t, op) < 0
                 ? -1 : issue(c, &call, req);
    return result(c, rc, err, err_len);
}

int am_ireduce_scatter(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                       enum am_comm_op op, struct am_comm_req **req, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_REDUCE_SCATTER, .nonblocking = 1};
    int rc = req_ok(c, req, "ireduce_scatter") < 0 || prep_reduce_scatter(c, &call, send, recv, count, t, op) < 0
                 ? -1 : issue(c, &call, req);
    return result(c, rc, err, err_len);
}

int am_iallgather(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                  struct am_comm_req **req, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_ALLGATHER, .nonblocking = 1};
    int rc = req_ok(c, req, "iallgather") < 0 || prep_allgather(c, &call, send, recv, count, t) < 0
                 ? -1 : issue(c, &call, req);
    return result(c, rc, err, err_len);
}

int am_ishift(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
              struct am_comm_req **req, char *err, size_t err_len)
{
    struct am_comm_call call = {.kind = AM_CALL_SHIFT, .nonblocking = 1};
    int rc = req_ok(c, req, "ishift") < 0 || prep_shift(c, &call, send, recv, count, t) < 0 ? -1 : issue(c, &call, req);
    return result(c, rc, err, err_len);
}

int am_comm_wait(struct am_comm_req *req, char *err, size_t err_len)
{
    int rc = 0;
    struct am_comm *c = req ? req->c : NULL; /* outlives the request */
    if (req)
        complete_req(req, 1, &rc);
    return result(c, rc, err, err_len);
}

int am_comm_test(struct am_comm_req *req, int *done, char *err, size_t err_len)
{
    int rc = 0, d = 1;
    struct am_comm *c = req ? req->c : NULL;
    if (req)
        d = complete_req(req, 0, &rc);
    if (done)
        *done = d;
    return result(c, rc, err, err_len);
}

int am_comm_wait_all(struct am_comm_req **reqs, size_t n, char *err, size_t err_len)
{
    int rc = 0;
    for (size_t i = 0; reqs && i < n; i++) {
        if (am_comm_wait(reqs[i], err, err_len) < 0)
            rc = -1;
        reqs[i] = NULL;
    }
    return rc;
}
