/* spawn.h - starting one rank program under its supervisor.
 *
 * The rank program gets one end of a new unix socketpair as AM_BOOTSTRAP_FD (its
 * bootstrap, bootstrap.h) and these variables, on top of what the supervisor exported for
 * every rank (AM_RECIPE, AM_TOPOLOGY_FILE, AM_DRY_RUN):
 *   AM_RANK, AM_WORLD_SIZE, AM_LOCAL_RANK, AM_JOB_ID, AM_LOG_DIR.
 * The environment is built before fork (no setenv: a PMIx client runs a thread).
 * The child dies with its supervisor (PR_SET_PDEATHSIG = SIGKILL): a rank never outlives
 * the process that records its exit and relays its bootstrap. With own_group (both
 * supervisors set it) it starts its own process group: signals for the whole terminal's job
 * (Ctrl-C) reach only the supervisor, which forwards them once, to the whole group, and
 * whatever the rank started goes with it (reaper.h). A program that cannot be executed is
 * reported here (not as a rank that exits 127).
 */
#ifndef AM_SPAWN_H
#define AM_SPAWN_H

#include <stddef.h>
#include <sys/types.h>

struct am_spawn {
    char *const *argv; /* the rank program and its arguments (searched in PATH) */
    int rank, size, local_rank;
    const char *job_id;
    const char *log_dir; /* absolute */
    int own_group;       /* setpgid(0, 0) in the child */
};

/* Forks and execs. Returns the child's pid and sets *fd to the supervisor's end of the
 * socket (close-on-exec); or returns -1 with a message in err ("cannot run PROG: ..."). */
pid_t am_spawn_rank(const struct am_spawn *s, int *fd, char *err, size_t err_len);

#endif
