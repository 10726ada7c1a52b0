/* reaper.c - the ranks' process groups, the subreaper and the guard (reaper.h). */
#include "reaper.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

enum { ADD = 1, REMOVE = 2 };
struct msg {
    int32_t op;
    int32_t pgid;
};

/* The guard, in the forked child: only async-signal-safe calls (the parent may later run
 * threads, but the guard never does; it is forked before them, so this is for form). */
static void guard(int fd, int32_t *groups, int cap)
{
    static const int ignored[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGTSTP, SIGTTIN,
                                  SIGTTOU};
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_IGN;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof(ignored) / sizeof(ignored[0]); i++)
        sigaction(ignored[i], &sa, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    prctl(PR_SET_NAME, "am-launch-guard");
    int high = fcntl(fd, F_DUPFD, 3); /* out of 0-2 (a supervisor started with stdin closed) */
    if (high >= 0)
        fd = high;
    int null = open("/dev/null", O_RDWR);
    for (int i = 0; null >= 0 && i < 3; i++)
        dup2(null, i);
    if (fd != 3 && dup2(fd, 3) == 3)
        fd = 3;
    close_range(4, ~0U, 0); /* nothing of the supervisor's stays open here */
    int n = 0;
    for (;;) {
        struct msg m;
        ssize_t k = read(fd, &m, sizeof(m));
        if (k < 0 && errno == EINTR)
            continue;
        if (k != (ssize_t)sizeof(m))
            break; /* the supervisor is gone (or closed the pipe at its end) */
        if (m.op == ADD && n < cap && m.pgid > 1) {
            groups[n++] = m.pgid;
        } else if (m.op == REMOVE) {
            for (int i = 0; i < n; i++)
                if (groups[i] == m.pgid) {
                    groups[i] = groups[--n];
                    break;
                }
        }
    }
    /* A group the supervisor did not release: its leader (the rank) may be reaped already,
     * but the group's id stays taken while any member lives. */
    for (int i = 0; i < n; i++)
        kill(-groups[i], SIGKILL);
    _exit(0);
}

int am_reaper_start(struct am_reaper *r, int max_groups, char *err, size_t err_len)
{
    int p[2];
    r->guard = 0;
    r->fd = -1;
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0) {
        snprintf(err, err_len, "cannot become a subreaper (prctl: %s)", strerror(errno));
        return -1;
    }
    int32_t *groups = calloc((size_t)(max_groups > 0 ? max_groups : 1), sizeof(*groups));
    if (!groups || pipe2(p, O_CLOEXEC) < 0) {
        snprintf(err, err_len, "cannot start the guard process: %s", groups ? strerror(errno) : "out of memory");
        free(groups);
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(p[1]);
        guard(p[0], groups, max_groups);
    }
    int e = errno;
    free(groups);
    close(p[0]);
    if (pid < 0) {
        close(p[1]);
        snprintf(err, err_len, "cannot start the guard process (fork: %s)", strerror(e));
        return -1;
    }
    r->guard = pid;
    r->fd = p[1];
    return 0;
}

static void tell(struct am_reaper *r, int op, pid_t pgid)
{
    struct msg m = {.op = op, .pgid = (int32_t)pgid};
    if (r->fd < 0)
        return;
    ssize_t k;
    while ((k = write(r->fd, &m, sizeof(m))) < 0 && errno == EINTR)
        ;
    if (k != (ssize_t)sizeof(m)) { /* the guard is gone: say nothing more */
        close(r->fd);
        r->fd = -1;
    }
}

void am_reaper_add(struct am_reaper *r, pid_t pgid) { tell(r, ADD, pgid); }

void am_reaper_signal(pid_t pgid, int sig)
{
    if (pgid > 1)
        kill(-pgid, sig);
}

void am_reaper_rank_ended(struct am_reaper *r, pid_t pgid)
{
    am_reaper_signal(pgid, SIGKILL);
    tell(r, REMOVE, pgid);
}

int am_reaper_is_guard(struct am_reaper *r, pid_t pid)
{
    if (r->guard <= 0 || pid != r->guard)
        return 0;
    r->guard = 0; /* the caller reaped it */
    return 1;
}

/* Our children but the guard, from /proc/self/task/(every thread)/children; up to cap. */
static int children(const struct am_reaper *r, pid_t *out, int cap)
{
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < cap) {
        if (e->d_name[0] == '.')
            continue;
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/task/%.20s/children", e->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        long pid;
        while (n < cap && fscanf(f, "%ld", &pid) == 1)
            if (pid > 1 && pid != r->guard)
                out[n++] = (pid_t)pid;
        fclose(f);
    }
    closedir(d);
    return n;
}

void am_reaper_sweep(struct am_reaper *r)
{
    pid_t pids[256];
    for (int round = 0; round < 64; round++) { /* each round kills one generation */
        int n = children(r, pids, 256);
        if (n == 0)
            break;
        for (int i = 0; i < n; i++)
            kill(pids[i], SIGKILL);
        for (int i = 0; i < n; i++)
            while (waitpid(pids[i], NULL, 0) < 0 && errno == EINTR)
                ;
    }
    /* zombies of children that ended by themselves */
    for (pid_t p; (p = waitpid(-1, NULL, WNOHANG)) > 0;)
        am_reaper_is_guard(r, p);
}

void am_reaper_stop(struct am_reaper *r)
{
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    if (r->guard > 0)
        while (waitpid(r->guard, NULL, 0) < 0 && errno == EINTR)
            ;
    r->guard = 0;
}
