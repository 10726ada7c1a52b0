/* slurm_task.c - one Slurm task's supervisor, whatever serves the bootstrap (slurm_task.h). */
#include "slurm_task.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sigrelay.h"
#include "spawn.h"

double am_task_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double now(void) { return am_task_now(); }

void am_task_reply_error(struct task *t, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    am_boot_reply(t->fd, 1, text, strlen(text));
}

/* ---- serving the rank ------------------------------------------------------------------- */

static void serve(struct task *t)
{
    struct am_boot_req req;
    char key[AM_BOOT_MAX_KEY + 1];
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
    case AM_BOOT_PUT:
    case AM_BOOT_FENCE:
    case AM_BOOT_ALLGATHER:
        t->ops->relay(t, &req, key, value);
        break;
    case AM_BOOT_GET:
        if (req.rank < 0 || req.rank >= t->info.size)
            am_task_reply_error(t, "no rank %d in this job (key '%s')", req.rank, key);
        else
            t->ops->relay(t, &req, key, value);
        break;
    case AM_BOOT_ABORT:
        t->abort_requested = 1;
        t->abort_status = req.rank ? req.rank : 1;
        snprintf(t->abort_msg, sizeof(t->abort_msg), "%s", (char *)value);
        am_boot_reply(t->fd, 0, NULL, 0);
        t->kill_at = now() + t->o->grace_s;
        break;
    default:
        am_task_reply_error(t, "unknown request %u", req.op);
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

/* Before the backend's abort (PMIx_Abort, whose SIGKILL leaves the other ranks no time to write a word), the
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
    t->ops->abort(t, code, abort_msg);
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
        int in_flight = t->busy;
        double deadline = in_flight ? t->deadline : 0;
        if (t->kill_at > 0 && (deadline == 0 || t->kill_at < deadline))
            deadline = t->kill_at;
        int timeout = -1;
        if (deadline > 0) {
            double ms = (deadline - now()) * 1000 + 1;
            timeout = ms < 0 ? 0 : ms > 1e9 ? 1000000000 : (int)ms;
        }
        struct pollfd pfd[3] = {{.fd = t->sig_fd, .events = POLLIN},
                                {.fd = t->ops->wait_fd(t), .events = POLLIN},
                                {.fd = in_flight ? -1 : t->fd, .events = POLLIN}};
        if (poll(pfd, 3, timeout) < 0 && errno != EINTR) {
            fprintf(stderr, "am-launch: poll: %s\n", strerror(errno));
            am_reaper_signal(t->pid, SIGKILL);
        }
        take_signals(t);
        if (pfd[1].revents & (POLLIN | POLLHUP | POLLERR))
            t->ops->drain(t);
        if (in_flight)
            t->ops->finish(t, t->deadline > 0 && now() >= t->deadline);
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


void am_task_begin(struct task *t, const struct am_launch_opts *o, const struct am_task_ops *ops)
{
    char err[512];
    t->o = o;
    t->ops = ops;
    t->fd = t->sig_fd = t->reaper.fd = -1;
    /* before the backend's threads: the guard is forked while this process has one thread */
    if (am_reaper_start(&t->reaper, 1, err, sizeof(err)) < 0)
        fprintf(stderr, "am-launch: %s: processes the rank starts may outlive a killed am-launch\n", err);
}

int am_task_run(struct task *t)
{
    char err[1024];
    /* From here on a failure of this task alone must end the step (the backend's abort), or
     * the other ranks would wait for it in their first fence until the timeout. */
    if (am_log_dir_prepare(t->o->log_dir, t->info.job_id, t->log_dir, sizeof(t->log_dir), err, sizeof(err)) < 0) {
        char msg[1100];
        snprintf(msg, sizeof(msg), "am-launch: %s", err);
        fprintf(stderr, "%s; aborting the job\n", msg);
        t->aborted = 1;
        t->ops->abort(t, 1, msg);
        return 1;
    }
    /* Under Slurm, slurmstepd (our parent) signals every process of the step: the rank gets
     * those signals itself. */
    t->sig_fd = am_sigrelay_install(getenv("SLURM_JOB_ID") ? getppid() : 0);
    if (t->sig_fd < 0) {
        fprintf(stderr, "am-launch: cannot set up the supervisor: %s; aborting the job\n", strerror(errno));
        t->aborted = 1;
        t->ops->abort(t, 1, "am-launch: cannot set up the supervisor");
        return 1;
    }
    struct am_spawn sp = {.argv = t->o->argv, .rank = t->info.rank, .size = t->info.size,
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
        t->ops->abort(t, 127, msg);
        return 127;
    }
    am_reaper_add(&t->reaper, t->pid);
    return supervise(t);
}

void am_task_end(struct task *t)
{
    am_reaper_sweep(&t->reaper);
    am_reaper_stop(&t->reaper);
    if (t->fd >= 0)
        close(t->fd);
    t->fd = -1;
    if (t->sig_fd >= 0)
        am_sigrelay_uninstall();
    t->sig_fd = -1;
}
