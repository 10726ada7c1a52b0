/* launch.h - am-launch's two ways of running a job, and the options they share.
 *
 * Standalone, `am-launch --nproc N` (standalone.c): N ranks on this machine, no Slurm. The
 * launcher forks the N rank programs, serves their bootstrap itself (boot_server.h) and
 * supervises them as one job.
 *
 * Under a PMIx server, `srun --mpi=pmix am-launch` (pmix_task.c): one am-launch per Slurm
 * task. Each is its rank's supervisor and PMIx client: it forks the one rank program and
 * relays its bootstrap requests to PMIx (put, commit + fence, get, abort).
 *
 * Without PMIx, `srun --mpi=none am-launch` (env_task.c): one am-launch per Slurm task, as
 * above, that learns its place from Slurm's environment; the task of local rank 0 on the
 * step's first node also serves the step's bootstrap over TCP (boot_tcp.h), which every task
 * joins with a munge credential (boot_join.h) and relays its rank's requests to.
 *
 * Both modes:
 *   - hand the rank program its bootstrap socket in AM_BOOTSTRAP_FD (spawn.h);
 *   - forward SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 to the rank(s), and a SIGHUP as SIGTERM,
 *     each to the rank's whole process group;
 *   - leave nothing behind (reaper.h): each rank runs in its own process group, which gets
 *     SIGKILL when the rank ends; processes that left the group are collected by am-launch
 *     as a subreaper and killed at the end; when am-launch itself is killed (SIGKILL), its
 *     guard process kills the ranks' groups;
 *   - append an exit record for every rank to <log dir>/<job id>/rank-<R>.jsonl
 *     (exit_record.h) and say on stderr how a failed rank ended;
 *   - make the job all-or-nothing: the first rank to fail (non-zero exit, signal, or an
 *     abort request) ends the whole job within seconds (standalone: SIGTERM to the other
 *     ranks, SIGKILL after grace_s; under Slurm: SIGINT to the step, and PMIx_Abort when
 *     some rank has not ended 1.5 s later), other ranks' logs get a stop record naming the
 *     failed rank, and am-launch exits with that rank's status (its exit code, or 128 +
 *     signal). Stopped by a signal (standalone), it exits with 128 + that signal: 143 for
 *     SIGTERM, 130 for SIGINT, 129 for SIGHUP.
 * Standalone, the launcher needs one open file per rank (and a few more): it raises its
 * soft open-file limit up to the hard one when that is needed, and refuses to start with a
 * message naming both limits when even the hard one is too low.
 * Messages go to stderr prefixed "am-launch: ".
 */
#ifndef AM_LAUNCH_H
#define AM_LAUNCH_H

struct am_launch_opts {
    int nproc;              /* standalone: ranks to start */
    char *const *argv;      /* the rank program and its arguments */
    const char *log_dir;    /* --log-dir, or NULL: $AM_LOG_DIR, else ./am-logs */
    double grace_s;         /* standalone: SIGTERM -> SIGKILL */
};

/* Each returns am-launch's exit status: 0, the first failed rank's status, or 1 (2 for a
 * usage error) when the launcher itself failed. */
int am_launch_standalone(const struct am_launch_opts *o);
int am_launch_pmix(const struct am_launch_opts *o);
int am_launch_slurm_env(const struct am_launch_opts *o);

#endif
