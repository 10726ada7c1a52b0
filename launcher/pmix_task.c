/* pmix_task.c - `srun --mpi=pmix am-launch`: one task's supervisor and PMIx client (launch.h).
 *
 * The rank's requests are relayed to PMIx:
 *   HELLO  -> the info read at PMIx_Init (rank, sizes, node, host, job id)
 *   PUT    -> PMIx_Put(PMIX_GLOBAL, "am.KEY", byte object)
 *   FENCE  -> PMIx_Commit + PMIx_Fence_nb over the whole namespace, PMIX_COLLECT_DATA
 *   GET    -> PMIx_Get_nb(rank, "am.KEY")
 *   ABORT  -> answered, then PMIx_Abort once the rank has exited (below)
 * Fence and get run non-blocking: their callbacks (on PMIx's thread) hand the result to the
 * poll loop through a pipe, so the loop keeps forwarding signals and notices the rank's
 * death while a collective is in flight. Each carries PMIX_TIMEOUT and the loop enforces
 * the same deadline (plus a second) itself, in case the server ignores it.
 *
 * When the rank fails (non-zero exit, signal, abort request) and was not being stopped
 * (a stop signal), the supervisor records the exit, says why on stderr, leaves the failure in
 * <log dir>/<job id>/first-failure.json and has Slurm send SIGINT to the step (stop_step), so
 * that the other ranks record where they were (cause record, flight recorder) and their
 * supervisors why they stop (a stop record naming this rank; they exit with this failure's
 * status). When every other rank's exit record is in the log directory within STOP_GRACE_S,
 * the task just exits with its status; otherwise it calls PMIx_Abort: Slurm's PMIx plugin
 * then kills whatever is left of the step at once (verified with Slurm 22.05: the other
 * tasks end by SIGKILL within about a second, srun exits with the abort status). Either way
 * srun exits with the failed rank's status. A task whose rank fails after another rank's
 * failure was recorded (a peer lost in a collective) ends with that first failure's status,
 * without an abort. A rank stopped by a signal ends the task without an abort: the job is
 * already being stopped by whoever sent it. Every task that did not abort calls
 * PMIx_Finalize: a client that disconnects without it makes Slurm kill the whole step.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pmix.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "boot_proto.h"
#include "exit_record.h"
#include "launch.h"
#include "reaper.h"
#include "sigrelay.h"
#include "spawn.h"

#define KEY_PREFIX "am."

/* The one PMIx operation in flight: the rank waits for its reply, so there is at most one.
 * Shared with PMIx's thread under `lock`. */
struct inflight {
    pthread_mutex_t lock;
    uint64_t seq; /* of the operation in flight; 0: none */
    int done;
    pmix_status_t status;
    char *data;
    size_t len;
    /* read by the loop only */
    int op;
    char key[AM_BOOT_MAX_KEY + 1];
    int rank;
    double timeout_s, deadline;
};

struct task {
    const struct am_launch_opts *o;
    int failed_first;   /* this task's rank failed and it is stopping the step */
    int because_status; /* stopped because another rank failed: that failure's status */
    int aborted;        /* PMIx_Abort was called: no PMIx_Finalize */
    pmix_proc_t me;
    struct am_boot_info info;
    char log_dir[4096];
    int sig_fd, wake[2], fd;
    pid_t pid;
    int stop_signal;
    struct am_oom_watch oom;
    int abort_requested, abort_status;
    char abort_msg[512];
    double kill_at;
    uint64_t next_seq;
    struct inflight op;
    struct am_reaper reaper; /* the rank's process group (reaper.h) */
};

struct cb_arg {
    struct task *t;
    uint64_t seq;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- PMIx's thread -> the loop --------------------------------------------------------- */

static void complete(struct cb_arg *a, pmix_status_t status, const void *data, size_t len)
{
    struct task *t = a->t;
    pthread_mutex_lock(&t->op.lock);
    if (a->seq == t->op.seq && !t->op.done) {
        t->op.status = status;
        t->op.data = NULL;
        t->op.len = 0;
        if (status == PMIX_SUCCESS && len && (t->op.data = malloc(len)) != NULL) {
            memcpy(t->op.data, data, len);
            t->op.len = len;
        } else if (status == PMIX_SUCCESS && len) {
            t->op.status = PMIX_ERR_NOMEM;
        }
        t->op.done = 1;
        char c = 0;
        (void)!write(t->wake[1], &c, 1);
    }
    pthread_mutex_unlock(&t->op.lock);
    free(a);
}

static void fence_cb(pmix_status_t status, void *cbdata) { complete(cbdata, status, NULL, 0); }

static void get_cb(pmix_status_t status, pmix_value_t *kv, void *cbdata)
{
    if (status == PMIX_SUCCESS && (!kv || kv->type != PMIX_BYTE_OBJECT)) {
        complete(cbdata, PMIX_ERR_TYPE_MISMATCH, NULL, 0);
        return;
    }
    complete(cbdata, status, status == PMIX_SUCCESS ? kv->data.bo.bytes : NULL,
             status == PMIX_SUCCESS ? kv->data.bo.size : 0);
}

/* ---- reading the job's layout from PMIx ------------------------------------------------ */

static int get_number(const pmix_proc_t *proc, const char *key, const char *what, long *out, char *err,
                      size_t err_len)
{
    pmix_value_t *v = NULL;
    pmix_status_t rc = PMIx_Get(proc, key, NULL, 0, &v);
    if (rc != PMIX_SUCCESS) {
        snprintf(err, err_len, "PMIx has no %s (%s): %s; is this a PMIx server that publishes the standard job "
                 "information (srun --mpi=pmix does)?", what, key, PMIx_Error_string(rc));
        return -1;
    }
    int ok = 1;
    switch (v->type) {
    case PMIX_UINT8: *out = v->data.uint8; break;
    case PMIX_UINT16: *out = v->data.uint16; break;
    case PMIX_UINT32: *out = (long)v->data.uint32; break;
    case PMIX_UINT64: *out = (long)v->data.uint64; break;
    case PMIX_INT: *out = v->data.integer; break;
    case PMIX_INT32: *out = v->data.int32; break;
    case PMIX_UINT: *out = (long)v->data.uint; break;
    case PMIX_SIZE: *out = (long)v->data.size; break;
    case PMIX_PROC_RANK: *out = (long)v->data.rank; break;
    default: ok = 0; break;
    }
    if (!ok)
        snprintf(err, err_len, "PMIx's %s (%s) has type %s, not a number", what, key, PMIx_Data_type_string(v->type));
    PMIX_VALUE_RELEASE(v);
    return ok ? 0 : -1;
}

static int read_layout(struct task *t, char *err, size_t err_len)
{
    pmix_proc_t wild;
    PMIX_LOAD_PROCID(&wild, t->me.nspace, PMIX_RANK_WILDCARD);
    long size, local_rank, local_size, node_id, n_nodes;
    if (get_number(&wild, PMIX_JOB_SIZE, "job size", &size, err, err_len) < 0 ||
        get_number(&t->me, PMIX_LOCAL_RANK, "local rank", &local_rank, err, err_len) < 0 ||
        get_number(&wild, PMIX_LOCAL_SIZE, "number of local ranks", &local_size, err, err_len) < 0 ||
        get_number(&t->me, PMIX_NODEID, "node id", &node_id, err, err_len) < 0 ||
        get_number(&wild, PMIX_NUM_NODES, "number of nodes", &n_nodes, err, err_len) < 0)
        return -1;
    t->info.rank = (int)t->me.rank;
    t->info.size = (int)size;
    t->info.local_rank = (int)local_rank;
    t->info.local_size = (int)local_size;
    t->info.node_id = (int)node_id;
    t->info.n_nodes = (int)n_nodes;
    const char *node = getenv("SLURMD_NODENAME");
    pmix_value_t *v = NULL;
    if (node && *node) {
        snprintf(t->info.host, sizeof(t->info.host), "%s", node);
    } else if (PMIx_Get(&t->me, PMIX_HOSTNAME, NULL, 0, &v) == PMIX_SUCCESS && v->type == PMIX_STRING) {
        snprintf(t->info.host, sizeof(t->info.host), "%s", v->data.string);
    } else if (gethostname(t->info.host, sizeof(t->info.host) - 1) < 0) {
        snprintf(t->info.host, sizeof(t->info.host), "localhost");
    }
    if (v)
        PMIX_VALUE_RELEASE(v);
    if (t->info.rank < 0 || t->info.rank >= t->info.size || t->info.node_id < 0 || t->info.node_id >= t->info.n_nodes) {
        snprintf(err, err_len, "PMIx gave an inconsistent layout: rank %d of %d, node %d of %d", t->info.rank,
                 t->info.size, t->info.node_id, t->info.n_nodes);
        return -1;
    }
    return 0;
}

/* SLURM_JOB_ID.SLURM_STEP_ID; outside Slurm, the PMIx namespace. */
static void job_id(char *out, size_t len)
{
    const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
    if (!step)
        step = getenv("SLURM_STEPID");
    if (job && *job)
        snprintf(out, len, "%s.%s", job, step && *step ? step : "0");
    else
        snprintf(out, len, "%s", getenv("PMIX_NAMESPACE"));
}

/* ---- serving the rank ------------------------------------------------------------------- */

static void reply_error(struct task *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reply_error(struct task *t, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    am_boot_reply(t->fd, 1, text, strlen(text));
}

static void start_op(struct task *t, const struct am_boot_req *req, const char *key)
{
    char pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    struct cb_arg *a = malloc(sizeof(*a));
    pmix_info_t info[2];
    size_t ninfo = 0;
    bool collect = true;
    int timeout = req->timeout_s > 0 ? (int)ceil(req->timeout_s) : 0;
    if (!a) {
        reply_error(t, "the supervisor is out of memory");
        return;
    }
    pthread_mutex_lock(&t->op.lock);
    t->op.seq = a->seq = ++t->next_seq;
    t->op.done = 0;
    pthread_mutex_unlock(&t->op.lock);
    a->t = t;
    t->op.op = (int)req->op;
    t->op.rank = req->rank;
    t->op.timeout_s = req->timeout_s;
    t->op.deadline = req->timeout_s > 0 ? now() + req->timeout_s + 1 : 0;
    snprintf(t->op.key, sizeof(t->op.key), "%s", key);
    pmix_status_t rc;
    if (req->op == AM_BOOT_FENCE || req->op == AM_BOOT_ALLGATHER) {
        pmix_proc_t all;
        PMIX_LOAD_PROCID(&all, t->me.nspace, PMIX_RANK_WILDCARD);
        PMIX_INFO_LOAD(&info[ninfo++], PMIX_COLLECT_DATA, &collect, PMIX_BOOL);
        if (timeout)
            PMIX_INFO_LOAD(&info[ninfo++], PMIX_TIMEOUT, &timeout, PMIX_INT);
        rc = PMIx_Commit();
        if (rc == PMIX_SUCCESS)
            rc = PMIx_Fence_nb(&all, 1, info, ninfo, fence_cb, a);
    } else {
        pmix_proc_t peer;
        PMIX_LOAD_PROCID(&peer, t->me.nspace, (pmix_rank_t)req->rank);
        snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
        if (timeout)
            PMIX_INFO_LOAD(&info[ninfo++], PMIX_TIMEOUT, &timeout, PMIX_INT);
        rc = PMIx_Get_nb(&peer, pkey, info, ninfo, get_cb, a);
    }
    for (size_t i = 0; i < ninfo; i++)
        PMIX_INFO_DESTRUCT(&info[i]);
    if (rc != PMIX_SUCCESS) { /* the callback will not run */
        pthread_mutex_lock(&t->op.lock);
        t->op.seq = 0;
        pthread_mutex_unlock(&t->op.lock);
        free(a);
        reply_error(t, "PMIx refused the %s: %s", req->op == AM_BOOT_GET ? "get" : "fence", PMIx_Error_string(rc));
    }
}

/* An allgather's answer once its fence (with the data collected) is over: every rank's value
 * of key from PMIx's local store, in rank order, of one length. */
static void reply_gathered(struct task *t, const char *key)
{
    char pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
    char *all = NULL;
    size_t each = 0;
    for (int r = 0; r < t->info.size; r++) {
        pmix_proc_t peer;
        pmix_value_t *v = NULL;
        PMIX_LOAD_PROCID(&peer, t->me.nspace, (pmix_rank_t)r);
        pmix_status_t rc = PMIx_Get(&peer, pkey, NULL, 0, &v);
        if (rc != PMIX_SUCCESS || !v || v->type != PMIX_BYTE_OBJECT) {
            reply_error(t, "allgather '%s': rank %d's value: %s", key, r,
                        rc != PMIX_SUCCESS ? PMIx_Error_string(rc) : "not bytes");
        } else if (r == 0 && !(all = malloc((size_t)t->info.size * v->data.bo.size + 1))) {
            reply_error(t, "allgather '%s': the supervisor is out of memory", key);
        } else if (r > 0 && v->data.bo.size != each) {
            reply_error(t, "allgather '%s': rank %d sent %zu bytes, rank 0 %zu (every rank sends as many)", key, r,
                        v->data.bo.size, each);
        } else {
            each = v->data.bo.size;
            memcpy(all + (size_t)r * each, v->data.bo.bytes, each);
            PMIX_VALUE_RELEASE(v);
            continue;
        }
        if (v)
            PMIX_VALUE_RELEASE(v);
        free(all);
        return;
    }
    am_boot_reply(t->fd, 0, all, (size_t)t->info.size * each);
    free(all);
}

/* The operation in flight finished (or timed out): answer the rank. */
static void finish_op(struct task *t, int timed_out)
{
    pthread_mutex_lock(&t->op.lock);
    int done = t->op.done;
    pmix_status_t st = t->op.status;
    char *data = t->op.data;
    size_t len = t->op.len;
    if (done || timed_out) {
        t->op.seq = 0;
        t->op.data = NULL;
    }
    pthread_mutex_unlock(&t->op.lock);
    if (!done && !timed_out)
        return;
    int fence = t->op.op != AM_BOOT_GET;
    if (done && st == PMIX_SUCCESS && t->op.op == AM_BOOT_ALLGATHER)
        reply_gathered(t, t->op.key);
    else if (done && st == PMIX_SUCCESS)
        am_boot_reply(t->fd, 0, data, len);
    else if (!done || st == PMIX_ERR_TIMEOUT)
        reply_error(t, "timed out after %g s: %s", t->op.timeout_s,
                    fence ? "not every rank reached this fence (one is stuck or slow: see the logs)"
                          : "the value never arrived");
    else if (!fence && st == PMIX_ERR_NOT_FOUND)
        reply_error(t, "rank %d has published no value for '%s'", t->op.rank, t->op.key);
    else
        reply_error(t, "PMIx %s failed: %s", fence ? "fence" : "get", PMIx_Error_string(st));
    free(data);
}

static void serve(struct task *t)
{
    struct am_boot_req req;
    char key[AM_BOOT_MAX_KEY + 1], pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    void *value = NULL;
    int got = am_boot_read_request(t->fd, &req, key, &value);
    if (got < 0) { /* the rank closed its end (or sent garbage): it gets no more answers */
        if (got == -2)
            fprintf(stderr, "am-launch: rank %d sent a request with a %u-byte key and a %llu-byte value; closing its "
                    "bootstrap\n", t->info.rank, req.key_len, (unsigned long long)req.val_len);
        close(t->fd);
        t->fd = -1;
        return;
    }
    switch (req.op) {
    case AM_BOOT_HELLO:
        am_boot_reply(t->fd, 0, &t->info, sizeof(t->info));
        break;
    case AM_BOOT_PUT: {
        pmix_value_t v;
        PMIX_VALUE_CONSTRUCT(&v);
        v.type = PMIX_BYTE_OBJECT;
        v.data.bo.bytes = value;
        v.data.bo.size = req.val_len;
        snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
        pmix_status_t rc = PMIx_Put(PMIX_GLOBAL, pkey, &v); /* copies the value */
        if (rc == PMIX_SUCCESS)
            am_boot_reply(t->fd, 0, NULL, 0);
        else
            reply_error(t, "PMIx_Put of '%s' failed: %s", key, PMIx_Error_string(rc));
        break;
    }
    case AM_BOOT_FENCE:
        start_op(t, &req, "");
        break;
    case AM_BOOT_ALLGATHER: { /* a put, then a fence that collects the data; answered in finish_op */
        pmix_value_t v;
        PMIX_VALUE_CONSTRUCT(&v);
        v.type = PMIX_BYTE_OBJECT;
        v.data.bo.bytes = value;
        v.data.bo.size = req.val_len;
        snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
        pmix_status_t rc = PMIx_Put(PMIX_GLOBAL, pkey, &v);
        if (rc == PMIX_SUCCESS)
            start_op(t, &req, key);
        else
            reply_error(t, "PMIx_Put of '%s' failed: %s", key, PMIx_Error_string(rc));
        break;
    }
    case AM_BOOT_GET:
        if (req.rank < 0 || req.rank >= t->info.size)
            reply_error(t, "no rank %d in this job (key '%s')", req.rank, key);
        else
            start_op(t, &req, key);
        break;
    case AM_BOOT_ABORT:
        t->abort_requested = 1;
        t->abort_status = req.rank ? req.rank : 1;
        snprintf(t->abort_msg, sizeof(t->abort_msg), "%s", (char *)value);
        am_boot_reply(t->fd, 0, NULL, 0);
        t->kill_at = now() + t->o->grace_s;
        break;
    default:
        reply_error(t, "unknown request %u", req.op);
        break;
    }
    free(value);
}

/* ---- the rank's end --------------------------------------------------------------------- */

/* Stop signals that arrived with the rank's end (Slurm signals the rank and its supervisor
 * at the same time): they tell a stopped rank from a failed one. */
/* The first stop signal of a rank that has not failed: a stop record in its log saying
 * why, as far as this task knows (exit_record.h): the failure another task's supervisor left
 * in first-failure.json, or Slurm's stop (scancel, the time limit, preemption). */
static void stop_record(struct task *t, int sig, int forwarded)
{
    char host[256], what[1024], err[512];
    int rank, status;
    double when;
    struct am_stop st = {.rank = t->info.rank, .host = t->info.host, .signal = sig,
                         .by = forwarded ? "am-launch" : "slurm", .because_rank = -1};
    if (am_failure_read(t->log_dir, t->info.job_id, &rank, &status, host, sizeof(host), what, sizeof(what), &when) == 0 &&
        rank != t->info.rank) {
        st.because_rank = rank;
        st.because_host = host;
        st.because = what;
        st.because_time = when;
        t->because_status = status;
    } else if (!forwarded) {
        st.because = "a stop signal from Slurm (scancel, srun, the time limit or preemption)";
    }
    if (am_stop_record(t->log_dir, t->info.job_id, &st, err, sizeof(err)) < 0)
        fprintf(stderr, "am-launch: %s\n", err);
}

static void take_signals(struct task *t)
{
    for (int sig, fwd; (sig = am_sigrelay_take(&fwd)) != 0;) {
        if (fwd && sig == SIGHUP) /* a hang-up stops the rank as a SIGTERM does */
            sig = SIGTERM;
        if (fwd && t->pid > 0)
            am_reaper_signal(t->pid, sig); /* the rank's whole process group */
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) { /* what the rank got */
            if (!t->stop_signal && !t->failed_first)
                stop_record(t, sig, fwd);
            t->stop_signal = sig;
            if (fwd && t->kill_at == 0) /* Slurm's own stops end with its SIGKILL (KillWait) */
                t->kill_at = now() + t->o->grace_s;
        }
    }
}

/* Before PMIx_Abort (whose SIGKILL leaves the other ranks no time to write a word), the
 * task whose rank failed first (it created first-failure.json) has Slurm send SIGINT to the
 * step (`scancel --signal=INT JOB.STEP`; not SIGTERM, which Slurm 22.05 treats as the step's
 * cancellation and follows with its own kill), so that every other rank writes its cause
 * record (the signal, with its flight recorder: the collective it waited in) and its
 * supervisor a stop record naming this rank, and exits with this failure's status. Then it
 * waits, up to STOP_GRACE_S, for every other rank's exit record to appear in the log
 * directory (when it is shared): returns 1 when all did (the step ends by itself, and srun
 * reports this failure's status), 0 when the abort must end what is left. The signal is
 * sent again after 0.3 and 0.6 s while some rank has not ended (a lost RPC in Slurm's
 * fan-out once left a node unsignalled here). */
#define STOP_GRACE_S 1.5

/* `scancel --signal=INT JOB.STEP`; 0, or -1 when it cannot be run. */
static int signal_step(const char *job, const char *step)
{
    extern char **environ;
    char target[96];
    char *argv[] = {"scancel", "--signal=INT", target, NULL};
    pid_t pid;
    snprintf(target, sizeof(target), "%s.%s", job, step);
    if ((pid = fork()) == 0) { /* exec at once: PMIx's threads are not in the child */
        am_sigrelay_child();
        execvpe(argv[0], argv, environ);
        _exit(127);
    }
    if (pid < 0) {
        fprintf(stderr, "am-launch: cannot run scancel to stop the step gently: %s\n", strerror(errno));
        return -1;
    }
    int status = 0;
    for (double end = now() + 10; waitpid(pid, &status, WNOHANG) == 0 && now() < end;) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 127 ? -1 : 0;
}

static int stop_step(struct task *t)
{
    const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
    if (!step)
        step = getenv("SLURM_STEPID");
    if (!job || !*job || !step || !*step)
        return 0;
    char *ended = calloc((size_t)t->info.size, 1);
    int left = t->info.size - 1, sent = 0;
    double start = now();
    /* the signal again after 0.3 and 0.6 s for ranks whose log has no exit record yet: one
     * Slurm RPC in a fan-out can be lost */
    for (double end = start + STOP_GRACE_S; ended && left > 0 && now() < end;) {
        if (sent < 3 && now() >= start + 0.3 * sent) {
            if (signal_step(job, step) < 0)
                break;
            sent++;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
        for (int r = 0; r < t->info.size; r++)
            if (r != t->info.rank && !ended[r] && am_log_has_exit(t->log_dir, t->info.job_id, r)) {
                ended[r] = 1;
                left--;
            }
    }
    free(ended);
    return left == 0;
}

static int rank_ended(struct task *t, int status)
{
    char msg[1024], err[512];
    pid_t pid = t->pid;
    t->pid = 0; /* reaped: it gets no more signals */
    take_signals(t);
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (!t->stop_signal && !t->abort_requested && (sig == SIGTERM || sig == SIGINT)) {
        /* slurmstepd signals the step's processes one after the other: the rank may die of
         * Slurm's SIGTERM before its supervisor gets its own; give that a moment, then
         * believe first-failure.json (another task's failure is stopping the step) */
        for (double end = now() + 0.5; !t->stop_signal && now() < end;) {
            struct pollfd pfd = {.fd = t->sig_fd, .events = POLLIN};
            poll(&pfd, 1, 20);
            take_signals(t);
        }
        char host[256], what[1024];
        int rank, st;
        double when;
        if (!t->stop_signal && am_failure_read(t->log_dir, t->info.job_id, &rank, &st, host, sizeof(host), what,
                                               sizeof(what), &when) == 0 && rank != t->info.rank) {
            stop_record(t, sig, 0);
            t->stop_signal = sig;
        }
    }
    struct am_exit e = {.rank = t->info.rank, .host = t->info.host, .pid = pid, .status = status,
                        .oom_killed = am_oom_watch_killed(&t->oom, status), .stop_signal = t->stop_signal};
    if (e.oom_killed == 1 && t->stop_signal == SIGKILL)
        e.oom_killed = 0;
    if (am_exit_record(t->log_dir, t->info.job_id, &e, err, sizeof(err)) < 0)
        fprintf(stderr, "am-launch: %s\n", err);
    int code = am_exit_code(status);
    if (t->abort_requested) {
        snprintf(msg, sizeof(msg), "rank %d on %s aborted the job (status %d): %s", t->info.rank, t->info.host,
                 t->abort_status, t->abort_msg);
        code = t->abort_status;
    } else if (!am_exit_failed(status)) {
        return code; /* 0, or AM_EXIT_REQUEUE: saved on Slurm's warning, to be requeued */
    } else {
        am_exit_describe(&e, msg, sizeof(msg));
    }
    if (t->stop_signal && !t->abort_requested) {
        /* stopped: the job is ending anyway. When another rank's failure stopped it, the task
         * exits with that failure's status, so that srun reports the first failure's status
         * whichever task it hears from last (the exit record keeps this rank's own). */
        return t->because_status > 0 ? t->because_status : code;
    }
    t->failed_first = 1; /* no stop record for the signals that come next */
    int first = am_failure_mark(t->log_dir, t->info.job_id, t->info.rank, code, t->info.host, msg);
    char host[256], what[1024];
    int other, other_status;
    double when;
    if (first == 0 && am_failure_read(t->log_dir, t->info.job_id, &other, &other_status, host, sizeof(host), what,
                                      sizeof(what), &when) == 0 && other != t->info.rank) {
        /* another rank failed first (this one, say, lost it as a peer): that rank's task is
         * stopping the step; this one ends with that failure's status, without an abort */
        fprintf(stderr, "am-launch: %s, after rank %d on %s failed first, which stops the job (log: %s/%s/rank-%d.jsonl)\n",
                msg, other, host, t->log_dir, t->info.job_id, t->info.rank);
        return other_status > 0 ? other_status : code;
    }
    fprintf(stderr, "am-launch: %s; aborting the job (log: %s/%s/rank-%d.jsonl)\n", msg, t->log_dir,
            t->info.job_id, t->info.rank);
    if (first == 1 && stop_step(t))
        return code; /* every other rank has ended: no abort needed */
    char abort_msg[1100];
    snprintf(abort_msg, sizeof(abort_msg), "am-launch: %s", msg);
    t->aborted = 1;
    pmix_status_t rc = PMIx_Abort(code, abort_msg, NULL, 0);
    if (rc != PMIX_SUCCESS)
        fprintf(stderr, "am-launch: PMIx_Abort failed (%s): the other ranks may wait until their timeout\n",
                PMIx_Error_string(rc));
    return code;
}

/* ---- the loop -------------------------------------------------------------------------- */

/* Reaps every child that has exited: 1 when the rank did (its wait status in *status; its
 * process group got SIGKILL before it was reaped, while its pid could not be reused), 0 when
 * only others (the guard, processes handed over to the subreaper: reaper.h). */
static int reap(struct task *t, int *status)
{
    for (;;) {
        siginfo_t si;
        memset(&si, 0, sizeof(si));
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid <= 0)
            return 0;
        pid_t done = si.si_pid;
        if (done == t->pid)
            am_reaper_rank_ended(&t->reaper, done);
        int st = 0;
        while (waitpid(done, &st, 0) < 0)
            if (errno != EINTR)
                return 0;
        if (done == t->pid) {
            *status = st;
            return 1;
        }
        am_reaper_is_guard(&t->reaper, done);
    }
}

static int supervise(struct task *t)
{
    int rc = 0;
    while (t->pid > 0) {
        int in_flight = t->op.seq != 0;
        double deadline = in_flight ? t->op.deadline : 0;
        if (t->kill_at > 0 && (deadline == 0 || t->kill_at < deadline))
            deadline = t->kill_at;
        int timeout = -1;
        if (deadline > 0) {
            double ms = (deadline - now()) * 1000 + 1;
            timeout = ms < 0 ? 0 : ms > 1e9 ? 1000000000 : (int)ms;
        }
        struct pollfd pfd[3] = {{.fd = t->sig_fd, .events = POLLIN},
                                {.fd = t->wake[0], .events = POLLIN},
                                {.fd = in_flight ? -1 : t->fd, .events = POLLIN}};
        if (poll(pfd, 3, timeout) < 0 && errno != EINTR) {
            fprintf(stderr, "am-launch: poll: %s\n", strerror(errno));
            am_reaper_signal(t->pid, SIGKILL);
        }
        take_signals(t);
        if (pfd[1].revents & POLLIN) {
            char drain[64];
            while (read(t->wake[0], drain, sizeof(drain)) > 0)
                ;
        }
        if (in_flight)
            finish_op(t, t->op.deadline > 0 && now() >= t->op.deadline);
        else if (t->fd >= 0 && (pfd[2].revents & (POLLIN | POLLHUP | POLLERR)))
            serve(t);
        int status;
        if (reap(t, &status)) {
            rc = rank_ended(t, status);
        } else if (t->kill_at > 0 && now() >= t->kill_at) {
            am_reaper_signal(t->pid, SIGKILL);
            t->stop_signal = SIGKILL;
            t->kill_at = now() + 3600;
        }
    }
    return rc;
}

int am_launch_pmix(const struct am_launch_opts *o)
{
    struct task *t = calloc(1, sizeof(*t));
    char err[1024];
    int rc = 1, initialized = 0;
    sigset_t relayed, old;
    sigemptyset(&relayed);
    sigaddset(&relayed, SIGTERM);
    sigaddset(&relayed, SIGINT);
    sigaddset(&relayed, SIGUSR1);
    sigaddset(&relayed, SIGUSR2);
    sigaddset(&relayed, SIGCHLD);
    if (!t) {
        fprintf(stderr, "am-launch: out of memory\n");
        return 1;
    }
    t->o = o;
    t->fd = t->sig_fd = t->wake[0] = t->wake[1] = t->reaper.fd = -1;
    /* before PMIx_Init: the guard is forked while this process has one thread */
    if (am_reaper_start(&t->reaper, 1, err, sizeof(err)) < 0)
        fprintf(stderr, "am-launch: %s: processes the rank starts may outlive a killed am-launch\n", err);
    pthread_mutex_init(&t->op.lock, NULL);
    job_id(t->info.job_id, sizeof(t->info.job_id));
    /* PMIx's thread starts with the relayed signals blocked, so they reach this thread. */
    pthread_sigmask(SIG_BLOCK, &relayed, &old);
    pmix_status_t prc = PMIx_Init(&t->me, NULL, 0);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != PMIX_SUCCESS) {
        fprintf(stderr, "am-launch: PMIx_Init failed: %s (PMIX_NAMESPACE=%s, PMIX_RANK=%s): start am-launch with "
                "`srun --mpi=pmix`, or run `am-launch --nproc N` outside Slurm\n", PMIx_Error_string(prc),
                getenv("PMIX_NAMESPACE"), getenv("PMIX_RANK"));
        goto out;
    }
    initialized = 1;
    /* the rank program cannot ask: it does not link PMIx (am-doctor reports it) */
    setenv("AM_PMIX_VERSION", PMIx_Get_version(), 1);
    /* From here on a failure of this task alone must end the step (PMIx_Abort), or the
     * other ranks would wait for it in their first fence until the timeout. */
    if (read_layout(t, err, sizeof(err)) < 0 ||
        am_log_dir_prepare(o->log_dir, t->info.job_id, t->log_dir, sizeof(t->log_dir), err, sizeof(err)) < 0) {
        char msg[1100];
        snprintf(msg, sizeof(msg), "am-launch: %s", err);
        fprintf(stderr, "%s; aborting the job\n", msg);
        t->aborted = 1;
        PMIx_Abort(1, msg, NULL, 0);
        goto out;
    }
    /* Under Slurm, slurmstepd (our parent) signals every process of the step: the rank gets
     * those signals itself. */
    t->sig_fd = am_sigrelay_install(getenv("SLURM_JOB_ID") ? getppid() : 0);
    if (t->sig_fd < 0 || pipe2(t->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        fprintf(stderr, "am-launch: cannot set up the supervisor: %s; aborting the job\n", strerror(errno));
        t->aborted = 1;
        PMIx_Abort(1, "am-launch: cannot set up the supervisor", NULL, 0);
        goto out;
    }
    struct am_spawn sp = {.argv = o->argv, .rank = t->info.rank, .size = t->info.size,
                          .local_rank = t->info.local_rank, .job_id = t->info.job_id, .log_dir = t->log_dir,
                          .own_group = 1};
    am_oom_watch_start(&t->oom);
    t->pid = am_spawn_rank(&sp, &t->fd, err, sizeof(err));
    if (t->pid < 0) {
        t->pid = 0;
        fprintf(stderr, "am-launch: rank %d on %s: %s; aborting the job\n", t->info.rank, t->info.host, err);
        char msg[1536];
        snprintf(msg, sizeof(msg), "am-launch: rank %d on %s: %s", t->info.rank, t->info.host, err);
        t->aborted = 1;
        PMIx_Abort(127, msg, NULL, 0);
        rc = 127;
        goto out;
    }
    am_reaper_add(&t->reaper, t->pid);
    rc = supervise(t);
out:
    am_reaper_sweep(&t->reaper);
    am_reaper_stop(&t->reaper);
    if (t->fd >= 0)
        close(t->fd);
    if (t->sig_fd >= 0)
        am_sigrelay_uninstall();
    /* A task that ends without PMIx_Abort finalizes, failed or not, even with a fence in
     * flight (verified: Slurm 22.05's server answers the finalize): Slurm's PMIx server kills
     * the whole step when a client's connection drops without it (its error handler), which
     * would cut short the other ranks' records of a failure and make srun report SIGKILL. */
    if (initialized && !t->aborted)
        PMIx_Finalize(NULL, 0);
    /* With an operation in flight (the rank died in a fence), a PMIx callback may still
     * come: `t` stays allocated; the process exits next. */
    if (t->op.seq == 0) {
        if (t->wake[0] >= 0) {
            close(t->wake[0]);
            close(t->wake[1]);
        }
        pthread_mutex_destroy(&t->op.lock);
        free(t);
    }
    return rc;
}
