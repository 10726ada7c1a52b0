/* exit_record.h - how a rank ended, told once to the user and once to the rank's log.
 *
 * The supervisor (standalone or under srun) appends one JSON line to the rank's log,
 * <log dir>/<job id>/rank-<R>.jsonl, the same file the rank program writes its own records
 * to (opened with O_APPEND, the line written with one write(), so records never interleave):
 *
 *   {"type":"exit","rank":2,"host":"n1","pid":4242,"status":139,"signal":11,
 *    "signal_name":"SIGSEGV","core_dumped":false,"oom_killed":false,
 *    "stop_signal":null,"time":1767000000.123456}
 *
 *   status            what am-launch exits with for this rank: the exit code, or 128 + signal
 *   signal            the signal that killed the rank, 0 when it exited
 *   signal_name       "SIGSEGV", or null
 *   core_dumped       the kernel wrote a core file
 *   oom_killed        true: the kernel's OOM killer killed it (the cgroup's oom_kill counter
 *                     grew while it ran and it died of SIGKILL); null: no memory cgroup found
 *   stop_signal       the last signal the supervisor sent to stop the rank before it ended
 *                     (SIGTERM or SIGINT forwarded from Slurm or the user, or SIGTERM/SIGKILL
 *                     because another rank failed), or null: tells "stopped" from "failed"
 *   time              wall-clock seconds since 1970 when the supervisor saw the end
 *
 * The OOM counter is read from the supervisor's own memory cgroup (/proc/self/cgroup; the
 * rank inherits it): cgroup v2 memory.events, or v1 memory.oom_control, "oom_kill N".
 */
#ifndef AM_EXIT_RECORD_H
#define AM_EXIT_RECORD_H

#include <limits.h>
#include <stddef.h>
#include <sys/types.h>

/* The cgroup's oom_kill counter when a rank started. */
struct am_oom_watch {
    char path[PATH_MAX]; /* empty: no memory cgroup found (oom_killed is unknown) */
    long before;
};

void am_oom_watch_start(struct am_oom_watch *w);
/* 1: the rank (ended with wait status `status`) was killed by the OOM killer; 0: it was
 * not; -1: unknown. */
int am_oom_watch_killed(const struct am_oom_watch *w, int status);

struct am_exit {
    int rank;
    const char *host;
    pid_t pid;
    int status;           /* from waitpid */
    int oom_killed;       /* 1, 0, -1 unknown */
    int stop_signal;      /* 0: none */
};

/* The exit status am-launch reports for a rank: its exit code, or 128 + signal. */
int am_exit_code(int status);
/* True when the rank failed: a non-zero exit (but AM_EXIT_REQUEUE, util.h: saved for a requeue) or a signal. */
int am_exit_failed(int status);
/* "rank 2 on n1 exited with status 7", "rank 2 on n1 was killed by signal 11 (SIGSEGV,
 * Segmentation fault), core dumped", "... killed by the OOM killer (signal 9, SIGKILL)". */
void am_exit_describe(const struct am_exit *e, char *buf, size_t len);

/* The log directory: `option` (--log-dir) if set, else $AM_LOG_DIR, else ./am-logs, made
 * absolute. Then creates <dir>/<job_id>/ (and its parents). Returns 0, or -1 with a message
 * naming the directory in err. `out` gets the absolute log dir (without the job id). */
int am_log_dir_prepare(const char *option, const char *job_id, char *out, size_t out_len, char *err,
                       size_t err_len);

/* Appends the exit record to <log_dir>/<job_id>/rank-<R>.jsonl. Returns 0, or -1 with a
 * message in err. */
int am_exit_record(const char *log_dir, const char *job_id, const struct am_exit *e, char *err, size_t err_len);

/* The stop record: a rank that had not failed is being stopped, and why. Written to the
 * rank's log when the stop begins (before its exit record):
 *
 *   {"type":"stop","rank":0,"host":"n1","signal":"SIGTERM","by":"am-launch","because_rank":3,
 *    "because_host":"n2","because":"rank 3 on n2 was killed by signal 11 (SIGSEGV, ...)",
 *    "because_time":1767000000.1,"time":1767000000.2}
 *
 *   signal        the stop signal sent (standalone) or received from Slurm (under srun)
 *   by            "am-launch" (the standalone launcher stops the others after a failure, or
 *                 forwards the user's SIGINT/SIGTERM) or "slurm" (slurmstepd signalled the step:
 *                 after another task's failure, scancel, the time limit, preemption)
 *   because_*     the rank whose failure stopped the job, its host, what happened and when
 *                 (wall clock); null when the stop did not come from a failure of the job
 *                 (the user's signal; Slurm's, with no failure recorded)
 * Under srun a task does not know why slurmstepd signals it: the failed task's supervisor
 * leaves the first failure in <log dir>/<job id>/first-failure.json (am_failure_mark) before
 * it stops the step, and the others read it (am_failure_read) when the signal comes. */
struct am_stop {
    int rank;
    const char *host;
    int signal;
    const char *by;
    int because_rank;           /* -1: none */
    const char *because_host;   /* NULL: unknown */
    const char *because;        /* NULL: none */
    double because_time;        /* 0: unknown */
};
int am_stop_record(const char *log_dir, const char *job_id, const struct am_stop *s, char *err, size_t err_len);

/* 1 when the last line of rank's log is its exit record (the rank has ended). */
int am_log_has_exit(const char *log_dir, const char *job_id, int rank);

/* first-failure.json: {"rank":3,"status":139,"host":"n2","what":"rank 3 on n2 was killed by ...",
 * "time":T} (status: what that rank's am-launch exits with).
 * am_failure_mark creates it unless it exists (written under a private name, then link()ed:
 * the first supervisor wins, and no reader sees it half-written); returns 1
 * when written, 0 when another supervisor was first, -1 on an error (errno set).
 * am_failure_read: 0 and the fields, or -1 when there is none (or it cannot be read). */
int am_failure_mark(const char *log_dir, const char *job_id, int rank, int status, const char *host,
                    const char *what);
int am_failure_read(const char *log_dir, const char *job_id, int *rank, int *status, char *host, size_t host_len,
                    char *what, size_t what_len, double *time);

#endif
