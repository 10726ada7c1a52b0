/* standalone.c - `am-launch --nproc N`: N ranks on this machine, one job (launch.h). */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "boot_server.h"
#include "exit_record.h"
#include "launch.h"
#include "reaper.h"
#include "sigrelay.h"
#include "spawn.h"
#include "util.h"

/* After a rank's socket closes, the launcher waits this long for the rank to exit (longer
 * while the kernel is still tearing it down) before telling the ranks in a fence that it is
 * gone: when it died, its exit (the cause) must be seen before the others fail in the fence
 * because of it. */
#define DROP_DELAY_S 0.25

struct slot {
    pid_t pid; /* 0: not running */
    int fd;    /* bootstrap socket; -1 when closed */
    double drop_at; /* > 0: the socket closed; forget the rank in fences at this time */
    int stop_signal;
    struct am_oom_watch oom;
};

/* Everything one standalone job needs; one per am_launch_standalone call. */
struct job {
    const struct am_launch_opts *o;
    int n, alive;
    struct slot *slot;
    struct pollfd *pfd; /* the signal pipe, then one per rank */
    struct am_boot_info *info;
    struct am_boot_server *srv;
    char job_id[64], host[256], log_dir[4096];
    int sig_fd;
    int rc, first_failed, stopping;
    double kill_at;
    struct am_reaper reaper; /* the ranks' process groups (reaper.h) */
};

/* Open files the launcher needs besides one per rank: its standard streams, the signal
 * pipe, the guard's pipe, a rank's socket pair and exec-report pipe while it is started,
 * the log files it appends to, /proc while it sweeps; with room to spare. */
#define OWN_FILES 16

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* True while the kernel is tearing the process down (PF_EXITING in /proc/PID/stat, or a
 * zombie): its socket closed because it is exiting, and its exit status comes next. */
static int exiting(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* after the command name, which may hold spaces */
    char state;
    unsigned long flags;
    if (!p || sscanf(p + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2)
        return 0;
    return state == 'Z' || state == 'X' || (flags & 0x4) != 0;
}

/* True when the rank has exited but is not reaped yet (it gets no more signals). */
static int exited(pid_t pid)
{
    siginfo_t si = {0};
    return waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == pid;
}

static void signal_all(struct job *j, int sig, int except)
{
    for (int r = 0; r < j->n; r++) {
        if (j->slot[r].pid <= 0 || r == except || exited(j->slot[r].pid))
            continue;
        am_reaper_signal(j->slot[r].pid, sig); /* the rank's whole process group */
        if (sig == SIGTERM || sig == SIGINT || sig == SIGKILL)
            j->slot[r].stop_signal = sig;
    }
}

/* Before stopping the running ranks: a stop record in each one's log saying why
 * (exit_record.h): the failed rank (or none: the user's signal) and what happened. */
static void stop_records(struct job *j, int sig, int except, int because, const char *why)
{
    char err[512];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    for (int r = 0; r < j->n; r++) {
        if (j->slot[r].pid <= 0 || r == except || exited(j->slot[r].pid) || j->slot[r].stop_signal)
            continue;
        struct am_stop st = {.rank = r, .host = j->host, .signal = sig, .by = "am-launch", .because_rank = because,
                             .because_host = because >= 0 ? j->host : NULL, .because = why,
                             .because_time = because >= 0 ? (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec : 0};
        if (am_stop_record(j->log_dir, j->job_id, &st, err, sizeof(err)) < 0)
            fprintf(stderr, "am-launch: %s\n", err);
    }
}

/* The first failure decides the job's status; then every other rank is stopped. `why`
 * says what happened to `rank` (-1: not a rank's failure), for the others' stop records. */
static void fail_job(struct job *j, int rank, int rc, const char *why)
{
    if (j->stopping)
        return;
    j->stopping = 1;
    j->rc = rc;
    j->first_failed = rank;
    j->kill_at = now() + j->o->grace_s;
    stop_records(j, SIGTERM, rank, rank, why);
    signal_all(j, SIGTERM, rank);
}

static void close_fd(struct job *j, int r)
{
    if (j->slot[r].fd >= 0) {
        close(j->slot[r].fd);
        j->slot[r].fd = -1;
    }
    j->slot[r].drop_at = 0;
    am_boot_server_drop(j->srv, r);
}

static void rank_ended(struct job *j, int r, int status)
{
    char msg[512], err[512];
    struct am_exit e = {.rank = r, .host = j->host, .pid = j->slot[r].pid, .status = status,
                        .oom_killed = am_oom_watch_killed(&j->slot[r].oom, status),
                        .stop_signal = j->slot[r].stop_signal};
    if (e.oom_killed == 1 && j->slot[r].stop_signal == SIGKILL)
        e.oom_killed = 0; /* we killed it */
    j->slot[r].pid = 0;
    j->alive--;
    close_fd(j, r);
    if (am_exit_record(j->log_dir, j->job_id, &e, err, sizeof(err)) < 0)
        fprintf(stderr, "am-launch: %s\n", err);
    if (am_exit_code(status) == AM_EXIT_REQUEUE && !j->stopping && !j->rc)
        j->rc = AM_EXIT_REQUEUE; /* saved on Slurm's warning: the job's status asks for a requeue */
    if (!am_exit_failed(status) || j->stopping)
        return;
    am_exit_describe(&e, msg, sizeof(msg));
    fprintf(stderr, "am-launch: %s; stopping the other ranks\n", msg);
    fail_job(j, r, am_exit_code(status), msg);
}

static void serve(struct job *j, int r)
{
    int status = 0;
    char msg[512];
    enum am_boot_event ev = am_boot_server_serve(j->srv, r, j->slot[r].fd, &status, msg, sizeof(msg));
    if (ev == AM_BOOT_OK)
        return;
    char why[1100];
    if (ev == AM_BOOT_ABORTED) {
        fprintf(stderr, "am-launch: rank %d aborted the job (status %d): %s\n", r, status, msg);
        snprintf(why, sizeof(why), "rank %d on %s aborted the job (status %d): %s", r, j->host, status, msg);
        fail_job(j, r, status ? status : 1, why);
    } else if (ev == AM_BOOT_BAD) {
        fprintf(stderr, "am-launch: rank %d misbehaved: %s; stopping the job\n", r, msg);
        snprintf(why, sizeof(why), "rank %d on %s misbehaved: %s", r, j->host, msg);
        fail_job(j, r, 1, why);
        signal_all(j, SIGTERM, -1);
    } else if (ev == AM_BOOT_CLOSED && j->slot[r].pid > 0) {
        /* probably exiting: let its exit be seen first (see DROP_DELAY_S) */
        close(j->slot[r].fd);
        j->slot[r].fd = -1;
        j->slot[r].drop_at = now() + DROP_DELAY_S;
        return;
    }
    close_fd(j, r);
}

static void forward(struct job *j, int sig)
{
    char name[32];
    if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
        char why[64];
        int to_ranks = sig == SIGHUP ? SIGTERM : sig; /* a hang-up stops the job as a SIGTERM does */
        fprintf(stderr, "am-launch: got %s, stopping every rank\n", am_signal_name(sig, name, sizeof(name)));
        snprintf(why, sizeof(why), "am-launch got %s", name);
        stop_records(j, to_ranks, -1, -1, why);
        signal_all(j, to_ranks, -1);
        if (!j->stopping) {
            j->stopping = 1;
            j->rc = 128 + sig;
            j->kill_at = now() + j->o->grace_s;
        }
    } else {
        signal_all(j, sig, -1);
    }
}

static int start(struct job *j)
{
    char err[512];
    for (int r = 0; r < j->n; r++) {
        struct am_spawn sp = {.argv = j->o->argv, .rank = r, .size = j->n, .local_rank = r, .job_id = j->job_id,
                              .log_dir = j->log_dir, .own_group = 1};
        am_oom_watch_start(&j->slot[r].oom);
        pid_t pid = am_spawn_rank(&sp, &j->slot[r].fd, err, sizeof(err));
        if (pid < 0) {
            fprintf(stderr, "am-launch: %s\n", err);
            return -1;
        }
        j->slot[r].pid = pid;
        j->alive++;
        am_reaper_add(&j->reaper, pid);
    }
    return 0;
}

/* Every child that has exited: a rank (its group gets SIGKILL first, while the rank is not
 * reaped and its pid cannot be reused), the guard, or a process handed to am-launch as the
 * subreaper (reaper.h). */
static void reap(struct job *j)
{
    for (;;) {
        siginfo_t si;
        memset(&si, 0, sizeof(si));
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid <= 0)
            return;
        pid_t done = si.si_pid;
        int rank = -1, status = 0;
        for (int r = 0; r < j->n && rank < 0; r++)
            if (j->slot[r].pid == done)
                rank = r;
        if (rank >= 0)
            am_reaper_rank_ended(&j->reaper, done);
        while (waitpid(done, &status, 0) < 0)
            if (errno != EINTR)
                return;
        if (rank >= 0)
            rank_ended(j, rank, status);
        else
            am_reaper_is_guard(&j->reaper, done);
    }
}

static void loop(struct job *j)
{
    while (j->alive > 0) {
        double deadline = am_boot_server_deadline(j->srv);
        if (j->stopping && (deadline == 0 || j->kill_at < deadline))
            deadline = j->kill_at;
        for (int r = 0; r < j->n; r++)
            if (j->slot[r].drop_at > 0 && (deadline == 0 || j->slot[r].drop_at < deadline))
                deadline = j->slot[r].drop_at;
        int timeout = -1;
        if (deadline > 0) {
            double ms = (deadline - now()) * 1000 + 1;
            timeout = ms < 0 ? 0 : ms > 1e9 ? 1000000000 : (int)ms;
        }
        j->pfd[0] = (struct pollfd){.fd = j->sig_fd, .events = POLLIN};
        for (int r = 0; r < j->n; r++)
            j->pfd[r + 1] = (struct pollfd){.fd = j->slot[r].fd, .events = POLLIN};
        if (poll(j->pfd, (nfds_t)j->n + 1, timeout) < 0 && errno != EINTR) {
            fprintf(stderr, "am-launch: poll: %s\n", strerror(errno));
            fail_job(j, -1, 1, "am-launch failed (poll)");
            signal_all(j, SIGKILL, -1);
        }
        for (int sig, fwd; (sig = am_sigrelay_take(&fwd)) != 0;)
            forward(j, sig);
        for (int r = 0; r < j->n; r++)
            if (j->slot[r].fd >= 0 && (j->pfd[r + 1].revents & (POLLIN | POLLHUP | POLLERR)))
                serve(j, r);
        am_boot_server_expire(j->srv);
        reap(j);
        for (int r = 0; r < j->n; r++) {
            if (j->slot[r].drop_at == 0 || now() < j->slot[r].drop_at)
                continue;
            if (j->slot[r].pid > 0 && exiting(j->slot[r].pid)) /* not reaped yet: wait for it */
                j->slot[r].drop_at = now() + 0.05;
            else
                close_fd(j, r);
        }
        if (j->stopping && j->alive > 0 && now() >= j->kill_at) {
            signal_all(j, SIGKILL, -1);
            j->kill_at = now() + 3600;
        }
    }
}

/* The launcher holds one socket per rank and polls them all at once: both need the open-file
 * limit to cover the ranks. The soft limit is raised when the hard one allows it. */
static int check_open_files(int nproc)
{
    struct rlimit rl;
    rlim_t need = (rlim_t)nproc + OWN_FILES;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need)
        return 0;
    if (rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need) {
        struct rlimit raised = {.rlim_cur = need, .rlim_max = rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &raised) == 0)
            return 0;
    }
    long fits = (long)rl.rlim_max - OWN_FILES;
    char fewer[96] = "";
    if (fits >= 1)
        snprintf(fewer, sizeof(fewer), ", or start at most %ld ranks", fits);
    fprintf(stderr, "am-launch: --nproc %d needs %llu open files (one per rank and %d for itself), more than the "
            "open-file limit allows (ulimit -n: %llu, hard limit %llu): raise it with `ulimit -n %llu` (above the "
            "hard limit only as root, or with nofile in /etc/security/limits.conf)%s\n", nproc,
            (unsigned long long)need, OWN_FILES, (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max,
            (unsigned long long)need, fewer);
    return -1;
}

int am_launch_standalone(const struct am_launch_opts *o)
{
    struct job j = {.o = o, .n = o->nproc, .sig_fd = -1, .first_failed = -1, .reaper = {.fd = -1}};
    char err[512];
    if (check_open_files(o->nproc) < 0)
        return 2;
    if (am_reaper_start(&j.reaper, j.n, err, sizeof(err)) < 0) /* before anything is started */
        fprintf(stderr, "am-launch: %s: processes the ranks start may outlive a killed am-launch\n", err);
    j.slot = calloc((size_t)j.n, sizeof(*j.slot));
    j.info = calloc((size_t)j.n, sizeof(*j.info));
    j.pfd = calloc((size_t)j.n + 1, sizeof(*j.pfd));
    if (!j.slot || !j.info || !j.pfd) {
        fprintf(stderr, "am-launch: out of memory for %d ranks\n", j.n);
        j.rc = 1;
        goto out;
    }
    if (gethostname(j.host, sizeof(j.host) - 1) < 0)
        snprintf(j.host, sizeof(j.host), "localhost");
    snprintf(j.job_id, sizeof(j.job_id), "local-%ld-%d", (long)time(NULL), (int)getpid());
    if (am_log_dir_prepare(o->log_dir, j.job_id, j.log_dir, sizeof(j.log_dir), err, sizeof(err)) < 0) {
        fprintf(stderr, "am-launch: %s\n", err);
        j.rc = 1;
        goto out;
    }
    for (int r = 0; r < j.n; r++) {
        j.slot[r].fd = -1;
        j.info[r] = (struct am_boot_info){.rank = r, .size = j.n, .local_rank = r, .local_size = j.n, .node_id = 0,
                                          .n_nodes = 1};
        snprintf(j.info[r].host, sizeof(j.info[r].host), "%s", j.host);
        snprintf(j.info[r].job_id, sizeof(j.info[r].job_id), "%s", j.job_id);
    }
    j.srv = am_boot_server_new(j.n, j.info);
    j.sig_fd = am_sigrelay_install(0);
    if (!j.srv || j.sig_fd < 0) {
        fprintf(stderr, "am-launch: cannot set up the launcher: %s\n", strerror(errno));
        j.rc = 1;
        goto out;
    }
    if (start(&j) < 0)
        fail_job(&j, -1, 127, "am-launch could not start every rank");
    loop(&j);
    am_reaper_sweep(&j.reaper);
    if (j.first_failed >= 0)
        fprintf(stderr, "am-launch: job %s failed: rank %d failed first (exit status %d); logs in %s/%s/\n", j.job_id,
                j.first_failed, j.rc, j.log_dir, j.job_id);
out:
    for (int r = 0; j.slot && r < j.n; r++)
        if (j.slot[r].fd >= 0)
            close(j.slot[r].fd);
    if (j.sig_fd >= 0)
        am_sigrelay_uninstall();
    am_reaper_stop(&j.reaper);
    am_boot_server_free(j.srv);
    free(j.slot);
    free(j.info);
    free(j.pfd);
    return j.rc;
}
