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
/* True when the rank failed: a non-zero exit or a signal. */
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

#endif
