/* preempt.h - a save before Slurm's time limit or a preemption, then a requeue.
 *
 * Slurm warns a job LEAD seconds before its time limit with `#SBATCH --signal=B:USR1@LEAD`;
 * the job script forwards SIGUSR1 to its step (srun hands it to every task, am-launch to its
 * rank). A rank that gets SIGUSR1 only notes it. At the end of every step, when checkpoints
 * are enabled, the ranks agree (the maximum of their notes over the job: one small all-reduce
 * over tp, pp and dp), so that every rank sees the warning at the same step boundary, even
 * when the signal reached the ranks during different steps. They then save a checkpoint of
 * that step (unless ckpt_every_steps just saved it), log a "preempted" record, and exit with
 * AM_EXIT_REQUEUE (util.h), which am-launch passes on as the task's status and the job script
 * turns into `scontrol requeue`; the requeued job restores `latest` by itself
 * (checkpoint.restore_from: latest).
 *
 * SIGTERM stays what Slurm makes it: the step's cancel (the supervisor stops the rank). */
#ifndef AM_PREEMPT_H
#define AM_PREEMPT_H

#include <stdbool.h>
#include <stddef.h>

/* Installs the SIGUSR1 handler (which only sets a flag). 0, or -1 with a message. */
int am_preempt_install(char *err, size_t err_len);
/* Whether this rank has been warned (SIGUSR1 since am_preempt_install). */
bool am_preempt_noted(void);

#endif
