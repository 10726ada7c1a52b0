/* slurm_task.h - one Slurm task's supervisor (launch.h), whatever serves the step's bootstrap:
 * PMIx (pmix_task.c) or the step's own TCP boot server (env_task.c). The supervisor forks the
 * rank, answers its HELLO and ABORT itself, hands its put, fence, get and allgather to the
 * bootstrap's backend, forwards signals, records the rank's exit and, when the rank fails
 * first, stops the step (pmix_task.c's header tells how) and ends it with the backend's abort
 * when some rank has not ended.
 */
#ifndef AM_SLURM_TASK_H
#define AM_SLURM_TASK_H

#include <stdint.h>
#include <sys/types.h>

#include "boot_proto.h"
#include "bootstrap.h"
#include "exit_record.h"
#include "launch.h"
#include "reaper.h"

struct task;

struct am_task_ops {
    /* The rank's PUT, FENCE, GET (rank in range) or ALLGATHER: answered at once, or later by
     * finish (then t->busy is set, and t->deadline when the supervisor should give up). */
    void (*relay)(struct task *t, const struct am_boot_req *req, const char *key, void *value);
    /* The fd the loop polls for the backend (-1: none); drain is called when it is readable. */
    int (*wait_fd)(struct task *t);
    void (*drain)(struct task *t);
    /* While busy, after each wake-up: answers the rank when the operation is over or timed out
     * (and clears t->busy). */
    void (*finish)(struct task *t, int timed_out);
    /* Ends the whole step at once (the rank failed, or this task cannot run it). */
    void (*abort)(struct task *t, int status, const char *msg);
};

struct task {
    const struct am_launch_opts *o;
    const struct am_task_ops *ops;
    void *backend;
    int failed_first;   /* this task's rank failed and it is stopping the step */
    int because_status; /* stopped because another rank failed: that failure's status */
    int aborted;        /* the backend's abort was called */
    struct am_boot_info info;
    char log_dir[4096];
    int sig_fd, fd;
    pid_t pid;
    int stop_signal;
    struct am_oom_watch oom;
    int abort_requested, abort_status;
    char abort_msg[512];
    double kill_at;
    int busy;        /* an operation is in flight: the rank waits for its answer */
    double deadline; /* CLOCK_MONOTONIC seconds when the supervisor gives up on it; 0: never */
    struct am_reaper reaper; /* the rank's process group (reaper.h) */
};

double am_task_now(void);
/* Answers the rank's request with an error message. */
void am_task_reply_error(struct task *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Sets up t for o and ops, and starts the reaper's guard: first, while this process has one
 * thread. */
void am_task_begin(struct task *t, const struct am_launch_opts *o, const struct am_task_ops *ops);
/* From the layout on (t->info set, the backend up): prepares the log directory, spawns the
 * rank and supervises it; returns the task's exit status. A failure before the rank runs
 * aborts the step through the backend. */
int am_task_run(struct task *t);
/* Kills what the rank left, stops the guard, closes the rank's socket, restores signals. */
void am_task_end(struct task *t);

#endif
