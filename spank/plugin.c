/* plugin.c - spank_am.so: the entry points Slurm calls, each dispatching on the context.
 *
 *   context                         init                 init_post_opt     local_user_init  user_init / task_init
 *   sbatch, salloc (S_CTX_ALLOCATOR) config, options      validate.c        -                -
 *   srun (S_CTX_LOCAL)               config, options      validate.c        validate.c       -
 *   slurmstepd (S_CTX_REMOTE, root)  config, options      -                 -                env.c
 *   slurmd, prolog/epilog            nothing
 *
 * A job that uses no --am-* option and no AM_RECIPE sees no output, no change to its
 * environment and no failure from this plugin. Install it `required` in plugstack.conf
 * (docs/admin.md): Slurm ignores the errors of optional plugins.
 */
#include <stdbool.h>

#include <slurm/spank.h>

#include "config.h"
#include "env.h"
#include "options.h"
#include "validate.h"

SPANK_PLUGIN(am, 1)

/* The module's one context: the admin's configuration. */
static struct {
    struct am_config cfg;
    bool cfg_ok;
    char cfg_error[1024];
} plugin;

static bool user_side(spank_context_t c) { return c == S_CTX_LOCAL || c == S_CTX_ALLOCATOR; }

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    spank_context_t c = spank_context();
    if (!user_side(c) && c != S_CTX_REMOTE)
        return 0; /* slurmd: nothing to do, and nothing that may fail */
    char why[256];
    am_config_init(&plugin.cfg);
    plugin.cfg_ok = am_config_parse(&plugin.cfg, ac, av, plugin.cfg_error, sizeof(plugin.cfg_error)) == 0;
    if (am_opts_register(sp, why, sizeof(why)) < 0 && user_side(c)) {
        slurm_error("am: %s", why);
        return -1;
    }
    if (!plugin.cfg_ok && user_side(c)) {
        /* Every command fails until the admin fixes it: a silent default would hide it. */
        slurm_error("am: %s", plugin.cfg_error);
        return -1;
    }
    return 0; /* in slurmstepd an error is carried to task_init instead (env.c) */
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    switch (spank_context()) {
    case S_CTX_ALLOCATOR:
        return am_submit_check(sp, &plugin.cfg);
    case S_CTX_LOCAL:
        return am_step_precheck(sp, &plugin.cfg);
    default:
        return 0;
    }
}

int slurm_spank_local_user_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return spank_context() == S_CTX_LOCAL ? am_step_check(sp, &plugin.cfg) : 0;
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    if (spank_context() != S_CTX_REMOTE)
        return 0;
    return am_env_user_init(sp, &plugin.cfg, plugin.cfg_ok ? NULL : plugin.cfg_error);
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return spank_context() == S_CTX_REMOTE ? am_env_task_init(sp) : 0;
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
    (void)sp;
    (void)ac;
    (void)av;
    am_check_fini();
    return 0;
}
