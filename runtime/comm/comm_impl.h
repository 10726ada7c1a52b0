/* comm_impl.h - private to the communicators: the generic front (comm.c), its backends
 * (comm_ucx.c, comm_nccl.c) and the host reductions (comm_reduce.c). Nothing outside
 * runtime/comm/ includes this file (but the tests of tests/comm/).
 *
 * Every public operation is checked by the front, described in one struct am_comm_call,
 * numbered (the group's sequence number) and handed to am_comm_dispatch(), the one place
 * every call passes: it records the call in the context's flight recorder (flight.h) before
 * and after the backend's run(), times it (busy_s), and refuses calls on an aborted context.
 * Non-blocking sends (am_isend) pass it twice: run() posts the send and its flight entry stays
 * open; am_send_wait waits for each pending send in turn (send_wait()), ends its entry and
 * hands the list back to the backend (send_drop()).
 * Non-blocking collectives (am_iallreduce, ...) are numbered like blocking ones, recorded
 * "posted" and handed to the backend's start(), which returns at once with the operation under
 * way (UCX: queued to the context's communication thread, which runs them one at a time, in
 * issue order, with the blocking algorithms on a second worker; NCCL: enqueued on the group's
 * communication stream). am_comm_wait/test end them (req_wait, req_test) and release them.
 * While a backend waits it names the peer it waits for (am_comm_waiting), and its waits give
 * up at once when another thread aborts the context (am_comm_ctx_aborted).
 * A backend reports a failure with am_comm_fail(), which prefixes the message with the
 * call ("allreduce #17 on group dp (4 ranks) ..."); after a failure the group is broken
 * and every later call on it fails at once, repeating the first error. c->err (ctx->err for
 * the context's own calls: ctx_init, create_groups) is only how a backend hands its message
 * to the front: the public call copies it into the caller's err as it returns (comm.h).
 */
#ifndef AM_COMM_IMPL_H
#define AM_COMM_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "comm.h"
#include "flight.h"
#include "half.h"

#define AM_COMM_NAME_LEN 32

enum am_comm_kind {
    AM_CALL_ALLREDUCE,
    AM_CALL_REDUCE_SCATTER,
    AM_CALL_ALLGATHER,
    AM_CALL_ALLTOALLV,
    AM_CALL_BROADCAST,
    AM_CALL_SEND,
    AM_CALL_RECV,
    AM_CALL_BARRIER,
    AM_CALL_ISEND,              /* run() posts the send and returns; see send_wait */
    AM_CALL_SEND_WAIT,          /* the front's own: never handed to run() */
    AM_CALL_STREAM_WAIT,        /* am_comm_stream_wait: the backend's stream_wait, not run() */
    AM_CALL_SHIFT,              /* am_shift: to group rank + 1, from group rank - 1 (a collective) */
};

/* One operation, as the caller asked for it. */
struct am_comm_call {
    enum am_comm_kind kind;
    const void *send;
    void *recv;                 /* broadcast: the buffer; send: NULL */
    size_t count;               /* elements (per rank for reduce_scatter and allgather) */
    enum am_dtype dtype;
    enum am_comm_op op;         /* reductions only */
    int peer;                   /* broadcast: root; send/isend/recv: the peer (group ranks) */
    const size_t *send_counts, *send_displs, *recv_counts, *recv_displs; /* alltoallv */
    uint64_t seq;               /* collectives: the group's sequence number of this call (1, 2,
                                 * ...), the same on every rank; send/isend/recv: the number of
                                 * this message between this rank and the peer, in that
                                 * direction (sends and isends share one count); send_wait: 0 */
    size_t bytes;               /* payload size for logs: what this rank sends or holds */
    int nonblocking;            /* am_iallreduce & co: named "iallreduce", ... */
};

/* A non-blocking collective (comm.h's struct am_comm_req): the call as issued, its flight
 * entry (posted until a wait starts it again), and, once the front knows it, its result. */
struct am_comm_req {
    struct am_comm *c;
    struct am_comm_call call;
    uint64_t flight_id;         /* 0: no recorder */
    int stall;                  /* am_comm_inject_stall chose this call */
    /* written by the backend before it reports completion (UCX: the communication thread,
     * under its lock), read by the front after */
    int rc;                     /* 0, or -1 with err */
    int timed_out;
    char err[AM_COMM_ERR_LEN];
    _Atomic int waiting_for;    /* the group rank the backend waits for, -1: none */
    void *be;                   /* the backend's per-request state */
};

/* A send started by am_isend: the call as posted (the message names it) and its flight
 * entry, open until am_send_wait ends it. */
struct am_comm_pending {
    struct am_comm_call call;
    uint64_t flight_id;         /* 0: no recorder */
};

struct am_comm_ops {
    const char *name;
    /* Sets ctx->be. Collective over all ranks of the job (it may use the bootstrap). */
    int (*ctx_init)(struct am_comm_ctx *ctx, int device);
    void (*ctx_fini)(struct am_comm_ctx *ctx);
    /* groups[g] is this rank's group g (front fields filled in) or NULL when the rank is not
     * a member; sets groups[g]->be. Collective over all ranks, like am_comm_create_groups. */
    int (*create_groups)(struct am_comm_ctx *ctx, int n_groups, struct am_comm **groups);
    void (*destroy)(struct am_comm *c);
    /* Runs one checked call; count > 0 and group size > 1 are NOT guaranteed. AM_CALL_ISEND:
     * starts the send and returns without waiting for the peer; the backend keeps it (a copy
     * of what it needs: call is valid during run() only), after the ones before it, until
     * send_drop. */
    int (*run)(struct am_comm *c, const struct am_comm_call *call);
    /* Waits for pending send i (0: the oldest still kept; c->call is that send's call). The
     * front asks for i = 0, 1, ... in turn and stops at the first failure; the wait follows
     * the rules of every wait (timeout, abort, the peer named). */
    int (*send_wait)(struct am_comm *c, size_t i);
    /* Forgets the oldest n pending sends (the others stay, oldest first): after am_send_wait
     * (they completed, or the group failed and the rest are given up). Nothing of them may be
     * written or waited for later. destroy() drops the ones still kept itself. */
    void (*send_drop)(struct am_comm *c, size_t n);
    /* Non-blocking collectives. start: q->call is checked and numbered; starts it and returns
     * without waiting for any peer (0), or fails (-1, c->err) with nothing started. req_test:
     * 1 when q is complete (q->rc says how; on failure c->err says why), else 0; never blocks.
     * req_wait: waits until q is complete (the rules of every wait: timeout, abort, the peer
     * named in the flight entry, c->flight_id), then as req_test. req_drop: forgets q, complete
     * or not (am_comm_destroy gives up requests never waited for; UCX waits for the one the
     * thread is running). Requests of one group complete in the order they were started. */
    int (*start)(struct am_comm *c, struct am_comm_req *q);
    int (*req_test)(struct am_comm *c, struct am_comm_req *q);
    int (*req_wait)(struct am_comm *c, struct am_comm_req *q);
    void (*req_drop)(struct am_comm *c, struct am_comm_req *q);
    /* NCCL only (NULL in UCX). stream_after: the group takes a stream of its own that waits
     * for `after` before each call (am_comm_set_stream_after; 0, or -1 with c->err).
     * stream_wait: waits on the host for everything enqueued on the group's stream (c->call is
     * the AM_CALL_STREAM_WAIT; the rules of every wait). */
    int (*stream_after)(struct am_comm *c, void *after);
    int (*stream_wait)(struct am_comm *c);
};

struct am_comm_ctx {
    const struct am_comm_ops *ops;
    enum am_comm_backend backend;
    struct am_boot *boot;
    struct am_boot_info info;
    double timeout_s;
    int n_groups;               /* groups created so far: ids for the next ones start here */
    void *be;                   /* the backend's per-process state */
    char err[AM_COMM_ERR_LEN];
    struct am_flight *flight;   /* the flight recorder, or NULL */
    char **hosts;               /* host of each global rank (n_hosts of them), or NULL */
    int n_hosts;
    double busy_s;              /* seconds inside calls so far (the calling thread's) */
    _Atomic int aborted;        /* am_comm_ctx_abort was called (any thread) */
    char abort_reason[256];     /* written before `aborted` is set */
};

struct am_comm {
    struct am_comm_ctx *ctx;
    int id;                     /* index over every group created in ctx, same on all ranks */
    char name[AM_COMM_NAME_LEN];
    int rank, size;
    int *ranks;                 /* global rank of each group rank */
    uint64_t seq;               /* collectives issued */
    uint64_t *sent, *received;  /* per group rank: messages sent to it, received from it */
    struct am_comm_pending *pending; /* am_isend's sends not yet completed by am_send_wait, */
    size_t n_pending, cap_pending;   /* oldest first (the backend keeps them in that order) */
    struct am_comm_req **reqs;  /* non-blocking collectives not yet waited for, oldest first */
    size_t n_reqs, cap_reqs;
    _Atomic int *waiting_out;   /* UCX's communication thread: its copy of the group publishes
                                 * the peer it waits for here (the request's), not in the
                                 * flight recorder, which only the calling thread writes */
    void *stream;               /* NCCL: cudaStream_t */
    const struct am_comm_call *call; /* the call in progress, for messages */
    int broken;
    int timed_out;              /* the backend's last failure was a timeout */
    uint64_t flight_id;         /* the call in progress in the flight recorder, 0: none */
    uint64_t stall_seq;         /* am_comm_inject_stall: the collective that blocks, 0: none */
    uint64_t kill_seq;          /* am_comm_inject_kill: the collective inside which the process dies, 0: none */
    void *be;                   /* the backend's per-group state */
    char err[AM_COMM_ERR_LEN];
    char first_err[AM_COMM_ERR_LEN];
};

/* Records "<op> #<seq> on group <name> (<n> ranks) <fmt...>" in c->err; returns -1. */
int am_comm_fail(struct am_comm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Records a context-level message in ctx->err; returns -1. */
int am_comm_ctx_fail(struct am_comm_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *am_comm_call_name(enum am_comm_kind k);
/* The name of a call as messages and the flight recorder show it ("iallreduce", "send"). */
const char *am_comm_name_of(const struct am_comm_call *call);
/* am_comm_inject_stall's hang: blocks until the context is aborted, then fails the call. */
int am_comm_stall(struct am_comm *c);
const char *am_comm_op_name(enum am_comm_op op);

/* The backend waits for group rank `peer` of the call in progress (-1: no longer waits):
 * the flight recorder shows it (waiting_for), and a watchdog's timeout names it. */
void am_comm_waiting(struct am_comm *c, int peer);
/* "rank 1 (global 5 on n3)" ("rank 1 (global 5)" without host names) in buf; returns buf. */
const char *am_comm_peer_text(const struct am_comm *c, int peer, char *buf, size_t len);
/* A backend's wait saw am_comm_ctx_abort: fails the call ("aborted: REASON"); returns -1. */
int am_comm_fail_aborted(struct am_comm *c);

/* Host reductions (comm_reduce.c: the UCX transport's), element-wise over n elements:
 * out = a (op) b; out may equal a or b. bf16 and fp16 are widened to fp32, combined, and
 * rounded back to nearest even. The combination is commutative bit for bit (max included),
 * so two ranks that combine the same pair in either order get the same bits. */
void am_comm_reduce(void *out, const void *a, const void *b, size_t n, enum am_dtype t, enum am_comm_op op);
/* AVG's last step: buf[i] /= divisor (integers truncate toward zero). */
void am_comm_scale(void *buf, size_t n, enum am_dtype t, int divisor);

/* Monotonic seconds. */
double am_comm_now(void);

extern const struct am_comm_ops am_comm_ucx_backend;
extern const struct am_comm_ops am_comm_nccl_backend;

#endif
