/* sigrelay.h - the signals a supervisor catches, turned into events of its poll loop.
 *
 * A supervisor (standalone.c, pmix_task.c) waits in poll() on its ranks' sockets. The
 * handler installed here only counts the signal and writes one byte to a self-pipe, so
 * the loop wakes up and, outside the handler, forwards the signal to its ranks or reaps
 * a child:
 *   SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2
 *                                      forwarded to the rank(s) (a SIGHUP as SIGTERM: the
 *                                      job stops the way every stop does);
 *   SIGCHLD                            a rank ended (reap with waitpid(WNOHANG));
 *   SIGPIPE                            ignored (a rank's socket closed under a write).
 * A signal sent by `group_sender` is not forwarded, only reported: under srun that is
 * slurmstepd, which signals every process of the step (srun's forwarding, scancel
 * --signal, the time limit), so the rank already got it; forwarding it would deliver it
 * twice. The counters are the only state shared with the handler (one static struct).
 */
#ifndef AM_SIGRELAY_H
#define AM_SIGRELAY_H

#include <sys/types.h>

/* Installs the handlers; returns the read end of the self-pipe (non-blocking, close-on-
 * exec) to poll for POLLIN, or -1 with errno set. group_sender: see above (0: none). */
int am_sigrelay_install(pid_t group_sender);
/* Closes the pipe. The relayed signals stay ignored: the job has ended, and a late stop
 * signal (Slurm repeats them) must not change the supervisor's exit status. */
void am_sigrelay_uninstall(void);
/* Drains the pipe; returns the next signal received (SIGTERM, SIGINT, SIGHUP, SIGUSR1,
 * SIGUSR2),
 * once per delivery, or 0 when none is pending. *forward is 1 when the supervisor must pass
 * it on, 0 when the rank got it from the same sender. */
int am_sigrelay_take(int *forward);
/* In a forked child before exec: default dispositions for every signal handled here and
 * an empty signal mask, so the rank program starts as if spawned by a shell. */
void am_sigrelay_child(void);
/* "SIGTERM" for 15 (glibc's abbreviation with the prefix), "SIG?" when unknown. */
const char *am_signal_name(int sig, char *buf, int len);

#endif
