/* validate.h - sbatch, salloc and srun (the user's own privileges): read the recipe, apply
 * the --am-* overrides and check it with the recipe library, at the earliest point each
 * rule can be checked.
 *
 *   sbatch/salloc (allocator context), slurm_spank_init_post_opt: the option syntax, the
 *     recipe file (found in the current directory, then in recipe_path), every rule that
 *     needs no allocation (am_validate with no world). A problem rejects the submission.
 *     On success the settings go to the job's control environment (env.h) and the
 *     --am-recipe/--am-log-dir values forwarded to the job's srun steps are replaced by
 *     absolute paths, so a script that changes directory still finds the same files.
 *   srun (local context), slurm_spank_init_post_opt: the same checks, before srun waits
 *     for an allocation (a problem ends srun there); slurm_spank_local_user_init: the rules
 *     that need the step's size (S_JOB_NNODES, S_JOB_TOTAL_TASK_COUNT: dp, ep, batch), tp
 *     against the admin's NVLink domain, and the GPU memory. A problem is printed and the
 *     step is stopped before its command runs (env.h: SLURM_SPANK_AM_STOP). On success the
 *     settings go to srun's environment for slurmstepd (env.h), which checks on each node
 *     what srun cannot know: where the tasks really run.
 *
 * --am-dry-run: sbatch/salloc check, print a summary and exit 0 without submitting; srun
 * prints the plan for its step (the table of am-plan) and its tasks end with exit code 0
 * without running the command.
 */
#ifndef AM_SPANK_VALIDATE_H
#define AM_SPANK_VALIDATE_H

#include <slurm/spank.h>

#include "config.h"

int am_submit_check(spank_t sp, const struct am_config *cfg);   /* allocator: init_post_opt */
int am_step_precheck(spank_t sp, const struct am_config *cfg);  /* local: init_post_opt */
int am_step_check(spank_t sp, const struct am_config *cfg);     /* local: local_user_init */
void am_check_fini(void);                                       /* slurm_spank_exit */

#endif
