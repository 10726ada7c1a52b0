/* pmix_task.c - `srun --mpi=pmix am-launch`: one task's supervisor (slurm_task.h, which
 * supervises the rank) and PMIx client (launch.h).
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

#include "slurm_task.h"

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

/* The PMIx side of a task (slurm_task.h's backend). */
struct pmix_task {
    struct task task;
    pmix_proc_t me;
    int wake[2];
    uint64_t next_seq;
    struct inflight op;
};

struct cb_arg {
    struct pmix_task *t;
    uint64_t seq;
};

static double now(void) { return am_task_now(); }

/* ---- PMIx's thread -> the loop --------------------------------------------------------- */

static void complete(struct cb_arg *a, pmix_status_t status, const void *data, size_t len)
{
    struct pmix_task *t = a->t;
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

static int read_layout(struct pmix_task *p, char *err, size_t err_len)
{
    struct task *t = &p->task;
    pmix_proc_t wild;
    PMIX_LOAD_PROCID(&wild, p->me.nspace, PMIX_RANK_WILDCARD);
    long size, local_rank, local_size, node_id, n_nodes;
    if (get_number(&wild, PMIX_JOB_SIZE, "job size", &size, err, err_len) < 0 ||
        get_number(&p->me, PMIX_LOCAL_RANK, "local rank", &local_rank, err, err_len) < 0 ||
        get_number(&wild, PMIX_LOCAL_SIZE, "number of local ranks", &local_size, err, err_len) < 0 ||
        get_number(&p->me, PMIX_NODEID, "node id", &node_id, err, err_len) < 0 ||
        get_number(&wild, PMIX_NUM_NODES, "number of nodes", &n_nodes, err, err_len) < 0)
        return -1;
    t->info.rank = (int)p->me.rank;
    t->info.size = (int)size;
    t->info.local_rank = (int)local_rank;
    t->info.local_size = (int)local_size;
    t->info.node_id = (int)node_id;
    t->info.n_nodes = (int)n_nodes;
    const char *node = getenv("SLURMD_NODENAME");
    pmix_value_t *v = NULL;
    if (node && *node) {
        snprintf(t->info.host, sizeof(t->info.host), "%s", node);
    } else if (PMIx_Get(&p->me, PMIX_HOSTNAME, NULL, 0, &v) == PMIX_SUCCESS && v->type == PMIX_STRING) {
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

static void start_op(struct pmix_task *t, const struct am_boot_req *req, const char *key)
{
    char pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    struct cb_arg *a = malloc(sizeof(*a));
    pmix_info_t info[2];
    size_t ninfo = 0;
    bool collect = true;
    int timeout = req->timeout_s > 0 ? (int)ceil(req->timeout_s) : 0;
    if (!a) {
        am_task_reply_error(&t->task, "the supervisor is out of memory");
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
    t->task.busy = 1;
    t->task.deadline = t->op.deadline;
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
        t->task.busy = 0;
        free(a);
        am_task_reply_error(&t->task, "PMIx refused the %s: %s", req->op == AM_BOOT_GET ? "get" : "fence",
                            PMIx_Error_string(rc));
    }
}

/* An allgather's answer once its fence (with the data collected) is over: every rank's value
 * of key from PMIx's local store, in rank order, of one length. */
static void reply_gathered(struct pmix_task *t, const char *key)
{
    char pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
    char *all = NULL;
    size_t each = 0;
    for (int r = 0; r < t->task.info.size; r++) {
        pmix_proc_t peer;
        pmix_value_t *v = NULL;
        PMIX_LOAD_PROCID(&peer, t->me.nspace, (pmix_rank_t)r);
        pmix_status_t rc = PMIx_Get(&peer, pkey, NULL, 0, &v);
        if (rc != PMIX_SUCCESS || !v || v->type != PMIX_BYTE_OBJECT) {
            am_task_reply_error(&t->task, "allgather '%s': rank %d's value: %s", key, r,
                                rc != PMIX_SUCCESS ? PMIx_Error_string(rc) : "not bytes");
        } else if (r == 0 && !(all = malloc((size_t)t->task.info.size * v->data.bo.size + 1))) {
            am_task_reply_error(&t->task, "allgather '%s': the supervisor is out of memory", key);
        } else if (r > 0 && v->data.bo.size != each) {
            am_task_reply_error(&t->task,
                                "allgather '%s': rank %d sent %zu bytes, rank 0 %zu (every rank sends as many)", key,
                                r, v->data.bo.size, each);
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
    am_boot_reply(t->task.fd, 0, all, (size_t)t->task.info.size * each);
    free(all);
}

/* The operation in flight finished (or timed out): answer the rank. */
static void finish_op(struct pmix_task *t, int timed_out)
{
    pthread_mutex_lock(&t->op.lock);
    int done = t->op.done;
    pmix_status_t st = t->op.status;
    char *data = t->op.data;
    size_t len = t->op.len;
    if (done || timed_out) {
        t->op.seq = 0;
        t->op.data = NULL;
        t->task.busy = 0;
    }
    pthread_mutex_unlock(&t->op.lock);
    if (!done && !timed_out)
        return;
    int fence = t->op.op != AM_BOOT_GET;
    if (done && st == PMIX_SUCCESS && t->op.op == AM_BOOT_ALLGATHER)
        reply_gathered(t, t->op.key);
    else if (done && st == PMIX_SUCCESS)
        am_boot_reply(t->task.fd, 0, data, len);
    else if (!done || st == PMIX_ERR_TIMEOUT)
        am_task_reply_error(&t->task, "timed out after %g s: %s", t->op.timeout_s,
                            fence ? "not every rank reached this fence (one is stuck or slow: see the logs)"
                                  : "the value never arrived");
    else if (!fence && st == PMIX_ERR_NOT_FOUND)
        am_task_reply_error(&t->task, "rank %d has published no value for '%s'", t->op.rank, t->op.key);
    else
        am_task_reply_error(&t->task, "PMIx %s failed: %s", fence ? "fence" : "get", PMIx_Error_string(st));
    free(data);
}


/* The rank's put, fence, get and allgather (slurm_task.h's relay). */
static void relay(struct task *task, const struct am_boot_req *req, const char *key, void *value)
{
    struct pmix_task *t = task->backend;
    char pkey[sizeof(KEY_PREFIX) + AM_BOOT_MAX_KEY];
    if (req->op == AM_BOOT_FENCE) {
        start_op(t, req, "");
        return;
    }
    if (req->op == AM_BOOT_GET) {
        start_op(t, req, key);
        return;
    }
    /* PUT; ALLGATHER: a put, then a fence that collects the data, answered in finish_op */
    pmix_value_t v;
    PMIX_VALUE_CONSTRUCT(&v);
    v.type = PMIX_BYTE_OBJECT;
    v.data.bo.bytes = value;
    v.data.bo.size = req->val_len;
    snprintf(pkey, sizeof(pkey), KEY_PREFIX "%s", key);
    pmix_status_t rc = PMIx_Put(PMIX_GLOBAL, pkey, &v); /* copies the value */
    if (rc != PMIX_SUCCESS)
        am_task_reply_error(task, "PMIx_Put of '%s' failed: %s", key, PMIx_Error_string(rc));
    else if (req->op == AM_BOOT_ALLGATHER)
        start_op(t, req, key);
    else
        am_boot_reply(task->fd, 0, NULL, 0);
}

static int wait_fd(struct task *task) { return ((struct pmix_task *)task->backend)->wake[0]; }

static void drain(struct task *task)
{
    char buf[64];
    while (read(((struct pmix_task *)task->backend)->wake[0], buf, sizeof(buf)) > 0)
        ;
}

static void finish(struct task *task, int timed_out) { finish_op(task->backend, timed_out); }

static void pmix_abort(struct task *task, int status, const char *msg)
{
    (void)task;
    pmix_status_t rc = PMIx_Abort(status, msg, NULL, 0);
    if (rc != PMIX_SUCCESS)
        fprintf(stderr, "am-launch: PMIx_Abort failed (%s): the other ranks may wait until their timeout\n",
                PMIx_Error_string(rc));
}

static const struct am_task_ops pmix_ops = {relay, wait_fd, drain, finish, pmix_abort};

int am_launch_pmix(const struct am_launch_opts *o)
{
    struct pmix_task *p = calloc(1, sizeof(*p));
    char err[1024];
    int rc = 1, initialized = 0;
    sigset_t relayed, old;
    sigemptyset(&relayed);
    sigaddset(&relayed, SIGTERM);
    sigaddset(&relayed, SIGINT);
    sigaddset(&relayed, SIGUSR1);
    sigaddset(&relayed, SIGUSR2);
    sigaddset(&relayed, SIGCHLD);
    if (!p) {
        fprintf(stderr, "am-launch: out of memory\n");
        return 1;
    }
    struct task *t = &p->task;
    p->wake[0] = p->wake[1] = -1;
    t->backend = p;
    am_task_begin(t, o, &pmix_ops); /* before PMIx_Init: the reaper's guard */
    pthread_mutex_init(&p->op.lock, NULL);
    job_id(t->info.job_id, sizeof(t->info.job_id));
    /* PMIx's thread starts with the relayed signals blocked, so they reach this thread. */
    pthread_sigmask(SIG_BLOCK, &relayed, &old);
    pmix_status_t prc = PMIx_Init(&p->me, NULL, 0);
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
    if (read_layout(p, err, sizeof(err)) < 0) {
        char msg[1100];
        snprintf(msg, sizeof(msg), "am-launch: %s", err);
        fprintf(stderr, "%s; aborting the job\n", msg);
        t->aborted = 1;
        PMIx_Abort(1, msg, NULL, 0);
        goto out;
    }
    if (pipe2(p->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
        fprintf(stderr, "am-launch: cannot set up the supervisor: %s; aborting the job\n", strerror(errno));
        t->aborted = 1;
        PMIx_Abort(1, "am-launch: cannot set up the supervisor", NULL, 0);
        goto out;
    }
    rc = am_task_run(t);
out:
    am_task_end(t);
    /* A task that ends without PMIx_Abort finalizes, failed or not, even with a fence in
     * flight (verified: Slurm 22.05's server answers the finalize): Slurm's PMIx server kills
     * the whole step when a client's connection drops without it (its error handler), which
     * would cut short the other ranks' records of a failure and make srun report SIGKILL. */
    if (initialized && !t->aborted)
        PMIx_Finalize(NULL, 0);
    /* With an operation in flight (the rank died in a fence), a PMIx callback may still
     * come: `p` stays allocated; the process exits next. */
    if (p->op.seq == 0) {
        if (p->wake[0] >= 0) {
            close(p->wake[0]);
            close(p->wake[1]);
        }
        pthread_mutex_destroy(&p->op.lock);
        free(p);
    }
    return rc;
}
