/* flight.h - the flight recorder: the last N communication calls of this rank.
 *
 * A ring of N entries (AM_FLIGHT_RECORDER_SIZE, default 1024), one per collective or
 * point-to-point call, recorded by the communicators' front (comm.c, am_comm_dispatch) for
 * every call: the group (name and id, the same on every rank), the call's sequence number
 * in the group (collectives; for send/recv the number of the message between the pair, in
 * that direction), the operation, dtype, element count and bytes, the peer (global rank:
 * send/recv's peer, broadcast's root), the peer the call is waiting for at the moment (set by
 * the backend while it waits), the state, and three times:
 *
 *   enqueued   the front accepted the call
 *   started    the backend began it (UCX: at once; a device backend: when the stream runs it)
 *   ended      it returned (completed, failed, timed out or aborted)
 *
 * Times are CLOCK_MONOTONIC readings, immune to clock steps; the recorder keeps one anchor
 * (a CLOCK_REALTIME and a CLOCK_MONOTONIC reading taken together at init), and the dump writes
 * every time as wall-clock seconds, anchor_wall + (t - anchor_mono), so that the logs of
 * different hosts can be put on one time line (docs/diagnostics.md says how far to trust it).
 *
 * Threads: one thread records (the thread that calls the communicators: calls on a context
 * come from one thread at a time); any thread and any signal handler may read. Each entry
 * carries a version counter (odd while it is being written) so that a reader copies an
 * entry whole or sees that it was changing; recording takes no lock and never allocates.
 * am_flight_dump is async-signal-safe: the crash handler calls it.
 *
 * The dump, one JSON line per entry, oldest first (docs/diagnostics.md, "flight"):
 *   {"type":"flight","id":41,"group":"dp","gid":0,"seq":21,"op":"allreduce","dtype":"fp32",
 *    "count":217664,"bytes":870656,"redop":"sum","peer":null,"state":"started",
 *    "enqueued":1767000000.123456,"started":1767000000.123460,"ended":null,"waiting_for":3}
 */
#ifndef AM_FLIGHT_H
#define AM_FLIGHT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define AM_FLIGHT_DEFAULT_SIZE 1024
#define AM_FLIGHT_MAX_SIZE (1 << 20)
#define AM_FLIGHT_GROUP_LEN 32

enum am_flight_state {
    AM_FLIGHT_FREE = 0,     /* slot never used */
    AM_FLIGHT_ISSUED,       /* accepted, not started */
    AM_FLIGHT_STARTED,      /* running */
    AM_FLIGHT_COMPLETED,
    AM_FLIGHT_FAILED,       /* the backend reported an error */
    AM_FLIGHT_TIMED_OUT,    /* a wait expired, or the watchdog gave up on it */
    AM_FLIGHT_ABORTED,      /* failed because the context was aborted (am_comm_ctx_abort) */
    AM_FLIGHT_POSTED,       /* an isend or a non-blocking collective under way while the rank
                               goes on: nothing waits for it until am_send_wait (am_comm_wait),
                               which starts it again (started = when the rank began to wait
                               for it) */
};

/* What the front knows of a call. op, dtype and redop must be static strings (the
 * recorder keeps the pointers); group is copied. */
struct am_flight_op {
    const char *op;         /* "allreduce", "send", ... */
    const char *dtype;      /* "fp32", ... */
    const char *redop;      /* "sum", ... or NULL for calls without a reduction */
    const char *group;
    int gid;                /* group id: the same on every rank */
    uint64_t seq;
    uint64_t count, bytes;
    int peer;               /* global rank, -1: none */
};

struct am_flight_entry {
    _Atomic unsigned version; /* odd while the recording thread writes the entry */
    uint64_t id;            /* 1, 2, ... over the process; 0: free slot */
    const char *op, *dtype, *redop;
    char group[AM_FLIGHT_GROUP_LEN];
    int gid;
    uint64_t seq, count, bytes;
    int peer, waiting_for;  /* global ranks, -1: none */
    double enqueued, started, ended; /* monotonic seconds; 0: not yet */
    int state;              /* enum am_flight_state */
};

/* A reader's copy of an entry (no version counter). */
struct am_flight_view {
    uint64_t id;
    const char *op, *dtype, *redop;
    char group[AM_FLIGHT_GROUP_LEN];
    int gid;
    uint64_t seq, count, bytes;
    int peer, waiting_for;
    double enqueued, started, ended;
    int state;
};

struct am_flight {
    struct am_flight_entry *ring;
    size_t cap;
    uint64_t next_id;               /* written by the recording thread only */
    _Atomic uint64_t newest;        /* id of the newest entry, 0: none */
    _Atomic uint64_t timed_out_id;  /* the entry the watchdog gave up on (dumped as timed_out) */
    double anchor_wall, anchor_mono;
};

/* The ring size from AM_FLIGHT_RECORDER_SIZE (unset or empty: the default). Returns 0 and
 * sets *size, or -1 with a message naming the variable, the rule and the fix. */
int am_flight_size_from_env(size_t *size, char *err, size_t err_len);
/* Allocates the ring (calloc; every slot free) and takes the time anchor. 0, or -1. */
int am_flight_init(struct am_flight *f, size_t cap, char *err, size_t err_len);
void am_flight_free(struct am_flight *f);

/* Recording (the one recording thread). begin returns the entry's id (never 0). */
uint64_t am_flight_begin(struct am_flight *f, const struct am_flight_op *op);
void am_flight_start(struct am_flight *f, uint64_t id);
void am_flight_waiting(struct am_flight *f, uint64_t id, int global_rank); /* -1: not waiting */
void am_flight_post(struct am_flight *f, uint64_t id); /* started -> posted (an isend returned) */
void am_flight_end(struct am_flight *f, uint64_t id, enum am_flight_state state);

/* Reading (any thread). Copies entry `id`; 0 when it is no longer in the ring (or is
 * being rewritten), 1 when copied. */
int am_flight_get(const struct am_flight *f, uint64_t id, struct am_flight_view *out);
/* The oldest entry still issued or started (the one a watchdog times; posted isends do not
 * block the rank and are passed over): 1 and a copy, or 0. */
int am_flight_oldest_inflight(const struct am_flight *f, struct am_flight_view *out);
/* The watchdog gave up on entry id: dumps show it as timed_out while it is still running. */
void am_flight_mark_timed_out(struct am_flight *f, uint64_t id);

/* Monotonic seconds (CLOCK_MONOTONIC), and that reading on the wall clock by the anchor. */
double am_flight_now(void);
double am_flight_wall(const struct am_flight *f, double mono);
const char *am_flight_state_name(int state);

/* One entry as a JSON line (with '\n') in buf; async-signal-safe. Returns the length; a
 * line that does not fit is cut (still ends with '\n'). */
size_t am_flight_format(const struct am_flight *f, const struct am_flight_view *e, char *buf, size_t cap);
/* Every entry, oldest first, to fd, whole lines per write(); async-signal-safe. Returns the
 * number of entries written, or -1 when a write failed. A NULL recorder writes nothing. */
long am_flight_dump(const struct am_flight *f, int fd);

#endif
