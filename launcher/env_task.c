/* env_task.c - `srun --mpi=none am-launch` (or MpiDefault=none): one task's supervisor
 * (slurm_task.h) whose bootstrap is the step's own TCP boot server (boot_tcp.h).
 *
 * The task learns its place from Slurm's environment (slurm_env.h). The task of local rank 0
 * on the step's first node serves the bootstrap from a thread; every task joins it with its
 * munge credential before it starts its rank, then relays the rank's put, fence, get and
 * allgather to it as they are, and its replies back (HELLO is answered here). The server
 * enforces the fences' timeouts; the supervisor gives up itself 5 s after one (then the
 * connection is closed: a late reply would answer the wrong request). The step's abort is
 * `scancel --signal=KILL JOB.STEP`; a task that cannot serve or join aborts the step too (the
 * other ranks would wait for it until their timeout).
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "boot_tcp.h"
#include "sigrelay.h"
#include "slurm_env.h"
#include "slurm_task.h"

/* How long a task tries to reach the boot server (its task may start later than this one). */
#define JOIN_TIMEOUT_S 60
/* How long the serving task, its rank done, waits for the other tasks to leave. */
#define LINGER_S 30

struct env_task {
    struct task task;
    struct am_slurm_step st;
    struct am_boot_tcp_server *srv;
    int conn;  /* the joined connection to the boot server; -1: lost */
    char server[300];
};

static void lost(struct env_task *e, const char *what)
{
    am_task_reply_error(&e->task, "lost the boot server at %s (%s): its task on %s may have ended", e->server, what,
                        e->st.first_host);
    if (e->conn >= 0)
        close(e->conn);
    e->conn = -1;
    e->task.busy = 0;
}

static void relay(struct task *t, const struct am_boot_req *req, const char *key, void *value)
{
    struct env_task *e = t->backend;
    if (e->conn < 0) {
        am_task_reply_error(t, "the connection to the boot server at %s was lost earlier", e->server);
        return;
    }
    struct am_boot_req r = *req;
    r.key_len = (uint32_t)strlen(key);
    if (am_io_write_full(e->conn, &r, sizeof(r)) < 0 || am_io_write_full(e->conn, key, r.key_len) < 0 ||
        am_io_write_full(e->conn, value, r.val_len) < 0) {
        lost(e, strerror(errno));
        return;
    }
    t->busy = 1;
    t->deadline = req->timeout_s > 0 ? am_task_now() + req->timeout_s + 5 : 0;
}

static int wait_fd(struct task *t) { return t->busy ? ((struct env_task *)t->backend)->conn : -1; }

static void drain(struct task *t) { (void)t; }

static void finish(struct task *t, int timed_out)
{
    struct env_task *e = t->backend;
    struct pollfd pfd = {.fd = e->conn, .events = POLLIN};
    if (poll(&pfd, 1, 0) <= 0) {
        if (timed_out)
            lost(e, "no answer in time");
        return;
    }
    struct am_boot_rep rep;
    char *payload = NULL;
    size_t max = (size_t)t->info.size * AM_BOOT_MAX_VALUE + 1024;
    if (am_io_read_full(e->conn, &rep, sizeof(rep)) < 0 || rep.len > max ||
        !(payload = malloc(rep.len + 1)) || am_io_read_full(e->conn, payload, rep.len) < 0) {
        free(payload);
        lost(e, "the connection closed");
        return;
    }
    am_boot_reply(t->fd, rep.status, payload, rep.len);
    free(payload);
    t->busy = 0;
}

static void env_abort(struct task *t, int status, const char *msg)
{
    extern char **environ;
    (void)status;
    (void)msg;
    char target[96];
    char *argv[] = {"scancel", "--signal=KILL", target, NULL};
    snprintf(target, sizeof(target), "%llu.%llu", ((struct env_task *)t->backend)->st.job,
             ((struct env_task *)t->backend)->st.step);
    pid_t pid = fork();
    if (pid == 0) {
        am_sigrelay_child();
        execvpe(argv[0], argv, environ);
        _exit(127);
    }
    int st = 0; /* its status: the step may be ending already */
    if (pid < 0 || (waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 127))
        fprintf(stderr, "am-launch: cannot run `scancel --signal=KILL %s`: the other ranks may wait until their "
                "timeout\n", target);
}

static const struct am_task_ops env_ops = {relay, wait_fd, drain, finish, env_abort};

/* The message of a step that has neither PMIx nor a working TCP bootstrap. */
static void neither(const char *why)
{
    fprintf(stderr, "am-launch: running in a Slurm step without PMIx, and its bootstrap over TCP with munge failed "
            "(%s): start it with `srun --mpi=pmix am-launch ...` (or set MpiDefault=pmix in slurm.conf), or make "
            "munge and the boot server's port work on every node of the step (docs/admin.md)\n", why);
}

static const char *env(const char *name) { return getenv(name); }

int am_launch_slurm_env(const struct am_launch_opts *o)
{
    struct env_task *e = calloc(1, sizeof(*e));
    char err[1024];
    int rc = 2;
    if (!e) {
        fprintf(stderr, "am-launch: out of memory\n");
        return 1;
    }
    e->conn = -1;
    if (am_slurm_step_read(&e->st, env, err, sizeof(err)) < 0) {
        neither(err);
        free(e);
        return 2;
    }
    struct task *t = &e->task;
    t->backend = e;
    t->info = e->st.info;
    snprintf(e->server, sizeof(e->server), "%s:%d", e->st.server_host, e->st.port);
    am_task_begin(t, o, &env_ops); /* before the server's thread: the reaper's guard */
    if (e->st.serves && !(e->srv = am_boot_tcp_serve(&e->st, err, sizeof(err))))
        e->conn = -1;
    else
        e->conn = am_boot_tcp_join(&e->st, JOIN_TIMEOUT_S, err, sizeof(err));
    if (e->conn < 0) { /* the other tasks would wait for this one until their timeout */
        neither(err);
        if (t->info.size > 1) {
            t->aborted = 1;
            env_abort(t, 2, err);
        }
        goto out;
    }
    rc = am_task_run(t);
out:
    am_task_end(t);
    if (e->conn >= 0)
        close(e->conn);
    am_boot_tcp_stop(e->srv, rc == 0 ? LINGER_S : 0);
    free(e);
    return rc;
}
