/* standalone.c - N ranks on one machine (standalone.h). */
#include "standalone.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "boot_server.h"

static volatile sig_atomic_t pending_signal;
static int sigpipe_w = -1;

static void on_signal(int sig)
{
    int saved = errno;
    if (sig != SIGCHLD)
        pending_signal = sig;
    if (sigpipe_w >= 0) {
        char c = 0;
        (void)!write(sigpipe_w, &c, 1);
    }
    errno = saved;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static pid_t spawn(const struct am_launch_opts *o, int rank, int fd, const char *job_id)
{
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    char v[64];
    snprintf(v, sizeof(v), "%d", fd);
    setenv("AM_BOOTSTRAP_FD", v, 1);
    snprintf(v, sizeof(v), "%d", rank);
    setenv("AM_RANK", v, 1);
    snprintf(v, sizeof(v), "%d", o->nproc);
    setenv("AM_WORLD_SIZE", v, 1);
    setenv("AM_JOB_ID", job_id, 1);
    if (o->recipe)
        setenv("AM_RECIPE", o->recipe, 1);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    execvp(o->argv[0], o->argv);
    fprintf(stderr, "am-launch: rank %d: cannot run %s: %s\n", rank, o->argv[0], strerror(errno));
    _exit(127);
}

static int status_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}

static void describe(int rank, int status, char *buf, size_t len)
{
    if (WIFEXITED(status))
        snprintf(buf, len, "rank %d exited with status %d", rank, WEXITSTATUS(status));
    else
        snprintf(buf, len, "rank %d was killed by signal %d (%s)%s", rank, WTERMSIG(status),
                 strsignal(WTERMSIG(status)), WCOREDUMP(status) ? ", core dumped" : "");
}

int am_launch_standalone(const struct am_launch_opts *o)
{
    int n = o->nproc, rc = 0, alive = 0, first_failed = -1;
    pid_t *pid = calloc((size_t)n, sizeof(pid_t));
    int *fd = calloc((size_t)n, sizeof(int));
    struct am_boot_info *info = calloc((size_t)n, sizeof(*info));
    struct pollfd *pfd = calloc((size_t)n + 1, sizeof(*pfd));
    struct am_boot_server *srv = NULL;
    int sigpipe[2] = {-1, -1};
    char job_id[64], host[256] = "localhost", msg[512];
    if (!pid || !fd || !info || !pfd) {
        fprintf(stderr, "am-launch: out of memory for %d ranks\n", n);
        rc = 1;
        goto out;
    }
    gethostname(host, sizeof(host) - 1);
    snprintf(job_id, sizeof(job_id), "local-%ld-%d", (long)time(NULL), (int)getpid());
    for (int r = 0; r < n; r++) {
        info[r] = (struct am_boot_info){.rank = r, .size = n, .local_rank = r, .local_size = n, .node_id = 0,
                                        .n_nodes = 1};
        snprintf(info[r].host, sizeof(info[r].host), "%s", host);
        snprintf(info[r].job_id, sizeof(info[r].job_id), "%s", job_id);
        fd[r] = -1;
    }
    srv = am_boot_server_new(n, info);
    if (!srv || pipe2(sigpipe, O_CLOEXEC | O_NONBLOCK) < 0) {
        fprintf(stderr, "am-launch: cannot set up the launcher: %s\n", strerror(errno));
        rc = 1;
        goto out;
    }
    sigpipe_w = sigpipe[1];
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGCHLD, &sa, NULL);

    for (int r = 0; r < n; r++) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
            fprintf(stderr, "am-launch: socketpair: %s\n", strerror(errno));
            rc = 1;
            break;
        }
        fcntl(sv[1], F_SETFD, 0); /* the child's end survives exec */
        pid[r] = spawn(o, r, sv[1], job_id);
        close(sv[1]);
        fd[r] = sv[0];
        if (pid[r] < 0) {
            fprintf(stderr, "am-launch: fork: %s\n", strerror(errno));
            rc = 1;
            break;
        }
        alive++;
    }

    double kill_at = 0;
    int stopping = rc != 0;
    if (stopping)
        kill_at = now() + o->grace_s;
    for (int r = 0; r < n && stopping; r++)
        if (pid[r] > 0)
            kill(pid[r], SIGTERM);

    while (alive > 0) {
        int np = 0;
        pfd[np++] = (struct pollfd){.fd = sigpipe[0], .events = POLLIN};
        for (int r = 0; r < n; r++)
            pfd[np++] = (struct pollfd){.fd = fd[r], .events = POLLIN};
        int timeout = stopping ? 100 : -1;
        if (poll(pfd, (nfds_t)np, timeout) < 0 && errno != EINTR)
            break;
        char drain[64];
        while (read(sigpipe[0], drain, sizeof(drain)) > 0)
            ;
        if (pending_signal) {
            int sig = pending_signal;
            pending_signal = 0;
            fprintf(stderr, "am-launch: got %s, stopping every rank\n", strsignal(sig));
            for (int r = 0; r < n; r++)
                if (pid[r] > 0)
                    kill(pid[r], sig);
            if (!stopping) {
                stopping = 1;
                kill_at = now() + o->grace_s;
                rc = 128 + sig;
            }
        }
        for (int r = 0; r < n; r++) {
            if (fd[r] < 0 || !(pfd[r + 1].revents & (POLLIN | POLLHUP)))
                continue;
            int status = 0;
            enum am_boot_event ev = am_boot_server_serve(srv, r, fd[r], &status, msg, sizeof(msg));
            if (ev == AM_BOOT_OK)
                continue;
            if (ev == AM_BOOT_ABORTED || ev == AM_BOOT_BAD) {
                fprintf(stderr, "am-launch: rank %d %s: %s\n", r, ev == AM_BOOT_BAD ? "misbehaved" : "aborted the job",
                        msg);
                if (!stopping) {
                    stopping = 1;
                    kill_at = now() + o->grace_s;
                    rc = ev == AM_BOOT_ABORTED && status ? status : 1;
                    first_failed = r;
                    for (int k = 0; k < n; k++)
                        if (pid[k] > 0)
                            kill(pid[k], SIGTERM);
                }
            }
            close(fd[r]);
            fd[r] = -1;
            am_boot_server_drop(srv, r);
        }
        int status;
        pid_t done;
        while ((done = waitpid(-1, &status, WNOHANG)) > 0) {
            int r = 0;
            while (r < n && pid[r] != done)
                r++;
            if (r == n)
                continue;
            pid[r] = 0;
            alive--;
            if (fd[r] >= 0) {
                close(fd[r]);
                fd[r] = -1;
            }
            am_boot_server_drop(srv, r);
            if (status_code(status) == 0 || stopping)
                continue;
            describe(r, status, msg, sizeof(msg));
            fprintf(stderr, "am-launch: %s; stopping the other ranks\n", msg);
            first_failed = r;
            rc = status_code(status);
            stopping = 1;
            kill_at = now() + o->grace_s;
            for (int k = 0; k < n; k++)
                if (pid[k] > 0)
                    kill(pid[k], SIGTERM);
        }
        if (stopping && alive > 0 && now() > kill_at) {
            for (int r = 0; r < n; r++)
                if (pid[r] > 0)
                    kill(pid[r], SIGKILL);
            kill_at = now() + 3600;
        }
    }
    if (first_failed >= 0)
        fprintf(stderr, "am-launch: job failed: rank %d failed first (exit status %d)\n", first_failed, rc);
out:
    for (int r = 0; fd && r < n; r++)
        if (fd[r] >= 0)
            close(fd[r]);
    if (sigpipe[0] >= 0) {
        close(sigpipe[0]);
        close(sigpipe[1]);
    }
    sigpipe_w = -1;
    am_boot_server_free(srv);
    free(pid);
    free(fd);
    free(info);
    free(pfd);
    return rc;
}
