/* comm.h - communicators: one interface over two backends.
 *
 *   UCX  (AM_COMM_UCX):  host memory; UCP workers, endpoints to every peer created up front
 *                        from addresses exchanged through the bootstrap; ring (or better)
 *                        algorithms for the large collectives.
 *   NCCL (AM_COMM_NCCL): device memory; one communicator per group from a unique id shared
 *                        through the bootstrap, non-blocking, with async-error polling and
 *                        ncclCommAbort on timeout.
 *
 * Groups are created all at once, in one fixed order, on every rank (am_comm_create_groups):
 * lazily created communicators deadlock when ranks create them in different orders. Every
 * blocking wait has a timeout (the recipe's dist_env.timeout_minutes); when it expires the
 * call fails with a message naming the operation, the group, its sequence number and the peer
 * that did not answer, and the caller aborts the job. Every collective is counted per group (a
 * sequence number, the same on every rank of the group), so logs of different ranks can be
 * matched up; send and recv are counted per pair of ranks and direction instead ("send #3 to
 * rank 1 on group pp ..."), since the ranks of a group make different numbers of them. After a
 * failed call the group is broken: every later call on it fails at once, repeating the error.
 * Calls on one context come from one thread at a time.
 *
 * Point to point. am_send blocks until the peer takes the data (large messages go by
 * rendezvous), am_recv until the data is in. am_isend starts a send and returns; the sends it
 * starts are numbered with the blocking ones (one count per pair and direction: the peer's
 * am_recv calls take them in that order, whichever call sent them), progress inside every
 * later call on the context (a blocked am_recv, on any group, included) and complete in
 * am_send_wait, which waits for all of them (am_send_wait_keep: all but the newest few): a
 * pipeline stage can send its activations onward and then block receiving from another peer
 * without a deadlock. An isend appears in the flight recorder as "isend", "posted" while
 * nothing waits for it, started again when am_send_wait begins to wait for it and ended when
 * it completes. If a pending send fails, am_send_wait names it ("isend #4 to rank 2 on group pp ...
 * timed out ... waiting for rank 2 ...") and the group is broken. am_comm_destroy gives up
 * sends never waited for (UCX may still read their buffers until am_comm_ctx_fini).
 * NCCL differs where NCCL must: kernels of one communicator run in order and a send's
 * kernel waits for its receiver, so sends and receives that must progress together have to
 * be enqueued together. A pending send is enqueued at the next call on the context: in one
 * NCCL group with it when that call is a send or recv on the same group (whose wait then
 * covers the send too), before it otherwise (a collective on the group then runs after it;
 * a later receive on the group waits behind it on the device), and by am_send_wait (which,
 * NCCL telling no send's end from another's on one stream, waits for every enqueued one
 * even where am_send_wait_keep asks for the oldest only).
 * comm_nccl.c says which patterns that serves.
 *
 * Non-blocking collectives. am_iallreduce, am_ireduce_scatter and am_iallgather start the
 * collective and return a request (struct am_comm_req *); the buffers belong to it until
 * am_comm_wait returns (or am_comm_test reports it done). They compute exactly what the
 * blocking call computes (same algorithm, same order of reductions: the bits are identical)
 * and are numbered with the group's collective sequence number like blocking calls
 * ("iallreduce #17 on group dp ..."). Ranks must issue them in the same order on every rank
 * of every group, interleaved the same way across groups (as for blocking calls: one rank
 * runs them one after another), and requests of one group complete in issue order, whatever
 * order they are waited in. A blocking call made meanwhile, on their group or another, does
 * not wait for them: it runs beside them (UCX) or after them on the device (NCCL).
 *   UCX:  a communication thread per context runs the requests one at a time, in issue order
 *         over all groups, on a worker of its own (UCX's rule for workers on different threads
 *         of one context: mt_workers_shared), so they progress while the calling thread
 *         computes without calling in; blocking calls stay on the calling thread's worker.
 *   NCCL: enqueued on the group's communication stream after an event on the group's stream
 *         (the data is ready when that stream reaches the call), each ending with an event;
 *         am_comm_wait makes the group's stream (am_comm_set_stream) wait for that event and
 *         returns, or, without a stream, waits on the host.
 * In the flight recorder a request is "posted" while nothing waits for it, started again when
 * am_comm_wait begins to wait for it (the watchdog times it from there) and ended when the wait
 * or a test finds it complete. A failed request breaks its group like a failed call; its wait
 * says why (the call, the group, the sequence number, the peer).
 *
 * Counts are in elements. `count` may be 0. For reduce_scatter and allgather, `count` is
 * the per-rank block: the full buffer holds count * group size elements. In-place
 * operation is allowed where send == recv (allreduce), or send == recv + rank * count
 * (allgather), or recv == send + rank * count (reduce_scatter).
 * Errors: the runtime's convention (util.h). Every call that can fail takes `char *err, size_t
 * err_len` last and returns 0, or -1 with one message written there that names the call, the
 * group and the rule or the peer: "allreduce #17 on group dp (4 ranks) timed out after 600 s
 * waiting for rank 3 (global 7 on n2)". A call on a broken group writes the refusal, which
 * repeats the group's first error. Nothing is kept for the caller to fetch later.
 */
#ifndef AM_COMM_H
#define AM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "bootstrap.h"
#include "dtype.h"

/* Room for the longest message a call writes into err (with its NUL). */
#define AM_COMM_ERR_LEN 640

enum am_comm_backend { AM_COMM_UCX, AM_COMM_NCCL };
enum am_comm_op { AM_SUM, AM_MAX, AM_AVG }; /* the dtypes: enum am_dtype (dtype.h) */

struct am_comm_ctx; /* one per process: the backend's worker or device, the bootstrap */
struct am_comm;     /* one group */

/* device: the CUDA device for NCCL, ignored by UCX. timeout_s bounds every wait. Collective
 * over all ranks of the job (UCX publishes its worker address through the bootstrap). */
struct am_comm_ctx *am_comm_ctx_init(enum am_comm_backend backend, struct am_boot *boot,
                                     const struct am_boot_info *info, int device, double timeout_s,
                                     char *err, size_t err_len);
void am_comm_ctx_fini(struct am_comm_ctx *ctx);
enum am_comm_backend am_comm_ctx_backend(const struct am_comm_ctx *ctx);

/* Diagnostics (docs/diagnostics.md).
 * set_flight: every later call on the context is recorded in the flight recorder f
 * (base/flight.h: group, sequence number, op, size, peer, times, state); NULL: none. The
 * recorder must outlive the context's calls.
 * set_hosts: host names by global rank (hosts[r] for r < n, copied), so that messages that
 * name a peer say where it runs: "waiting for rank 1 (global 5 on n3)". 0, or -1 (no memory).
 * abort: from any thread (a watchdog): every blocked call on the context fails at once (its
 * flight entry "aborted") and every later call fails, with a message ending in `reason`.
 * inject_stall: fault injection (AM_FAULT kind=hang-in-collective): the collective with
 * sequence number seq on group c blocks inside the call, after it started and before any
 * data moves, as a hung kernel or a dead link would, until the context is aborted. */
struct am_flight;
void am_comm_ctx_set_flight(struct am_comm_ctx *ctx, struct am_flight *f);
int am_comm_ctx_set_hosts(struct am_comm_ctx *ctx, const char *const *hosts, int n, char *err, size_t err_len);
void am_comm_ctx_abort(struct am_comm_ctx *ctx, const char *reason);
int am_comm_ctx_aborted(const struct am_comm_ctx *ctx);
void am_comm_inject_stall(struct am_comm *c, uint64_t seq);
/* inject_kill: fault injection (AM_FAULT kind=kill-in-alltoall): the process sends itself
 * SIGKILL inside the collective with sequence number seq on group c, a second after the call
 * started (its flight entry open; the group's other ranks by then in the call too) and before
 * any data moves, as a rank dying mid-exchange would. */
void am_comm_inject_kill(struct am_comm *c, uint64_t seq);
/* Seconds spent inside calls on the context so far (every group, every call, from its
 * start to its return): the trainer's per-step time in communication. For non-blocking
 * collectives only the calling thread's time counts: starting them, am_comm_test and the
 * time blocked in am_comm_wait; what runs in the background while the rank computes does
 * not (so busy_s is the time the rank was held up by communication). */
double am_comm_ctx_busy_s(const struct am_comm_ctx *ctx);

/* Creates n_groups groups at once; collective over ALL ranks of the job, which must pass
 * the same groups in the same order. groups[g] lists the global ranks of group g in group
 * order (a rank's index in it is its group rank); a rank not in group g gets out[g] = NULL.
 * names[g] ("tp", "dp", ...) appears in messages and logs. */
int am_comm_create_groups(struct am_comm_ctx *ctx, int n_groups, const int *const *groups,
                          const int *group_sizes, const char *const *names, struct am_comm **out, char *err,
                          size_t err_len);
void am_comm_destroy(struct am_comm *c);

int am_comm_rank(const struct am_comm *c); /* rank in the group */
int am_comm_size(const struct am_comm *c);
const char *am_comm_name(const struct am_comm *c);
uint64_t am_comm_seq(const struct am_comm *c); /* collectives issued on this group so far */

/* NCCL: the CUDA stream the operations are enqueued on (cudaStream_t); UCX ignores it. The
 * trainer gives every group the device context's compute stream (kernels.h, am_dev.stream):
 * a blocking call is then enqueued behind the kernels that wrote its buffers and the kernels
 * enqueued after it run after it (stream order, no event needed), and the call returns once it
 * completed (the host waits, watching NCCL's asynchronous errors, the timeout and aborts); a
 * non-blocking collective runs on the group's communication stream after an event recorded on
 * the compute stream, and am_comm_wait makes the compute stream wait for its end (no host
 * wait). Without a stream: the legacy default stream, which a non-blocking compute stream does
 * not order against. */
void am_comm_set_stream(struct am_comm *c, void *stream);

/* NCCL: the group enqueues on a stream of its own (made here), which waits before each call
 * for everything enqueued on `after` (the compute stream) so far; a blocking call's host wait
 * then orders what the host enqueues next on `after`. For the groups whose calls must not hold
 * the compute stream: pipeline send and recv (a send's kernel ends only when the peer receives,
 * and a compute stream stopped there could wait, through the peer, for itself). UCX: 0,
 * nothing. 0, or -1 with the message. */
int am_comm_set_stream_after(struct am_comm *c, void *after, char *err, size_t err_len);
/* NCCL, a group with a stream (am_comm_set_stream): waits on the host until that stream has
 * run everything enqueued so far, the non-blocking collectives whose end am_comm_wait left to
 * the device included, with the rules of every wait (timeout, NCCL's asynchronous errors,
 * aborts); recorded in the flight recorder as "stream_wait", numbered with the group's last
 * collective ("stream_wait #17 on group tp ... timed out ... waiting for iallreduce #15 to
 * complete on the device"). The trainer calls it once a step before the host reads results,
 * so that a collective that never completes on the device is a timeout with a name, not a
 * host stuck in a CUDA wait. UCX, or no stream: 0 at once, nothing recorded. */
int am_comm_stream_wait(struct am_comm *c, char *err, size_t err_len);

int am_allreduce(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                 enum am_comm_op op, char *err, size_t err_len);
int am_reduce_scatter(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                      enum am_comm_op op, char *err, size_t err_len);
int am_allgather(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t, char *err,
                 size_t err_len);
/* counts and displacements in elements, one per group rank */
int am_alltoallv(struct am_comm *c, const void *send, const size_t *send_counts, const size_t *send_displs,
                 void *recv, const size_t *recv_counts, const size_t *recv_displs, enum am_dtype t, char *err,
                 size_t err_len);
int am_broadcast(struct am_comm *c, void *buf, size_t count, enum am_dtype t, int root, char *err, size_t err_len);
int am_send(struct am_comm *c, const void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len);
int am_recv(struct am_comm *c, void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len);
/* Starts sending count elements of buf to group rank peer and returns without waiting for the
 * peer to take them; buf must not change until am_send_wait(c) (or am_send_wait_keep with
 * this send among the oldest) returns. Numbered with the
 * blocking sends (the same sequence per pair and direction, matched by the peer's am_recv in
 * order). Pending sends progress inside every later call on the context (a blocked am_recv
 * included), so ranks that only block in receives cannot deadlock on sends. */
int am_isend(struct am_comm *c, const void *buf, size_t count, enum am_dtype t, int peer, char *err, size_t err_len);
/* Waits for every send started with am_isend on c (bounded by the timeout like every wait);
 * 0, or -1 naming the first send that failed (its sequence number and peer). */
int am_send_wait(struct am_comm *c, char *err, size_t err_len);
/* The same for the oldest pending sends only, until at most `keep` are left: a rank that
 * sends from a ring of buffers waits for the send of the one it is about to reuse. */
int am_send_wait_keep(struct am_comm *c, size_t keep, char *err, size_t err_len);
int am_barrier(struct am_comm *c, char *err, size_t err_len);
/* Ring shift, a collective of the group (numbered like one, issued by every rank in the same
 * order): each rank sends count elements of send to group rank (rank + 1) % size and receives
 * count elements from (rank - 1 + size) % size into recv (context parallelism's ring passes
 * keys and values this way). send and recv must not overlap; on a group of one rank recv
 * receives a copy of send. am_ishift starts it as a non-blocking collective (below), so that
 * the exchange runs while the caller computes on the block it already holds. */
int am_shift(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t, char *err,
             size_t err_len);

/* Non-blocking collectives: the arguments, rules and results of the blocking calls; *req is
 * the request (NULL when the call fails: nothing started, err says why). */
struct am_comm_req;
int am_iallreduce(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                  enum am_comm_op op, struct am_comm_req **req, char *err, size_t err_len);
int am_ireduce_scatter(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                       enum am_comm_op op, struct am_comm_req **req, char *err, size_t err_len);
int am_iallgather(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
                  struct am_comm_req **req, char *err, size_t err_len);
int am_ishift(struct am_comm *c, const void *send, void *recv, size_t count, enum am_dtype t,
              struct am_comm_req **req, char *err, size_t err_len);
/* Waits for the request (bounded by the timeout like every wait; at once on an abort) and
 * releases it: 0, or -1 with err naming the call and the peer. NULL: 0. */
int am_comm_wait(struct am_comm_req *req, char *err, size_t err_len);
/* Never blocks: *done = 0 while the request runs (0 returned); *done = 1 when it is complete,
 * then it is released like am_comm_wait and the result returned (0 or -1, err). */
int am_comm_test(struct am_comm_req *req, int *done, char *err, size_t err_len);
/* am_comm_wait on reqs[0..n) in that order (NULL entries skipped), each set to NULL; all are
 * waited for even after a failure; 0, or -1 with err holding the message of the last request
 * that failed (a later request of a group that failed refuses, repeating the first error).
 * err may be NULL (err_len 0): the requests are released and the message dropped, for a
 * caller that already failed and only cleans up. */
int am_comm_wait_all(struct am_comm_req **reqs, size_t n, char *err, size_t err_len);

#endif
