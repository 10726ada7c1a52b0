/* spawn.c - fork + exec of a rank program (spawn.h). */
#include "spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sigrelay.h"

/* The environment of the rank: ours, with the per-rank variables replaced. Built before
 * fork, so the child (of a process that may run PMIx's thread) only calls exec. */
static char **rank_environ(const struct am_spawn *s, int sock, char **block)
{
    extern char **environ;
    static const char *const names[] = {"AM_BOOTSTRAP_FD=", "AM_RANK=", "AM_WORLD_SIZE=", "AM_LOCAL_RANK=",
                                        "AM_JOB_ID=", "AM_LOG_DIR="};
    enum { N = sizeof(names) / sizeof(names[0]) };
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + N + 1, sizeof(char *));
    char *own = malloc(N * 64 + strlen(s->job_id) + strlen(s->log_dir));
    if (!env || !own) {
        free(env);
        free(own);
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int ours = 0;
        for (size_t j = 0; j < N; j++)
            ours |= strncmp(environ[i], names[j], strlen(names[j])) == 0;
        if (!ours)
            env[k++] = environ[i];
    }
    char *p = *block = own; /* the six strings, in one allocation */
    env[k++] = p, p += sprintf(p, "AM_BOOTSTRAP_FD=%d", sock) + 1;
    env[k++] = p, p += sprintf(p, "AM_RANK=%d", s->rank) + 1;
    env[k++] = p, p += sprintf(p, "AM_WORLD_SIZE=%d", s->size) + 1;
    env[k++] = p, p += sprintf(p, "AM_LOCAL_RANK=%d", s->local_rank) + 1;
    env[k++] = p, p += sprintf(p, "AM_JOB_ID=%s", s->job_id) + 1;
    env[k++] = p, sprintf(p, "AM_LOG_DIR=%s", s->log_dir);
    env[k] = NULL;
    return env;
}

/* In the child: never returns. Reports an exec failure's errno on report_fd. */
static void child(const struct am_spawn *s, char **env, int report_fd, pid_t parent)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) /* the supervisor died before prctl */
        _exit(127);
    am_sigrelay_child();
    if (s->own_group)
        setpgid(0, 0);
    execvpe(s->argv[0], s->argv, env);
    int e = errno;
    (void)!write(report_fd, &e, sizeof(e));
    _exit(127);
}

pid_t am_spawn_rank(const struct am_spawn *s, int *fd, char *err, size_t err_len)
{
    int sv[2] = {-1, -1}, report[2] = {-1, -1};
    pid_t pid = -1;
    char **env = NULL, *block = NULL;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 || pipe2(report, O_CLOEXEC) < 0) {
        snprintf(err, err_len, "rank %d: cannot create its bootstrap socket: %s", s->rank, strerror(errno));
        goto fail;
    }
    if (fcntl(sv[1], F_SETFD, 0) < 0) { /* the child's end survives exec */
        snprintf(err, err_len, "rank %d: fcntl: %s", s->rank, strerror(errno));
        goto fail;
    }
    env = rank_environ(s, sv[1], &block);
    if (!env) {
        snprintf(err, err_len, "rank %d: out of memory", s->rank);
        goto fail;
    }
    pid_t parent = getpid();
    pid = fork();
    if (pid < 0) {
        snprintf(err, err_len, "rank %d: fork: %s", s->rank, strerror(errno));
        goto fail;
    }
    if (pid == 0) {
        close(sv[0]);
        close(report[0]);
        child(s, env, report[1], parent);
    }
    close(sv[1]);
    close(report[1]);
    sv[1] = report[1] = -1;
    int e = 0;
    ssize_t n;
    while ((n = read(report[0], &e, sizeof(e))) < 0 && errno == EINTR)
        ;
    if (n == (ssize_t)sizeof(e)) { /* exec failed: the child exits 127 */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        snprintf(err, err_len, "cannot run %s: %s", s->argv[0], strerror(e));
        pid = -1;
        goto fail;
    }
    close(report[0]);
    free(env);
    free(block);
    *fd = sv[0];
    return pid;
fail:
    free(env);
    free(block);
    for (int i = 0; i < 2; i++) {
        if (sv[i] >= 0)
            close(sv[i]);
        if (report[i] >= 0)
            close(report[i]);
    }
    return -1;
}
