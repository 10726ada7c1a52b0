/* env.h - slurmstepd (remote context, as root): the environment of an am step's tasks.
 *
 * sbatch/salloc and srun check the recipe and the layout as the user, then hand the
 * settings to slurmstepd in the step's environment, as SLURM_SPANK_AM_RECIPE (absolute),
 * SLURM_SPANK_AM_TP/PP/EP/CP and SLURM_SPANK_AM_LOG_DIR (only those the user gave) and
 * SLURM_SPANK_AM_LAYOUT ("tp=8,pp=4,cp=1,ep=1[,dp=2]", the checked layout). sbatch/salloc
 * put them in the job's control environment (spank_job_control_setenv), which reaches the
 * batch script and every step; srun sets them in its own environment for its step, over
 * the job's. The SLURM_ prefix makes them survive --export=NONE. Only the plugin sets
 * them: sbatch and srun remove any they inherit before deciding anything.
 *
 * When srun finds the step invalid, or runs --am-dry-run, it prints why (or the plan) and
 * hands over SLURM_SPANK_AM_STOP=error or =dry-run instead: the step is launched, and each
 * task ends in slurm_spank_task_init, before the command is executed, with exit code 1 or
 * 0. (Failing srun's local_user_init instead leaves the step allocated in slurmctld until
 * the job ends on Slurm 22.05, so the job's next srun waits forever for its resources.)
 *
 * Here, as root, the plugin never opens a path the user named. It checks the syntax of
 * the handed-over values; on a GPU cluster (gpus_per_node or nvlink_domain set) it checks
 * where this node's tasks really run, which srun cannot know: at most one task per GPU,
 * and each tensor-parallel group whole on the node and inside one NVLink domain. It
 * exports AM_RECIPE, AM_TP, AM_PP, AM_EP, AM_CP, AM_LOG_DIR (the
 * user's, else the admin's log_root/JOBID), the admin's env= defaults (without replacing a
 * variable the user set) and CUDA_DEVICE_MAX_CONNECTIONS=1 when tp > 1 (Megatron's rule:
 * tensor-parallel communication must be issued in order to overlap with compute), and
 * removes the SLURM_SPANK_AM_* variables from the tasks' environment. A step without
 * SLURM_SPANK_AM_RECIPE or _STOP is not an am step and is left exactly as it is.
 *
 * Nothing here fails slurm_spank_user_init (an error there drains the node): a problem is
 * recorded and reported by slurm_spank_task_init, which fails the tasks.
 */
#ifndef AM_SPANK_ENV_H
#define AM_SPANK_ENV_H

#include <slurm/spank.h>

#include "config.h"

/* The names handed over, without the SLURM_SPANK_ prefix; NULL-terminated. */
extern const char *const am_handover_names[];
#define AM_HANDOVER_PREFIX "SLURM_SPANK_"

/* slurm_spank_user_init in slurmstepd. cfg_error: why plugstack.conf is invalid, or NULL. */
int am_env_user_init(spank_t sp, const struct am_config *cfg, const char *cfg_error);

/* slurm_spank_task_init in slurmstepd: fails the task when user_init recorded a problem. */
int am_env_task_init(spank_t sp);

#endif
