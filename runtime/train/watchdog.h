/* watchdog.h - a thread that turns a stuck collective into a logged timeout and an abort.
 *
 * Every poll interval (a tenth of the timeout, 50 ms to 1 s) the watchdog looks at the
 * flight recorder's oldest call still in flight (flight.h). When it has run longer than the
 * timeout (dist_env.timeout_minutes, or AM_WATCHDOG_S seconds when set), the watchdog:
 *   1. marks the call timed out in the recorder;
 *   2. writes the rank's cause record, unless one was written already (crash.h):
 *        {"type":"cause","cause":"timeout","by":"watchdog","op":"allreduce","group":"dp",
 *         "gid":0,"seq":7,"count":217664,"bytes":870656,"waited_s":5.02,"timeout_s":5,
 *         "waiting_for":3,"waiting_for_host":"n2","rank":1,"step":4,"time":...,
 *         "message":"allreduce #7 on group dp: no progress for 5.02 s (timeout 5 s, AM_WATCHDOG_S);
 *                    waiting for rank 3 on n2"}
 *      followed by the flight recorder;
 *   3. aborts the communicators' context (am_comm_ctx_abort): the blocked call fails at once
 *      and the trainer ends the rank with a non-zero status (NCCL: the waiting call sees the
 *      abort and calls ncclCommAbort on its communicator; NCCL never says which peer it waits
 *      for, so the message says so instead of naming one, and am-diag finds the rank to blame
 *      from the flight recorders of the group's ranks, or says that it cannot);
 *   4. if the call has not returned after grace_s, says so on stderr and ends the process
 *      (_exit(1)): a call stuck where no abort reaches (a hung kernel) must not keep the rank.
 * It fires once, then only waits to be stopped.
 *
 * am_watchdog_comm_cause builds the same cause record for a call that failed by itself (the
 * trainer uses it when a communication call returns an error): cause "timeout" when the
 * backend's own wait expired, else "comm", with the backend's message.
 */
#ifndef AM_WATCHDOG_H
#define AM_WATCHDOG_H

#include <jansson.h>
#include <pthread.h>

#include "comm.h"
#include "flight.h"
#include "log.h"

struct am_watchdog {
    /* set by the caller before am_watchdog_start */
    struct am_flight *flight;
    struct am_comm_ctx *ctx;
    struct am_log *log;
    const char *const *hosts;   /* host of each global rank (n_hosts), or NULL */
    int n_hosts;
    int rank;
    double timeout_s;
    const char *timeout_from;   /* "AM_WATCHDOG_S" or "dist_env.timeout_minutes", for messages */
    double grace_s;             /* after the abort; 0: 5 s */
    /* the thread's */
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int running, stop, fired;
};

/* The timeout: AM_WATCHDOG_S (seconds, > 0) when set and not empty, else recipe_s. Sets
 * *from to the source's name. 0, or -1 with a message naming the variable and the rule. */
int am_watchdog_timeout(double recipe_s, double *out, const char **from, char *err, size_t err_len);
/* Starts the thread. 0, or -1 with a message. */
int am_watchdog_start(struct am_watchdog *w, char *err, size_t err_len);
/* Stops and joins the thread (safe when it never started). */
void am_watchdog_stop(struct am_watchdog *w);

/* The cause record of call v (flight recorder view): cause "timeout" or "comm", by
 * ("watchdog" or "backend"), the call, how long it waited, whom it waited for (and where),
 * the step (crash.h) and the message. A new reference. */
json_t *am_watchdog_comm_cause(const struct am_flight *f, const struct am_flight_view *v, const char *cause,
                               const char *by, double waited_s, double timeout_s, int rank,
                               const char *const *hosts, int n_hosts, const char *message);

#endif
