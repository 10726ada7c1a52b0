/* watchdog.c - the collective watchdog (watchdog.h). */
#include "watchdog.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "crash.h"

int am_watchdog_timeout(double recipe_s, double *out, const char **from, char *err, size_t err_len)
{
    const char *s = getenv("AM_WATCHDOG_S");
    *out = recipe_s;
    *from = "dist_env.timeout_minutes";
    if (!s || !*s)
        return 0;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v > 0) || v > 1e7) {
        snprintf(err, err_len, "AM_WATCHDOG_S=%.40s: the collective watchdog's timeout must be a positive number of "
                 "seconds (for example AM_WATCHDOG_S=30; unset: dist_env.timeout_minutes)", s);
        return -1;
    }
    *out = v;
    *from = "AM_WATCHDOG_S";
    return 0;
}

static const char *host_of(const char *const *hosts, int n, int rank)
{
    return hosts && rank >= 0 && rank < n && hosts[rank] && hosts[rank][0] ? hosts[rank] : NULL;
}

json_t *am_watchdog_comm_cause(const struct am_flight *f, const struct am_flight_view *v, const char *cause,
                               const char *by, double waited_s, double timeout_s, int rank,
                               const char *const *hosts, int n_hosts, const char *message)
{
    long step = am_crash_step();
    const char *wh = host_of(hosts, n_hosts, v->waiting_for);
    json_t *o = json_pack("{s:s,s:s,s:s,s:s,s:i,s:I,s:I,s:I,s:f,s:i,s:f}", "cause", cause, "by", by, "op",
                          v->op ? v->op : "?", "group", v->group, "gid", v->gid, "seq", (json_int_t)v->seq, "count",
                          (json_int_t)v->count, "bytes", (json_int_t)v->bytes, "waited_s", waited_s, "rank", rank,
                          "time", am_flight_wall(f, am_flight_now()));
    if (!o)
        return json_object();
    json_object_set_new(o, "timeout_s", timeout_s > 0 ? json_real(timeout_s) : json_null());
    json_object_set_new(o, "peer", v->peer >= 0 ? json_integer(v->peer) : json_null());
    json_object_set_new(o, "waiting_for", v->waiting_for >= 0 ? json_integer(v->waiting_for) : json_null());
    json_object_set_new(o, "waiting_for_host", wh ? json_string(wh) : json_null());
    json_object_set_new(o, "step", step > 0 ? json_integer(step) : json_null());
    json_object_set_new(o, "message", json_string(message ? message : ""));
    return o;
}

static double mono_now(void) { return am_flight_now(); }

/* Sleeps on the condition until `until` (monotonic) or a stop; returns 1 when stopped. */
static int wait_until(struct am_watchdog *w, double until)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double left = until - mono_now();
    if (left < 0)
        left = 0;
    ts.tv_sec += (time_t)left;
    ts.tv_nsec += (long)((left - (double)(time_t)left) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        int rc = pthread_cond_timedwait(&w->cond, &w->lock, &ts);
        if (rc == ETIMEDOUT)
            break;
    }
    int stop = w->stop;
    pthread_mutex_unlock(&w->lock);
    return stop;
}

static void fire(struct am_watchdog *w, const struct am_flight_view *v, double waited)
{
    char msg[768], wait[320] = "not waiting for any peer (stuck inside the call)";
    const char *wh = host_of(w->hosts, w->n_hosts, v->waiting_for);
    int nccl = w->ctx && am_comm_ctx_backend(w->ctx) == AM_COMM_NCCL;
    if (v->waiting_for >= 0)
        snprintf(wait, sizeof(wait), "waiting for rank %d%s%s", v->waiting_for, wh ? " on " : "", wh ? wh : "");
    else if (nccl)
        snprintf(wait, sizeof(wait), "inside NCCL, which does not tell which peer it waits for; aborting its "
                 "communicator (ncclCommAbort)");
    snprintf(msg, sizeof(msg), "%s #%llu on group %s: no progress for %.2f s (timeout %g s, %s); %s", v->op,
             (unsigned long long)v->seq, v->group, waited, w->timeout_s, w->timeout_from, wait);
    am_flight_mark_timed_out(w->flight, v->id);
    if (am_crash_report_begin()) {
        am_log_record(w->log, "cause", am_watchdog_comm_cause(w->flight, v, "timeout", "watchdog", waited, w->timeout_s,
                                                              w->rank, w->hosts, w->n_hosts, msg));
        am_crash_report_end();
    }
    fprintf(stderr, "am-train: rank %d: watchdog: %s; aborting the communicators\n", w->rank, msg);
    char reason[900];
    snprintf(reason, sizeof(reason), "the watchdog gave up on %s #%llu on group %s after %.2f s (%s)", v->op,
             (unsigned long long)v->seq, v->group, waited, w->timeout_from);
    am_comm_ctx_abort(w->ctx, reason);
}

static void *run(void *arg)
{
    struct am_watchdog *w = arg;
    double poll = w->timeout_s / 10;
    if (poll < 0.05)
        poll = 0.05;
    if (poll > 1)
        poll = 1;
    while (!wait_until(w, mono_now() + poll)) {
        struct am_flight_view v;
        if (!am_flight_oldest_inflight(w->flight, &v))
            continue;
        double since = v.started > 0 ? v.started : v.enqueued, waited = mono_now() - since;
        if (waited <= w->timeout_s)
            continue;
        fire(w, &v, waited);
        w->fired = 1;
        double grace = w->grace_s > 0 ? w->grace_s : 5;
        if (!wait_until(w, mono_now() + grace)) {
            fprintf(stderr, "am-train: rank %d: watchdog: %s #%llu on group %s did not return %g s after the abort; "
                    "exiting\n", w->rank, v.op, (unsigned long long)v.seq, v.group, grace);
            _exit(1);
        }
        break;
    }
    return NULL;
}

int am_watchdog_start(struct am_watchdog *w, char *err, size_t err_len)
{
    pthread_condattr_t attr;
    w->running = w->stop = w->fired = 0;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&w->lock, NULL);
    int rc = pthread_create(&w->thread, NULL, run, w);
    if (rc != 0) {
        snprintf(err, err_len, "watchdog: cannot start its thread: %s", strerror(rc));
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->lock);
        return -1;
    }
    w->running = 1;
    return 0;
}

void am_watchdog_stop(struct am_watchdog *w)
{
    if (!w->running)
        return;
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    w->running = 0;
}
