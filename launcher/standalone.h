/* standalone.h - `am-launch --nproc N`: N ranks on this machine, no Slurm.
 *
 * Forks N rank programs, each with one end of a socketpair as AM_BOOTSTRAP_FD, serves
 * their bootstrap (boot_server.h), and supervises them: the job is all-or-nothing, so the
 * first rank to fail (non-zero exit, signal, or an abort request) makes the launcher stop
 * the others (SIGTERM, then SIGKILL after a grace period) and exit with that rank's status.
 * SIGINT and SIGTERM sent to the launcher are forwarded to every rank.
 */
#ifndef AM_STANDALONE_H
#define AM_STANDALONE_H

struct am_launch_opts {
    int nproc;
    const char *recipe;     /* absolute path, exported as AM_RECIPE */
    char *const *argv;      /* the rank program and its arguments */
    double grace_s;         /* SIGTERM -> SIGKILL */
};

/* Returns the exit status for am-launch: 0, the first failed rank's exit code, or
 * 128 + its signal. Messages go to stderr prefixed "am-launch: ". */
int am_launch_standalone(const struct am_launch_opts *o);

#endif
