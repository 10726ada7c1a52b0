/* reaper.h - nothing a rank started outlives its job.
 *
 * Every rank program runs in its own process group, led by the rank (spawn.h, own_group),
 * so that a rank and whatever it started (a shell's children, a data loader) are one unit:
 *   - am_reaper_signal: the supervisor signals the whole group, never the rank's pid alone
 *     (stop signals, and the SIGKILL after the grace period);
 *   - am_reaper_rank_ended: once the rank has exited, and before it is reaped (so its pid,
 *     the group's id, cannot be reused yet), whatever is left of the group gets SIGKILL;
 *   - the supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER): a process that left its
 *     group (setsid) is handed to the supervisor when its parent dies, and am_reaper_sweep,
 *     at the end of the job, kills and reaps every child still there;
 *   - when the supervisor itself is killed (SIGKILL, the OOM killer), the ranks die with it
 *     (PR_SET_PDEATHSIG, spawn.c), and a guard process forked by am_reaper_start kills the
 *     ranks' process groups: it waits on a pipe whose only writer is the supervisor, learns
 *     each group there (am_reaper_add, and its removal in am_reaper_rank_ended), and at the
 *     pipe's end (the supervisor is gone, whichever way) sends SIGKILL to every group it still
 *     knows, then exits. It ignores the stop signals (a Ctrl-C must not take it first), holds
 *     no file of the supervisor's (its standard streams are /dev/null) and is named
 *     "am-launch-guard" (ps -o comm). A process that left its group is out of its reach.
 * Errors of these calls are ignored: each is best effort, and the job goes on without it.
 * The state is the caller's (struct am_reaper), one per supervisor.
 */
#ifndef AM_REAPER_H
#define AM_REAPER_H

#include <stddef.h>
#include <sys/types.h>

struct am_reaper {
    pid_t guard; /* 0: none (not started, or it ended) */
    int fd;      /* the pipe to the guard; -1: none */
};

/* Makes the caller a child subreaper and forks the guard, which keeps up to max_groups
 * groups. Call it while the process has one thread (before PMIx_Init). Returns 0, or -1
 * with a message (the job can run without it). */
int am_reaper_start(struct am_reaper *r, int max_groups, char *err, size_t err_len);
/* The guard learns the rank group pgid (the rank's pid). */
void am_reaper_add(struct am_reaper *r, pid_t pgid);
/* sig to every process of the group. */
void am_reaper_signal(pid_t pgid, int sig);
/* The rank that leads pgid has exited and is not reaped yet: SIGKILL to what is left of its
 * group; the guard forgets it. */
void am_reaper_rank_ended(struct am_reaper *r, pid_t pgid);
/* Whether pid is the guard; a caller that reaps it (waitpid(-1)) passes it here. */
int am_reaper_is_guard(struct am_reaper *r, pid_t pid);
/* The end of the job: SIGKILL to every child but the guard (processes handed over as a
 * subreaper), until none is left, each reaped. */
void am_reaper_sweep(struct am_reaper *r);
/* Closes the pipe (the guard kills the groups it still knows, then exits) and reaps it. */
void am_reaper_stop(struct am_reaper *r);

#endif
