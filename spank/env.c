/* env.c - slurmstepd: the environment of an am step's tasks (env.h).
 *
 * Runs as root. Reads only the step's environment (spank_getenv into bounded buffers) and
 * the admin's configuration; opens no file.
 */
#include "env.h"

#include <slurm/slurm.h> /* SLURM_BATCH_SCRIPT, SLURM_INTERACTIVE_STEP */

#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "text.h"

const char *const am_handover_names[] = {"AM_RECIPE", "AM_TP", "AM_PP", "AM_EP", "AM_CP",
                                         "AM_LOG_DIR", "AM_LAYOUT", "AM_STOP", NULL};

#define MAX_CARRIED 8

enum stop { RUN, STOP_ERROR, STOP_DRY_RUN };

/* The module's one context: what user_init found, for task_init to act on. */
static struct {
    bool am_step;
    enum stop stop; /* srun asked that the command not run */
    char carried[MAX_CARRIED][640];
    int n_carried;
} step;

static void carry(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void carry(const char *fmt, ...)
{
    va_list ap;
    if (step.n_carried == MAX_CARRIED)
        return;
    va_start(ap, fmt);
    vsnprintf(step.carried[step.n_carried++], sizeof(step.carried[0]), fmt, ap);
    va_end(ap);
}

/* The value of a hand-over variable. 1: present (in buf), 0: absent, -1: unusable
 * (carried). */
static int handed(spank_t sp, const char *name, char *buf, int len)
{
    char var[64];
    snprintf(var, sizeof(var), AM_HANDOVER_PREFIX "%s", name);
    spank_err_t rc = spank_getenv(sp, var, buf, len);
    if (rc == ESPANK_ENV_NOEXIST)
        return 0;
    if (rc != ESPANK_SUCCESS) {
        carry("the step's %s cannot be read (%s); it is set by the am plugin in sbatch and srun, "
              "do not set it yourself", var, spank_strerror(rc));
        return -1;
    }
    return 1;
}

static void set_task_env(spank_t sp, const char *name, const char *value, int overwrite)
{
    spank_err_t rc = spank_setenv(sp, name, value, overwrite);
    if (rc != ESPANK_SUCCESS && rc != ESPANK_ENV_EXISTS)
        carry("cannot set %s in the tasks' environment (%s); report this to the cluster's admin", name,
              spank_strerror(rc));
}

/* A handed-over path must be absolute and printable (the step's environment is the user's,
 * so it is checked here again, but never opened): NULL, or what is wrong (am_path_problem),
 * carried with the variable's name and value. */
static const char *path_problem(const char *name, const char *p)
{
    char buf[64], shown[AM_SHOWN_LEN];
    const char *why = am_path_problem(p, buf, sizeof(buf));
    if (why)
        carry("the step's " AM_HANDOVER_PREFIX "%s='%s' %s: the am plugin hands over only absolute paths of "
              "printable characters (rename the file or directory that has it; the variable is set by the am plugin "
              "in sbatch and srun, do not set it yourself)", name, am_shown(p, shown, sizeof(shown)), why);
    return why;
}

/* "tp=8,pp=4,cp=1,ep=1[,dp=2]": the tp, or 0 when malformed. */
static long layout_tp(const char *s)
{
    long tp = 0;
    char key[8], num[16];
    for (const char *p = s; *p;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        const char *eq = memchr(p, '=', n);
        if (!eq || (size_t)(eq - p) >= sizeof(key) || n - (size_t)(eq - p) - 1 >= sizeof(num))
            return 0;
        snprintf(key, sizeof(key), "%.*s", (int)(eq - p), p);
        snprintf(num, sizeof(num), "%.*s", (int)(n - (size_t)(eq - p) - 1), eq + 1);
        long v;
        if (am_parse_count(num, 1, 1L << 20, &v) < 0)
            return 0;
        if (!strcmp(key, "tp"))
            tp = v;
        p = comma ? comma + 1 : p + n;
    }
    return tp;
}

/* Where the tasks of this node really run, which srun cannot know: at most one task per
 * GPU, and every tensor-parallel group (tp consecutive ranks) whole on this node and inside
 * one NVLink domain, local task i driving GPU i. A domain larger than a node (multi-node
 * NVLink) is not checked here. */
static void check_placement(spank_t sp, const struct am_config *cfg, long tp)
{
    uint32_t n = 0, g, lm, stepid = 0;
    if (spank_get_item(sp, S_JOB_STEPID, &stepid) != ESPANK_SUCCESS || stepid == SLURM_BATCH_SCRIPT ||
        stepid == SLURM_INTERACTIVE_STEP)
        return; /* the batch script (or salloc's shell) is one task, not the ranks */
    if (spank_get_item(sp, S_JOB_LOCAL_TASK_COUNT, &n) != ESPANK_SUCCESS || n == 0)
        return;
    if (cfg->gpus_per_node && n > (uint32_t)cfg->gpus_per_node)
        carry("this node runs %u tasks of the step but has %d GPUs, and am runs one rank per GPU (use "
              "--ntasks-per-node=%d or fewer)", n, cfg->gpus_per_node, cfg->gpus_per_node);
    int domain = cfg->nvlink_domain ? cfg->nvlink_domain : cfg->gpus_per_node;
    if (tp <= 1 || !domain || (cfg->gpus_per_node && domain > cfg->gpus_per_node))
        return; /* no GPU layout configured, or NVLink across nodes: nothing to check here */
    for (uint32_t l = 0; l < n; l++) {
        if (spank_get_item(sp, S_JOB_LOCAL_TO_GLOBAL_ID, l, &g) != ESPANK_SUCCESS)
            return;
        uint64_t base = g - g % (uint64_t)tp, last = base + (uint64_t)tp - 1;
        for (uint64_t m = base; m <= last; m++) {
            if (m > UINT32_MAX || spank_get_item(sp, S_JOB_GLOBAL_TO_LOCAL_ID, (uint32_t)m, &lm) != ESPANK_SUCCESS) {
                carry("ranks %llu-%llu form a tensor-parallel group (tp %ld), but this node runs only some of them: "
                      "a tensor-parallel group must stay inside one node's NVLink domain (give each node a multiple "
                      "of %ld tasks, e.g. --ntasks-per-node=%ld, and keep the default block distribution)",
                      (unsigned long long)base, (unsigned long long)last, tp, tp, tp);
                return;
            }
            if (domain && lm / (uint32_t)domain != l / (uint32_t)domain) {
                carry("ranks %llu-%llu form a tensor-parallel group (tp %ld), but on this node they drive GPUs %u and "
                      "%u, which are in different NVLink domains of %d GPUs (use a tp that divides %d, and a "
                      "multiple of tp tasks per node)", (unsigned long long)base, (unsigned long long)last, tp, l, lm,
                      domain, domain);
                return;
            }
        }
    }
}

int am_env_user_init(spank_t sp, const struct am_config *cfg, const char *cfg_error)
{
    char recipe[PATH_MAX], val[PATH_MAX], shown[AM_SHOWN_LEN];
    int got = handed(sp, "AM_RECIPE", recipe, sizeof(recipe));
    int stop = handed(sp, "AM_STOP", val, sizeof(val));
    if (got == 0 && stop == 0)
        return 0; /* not an am step: leave it alone */
    step.am_step = true;
    if (stop > 0) { /* srun printed the plan, or why the step cannot run */
        step.stop = strcmp(val, "dry-run") ? STOP_ERROR : STOP_DRY_RUN;
        if (step.stop == STOP_ERROR)
            goto clear;
    }
    if (cfg_error)
        carry("this node's plugstack.conf is invalid: %s (ask the cluster's admin; docs/admin.md lists the keys)",
              cfg_error);
    if (got > 0 && !path_problem("AM_RECIPE", recipe))
        set_task_env(sp, "AM_RECIPE", recipe, 1);

    for (int i = 1; i <= 4; i++) { /* AM_TP, AM_PP, AM_EP, AM_CP */
        long v;
        if (handed(sp, am_handover_names[i], val, sizeof(val)) <= 0)
            continue;
        if (am_parse_count(val, 1, 1L << 20, &v) < 0)
            carry("the step's " AM_HANDOVER_PREFIX "%s='%s' is not a size; it is set by the am plugin in sbatch and "
                  "srun, do not set it yourself", am_handover_names[i], am_shown(val, shown, sizeof(shown)));
        else
            set_task_env(sp, am_handover_names[i], val, 1);
    }

    got = handed(sp, "AM_LOG_DIR", val, sizeof(val));
    if (got > 0 && !path_problem("AM_LOG_DIR", val))
        set_task_env(sp, "AM_LOG_DIR", val, 1);
    else if (got == 0 && cfg->log_root) {
        uint32_t job = 0;
        if (spank_get_item(sp, S_JOB_ID, &job) == ESPANK_SUCCESS) {
            snprintf(val, sizeof(val), "%s%s%u", cfg->log_root,
                     cfg->log_root[strlen(cfg->log_root) - 1] == '/' ? "" : "/", job);
            set_task_env(sp, "AM_LOG_DIR", val, 1);
        }
    }

    if (handed(sp, "AM_LAYOUT", val, sizeof(val)) > 0) {
        long tp = layout_tp(val);
        if (tp == 0)
            carry("the step's " AM_HANDOVER_PREFIX "AM_LAYOUT='%s' is malformed; it is set by the am plugin in "
                  "sbatch and srun, do not set it yourself", am_shown(val, shown, sizeof(shown)));
        else {
            check_placement(sp, cfg, tp);
            if (tp > 1) /* Megatron's rule: tensor-parallel communication overlaps compute in order */
                set_task_env(sp, "CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);
        }
    }

    for (size_t i = 0; i < cfg->n_env; i++) { /* the site's defaults; the user's own values win */
        const char *eq = strchr(cfg->env[i], '=');
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)(eq - cfg->env[i]), cfg->env[i]);
        set_task_env(sp, name, eq + 1, 0);
    }

clear:
    for (size_t i = 0; am_handover_names[i]; i++) {
        snprintf(val, sizeof(val), AM_HANDOVER_PREFIX "%s", am_handover_names[i]);
        spank_unsetenv(sp, val);
    }
    return 0;
}

int am_env_task_init(spank_t sp)
{
    int local = -1;
    if (!step.am_step)
        return 0;
    /* In the task's own process, before the command is executed. Ending it with _exit is
     * what Slurm does when task_init fails, without Slurm's two lines for every task; the
     * reasons are printed once per node, by its first task. (Failing srun's
     * local_user_init instead leaves the step allocated in slurmctld until the job ends on
     * Slurm 22.05, so the job's next srun would wait forever for its resources.) */
    if (step.stop == STOP_ERROR)
        _exit(1); /* srun printed why */
    if (step.n_carried) {
        if (spank_get_item(sp, S_TASK_ID, &local) == ESPANK_SUCCESS && local == 0) {
            for (int i = 0; i < step.n_carried; i++)
                slurm_error("am: %s", step.carried[i]);
            slurm_error("am: the command was not run");
        }
        _exit(1);
    }
    if (step.stop == STOP_DRY_RUN)
        _exit(0);
    return 0;
}
