/* options.c - the --am-* options (options.h). */
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text.h"

#define AM_MAX_SIZE (1L << 20) /* tp, pp, ep, cp */

static const struct {
    const char *flag, *env, *key, *what;
} info[AM_OPT_N] = {
    [AM_OPT_RECIPE] = {"--am-recipe", "AM_RECIPE", NULL, "the recipe path"},
    [AM_OPT_TP] = {"--am-tp", "AM_TP", "distributed.tp_size", "the tensor-parallel size"},
    [AM_OPT_PP] = {"--am-pp", "AM_PP", "distributed.pp_size", "the pipeline-parallel size"},
    [AM_OPT_EP] = {"--am-ep", "AM_EP", "distributed.ep_size", "the expert-parallel size"},
    [AM_OPT_CP] = {"--am-cp", "AM_CP", "distributed.cp_size", "the context-parallel size"},
    [AM_OPT_LOG_DIR] = {"--am-log-dir", "AM_LOG_DIR", NULL, "the log directory"},
    [AM_OPT_DRY_RUN] = {"--am-dry-run", NULL, NULL, NULL},
    [AM_OPT_OFF] = {"--am-off", NULL, NULL, NULL},
};

/* The module's one context: every value the user gave. */
static struct {
    struct am_setting s[AM_OPT_N];
} opts;

const char *am_opt_flag(enum am_opt o) { return info[o].flag; }
const char *am_opt_env(enum am_opt o) { return info[o].env; }
const char *am_opt_key(enum am_opt o) { return info[o].key; }
const struct am_setting *am_opt(enum am_opt o) { return &opts.s[o]; }

void am_setting_parse(enum am_opt o, const char *value, bool from_env, struct am_setting *s)
{
    char shown[AM_SHOWN_LEN];
    const char *v = value ? value : "";
    memset(s, 0, sizeof(*s));
    s->given = true;
    s->from_env = from_env;
    if (o == AM_OPT_DRY_RUN || o == AM_OPT_OFF) {
        snprintf(s->shown, sizeof(s->shown), "%s", info[o].flag);
        return;
    }
    snprintf(s->shown, sizeof(s->shown), "%s=%s", from_env ? info[o].env : info[o].flag,
             am_shown(v, shown, sizeof(shown)));
    const char *example = o == AM_OPT_RECIPE ? "llama70b.yaml" : "$HOME/am-logs";
    switch (o) {
    case AM_OPT_TP:
    case AM_OPT_PP:
    case AM_OPT_EP:
    case AM_OPT_CP:
        if (am_parse_count(v, 1, AM_MAX_SIZE, &s->num) < 0) {
            s->bad = true;
            snprintf(s->why, sizeof(s->why), "%s must be a whole number from 1 to %ld (for example %s=%d)",
                     info[o].what, AM_MAX_SIZE, from_env ? info[o].env : info[o].flag, o == AM_OPT_TP ? 8 : 2);
        }
        return;
    case AM_OPT_RECIPE:
    case AM_OPT_LOG_DIR:
        if (*v == '\0') {
            s->bad = true;
            snprintf(s->why, sizeof(s->why), "%s is empty (give a path, for example %s=%s)", info[o].what,
                     from_env ? info[o].env : info[o].flag, example);
        } else if (strlen(v) >= sizeof(s->str)) {
            s->bad = true;
            snprintf(s->why, sizeof(s->why), "%s is longer than the %zu bytes a path may have (give a shorter "
                     "path)", info[o].what, sizeof(s->str) - 1);
        } else if (am_has_control(v)) {
            s->bad = true;
            snprintf(s->why, sizeof(s->why), "%s contains a control character such as a newline or a tab "
                     "(rename the file, or give a path without one)", info[o].what);
        } else {
            memcpy(s->str, v, strlen(v) + 1);
        }
        return;
    case AM_OPT_DRY_RUN:
    case AM_OPT_OFF:
    case AM_OPT_N:
        break;
    }
}

/* Every option's callback. In slurmstepd (remote) the values are not used: what the tasks
 * get was decided and checked in sbatch/srun and arrives in the step's environment. */
static int option_cb(int val, const char *optarg, int remote)
{
    if (remote || val < 0 || val >= AM_OPT_N)
        return 0;
    am_setting_parse((enum am_opt)val, optarg, false, &opts.s[val]);
    return 0;
}

static struct spank_option table[] = {
    {"am-recipe", "FILE",
     "am: train with this recipe (YAML). A relative FILE is looked up in the current directory, "
     "then in the site's recipe directories. Environment: AM_RECIPE.",
     1, AM_OPT_RECIPE, option_cb},
    {"am-tp", "N", "am: tensor-parallel size (sets distributed.tp_size of the recipe). Environment: AM_TP.", 1,
     AM_OPT_TP, option_cb},
    {"am-pp", "N", "am: pipeline-parallel size (sets distributed.pp_size). Environment: AM_PP.", 1, AM_OPT_PP,
     option_cb},
    {"am-ep", "N", "am: expert-parallel size (sets distributed.ep_size). Environment: AM_EP.", 1, AM_OPT_EP,
     option_cb},
    {"am-cp", "N", "am: context-parallel size (sets distributed.cp_size). Environment: AM_CP.", 1, AM_OPT_CP,
     option_cb},
    {"am-log-dir", "DIR",
     "am: directory for the per-rank logs (default: the site's log root/JOBID). Environment: AM_LOG_DIR.", 1,
     AM_OPT_LOG_DIR, option_cb},
    {"am-dry-run", NULL,
     "am: check the recipe and print the plan, run nothing (sbatch/salloc: check and do not submit; "
     "srun: print this step's plan and do not run the command).",
     0, AM_OPT_DRY_RUN, option_cb},
    {"am-off", NULL,
     "am: not an am step: no checks, no AM_* settings, whatever --am-* options the job was given (for "
     "helper steps such as srun hostname).",
     0, AM_OPT_OFF, option_cb},
};

int am_opts_register(spank_t sp, char *err, size_t len)
{
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        spank_err_t rc = spank_option_register(sp, &table[i]);
        if (rc != ESPANK_SUCCESS) {
            snprintf(err, len, "cannot register option --%s: %s", table[i].name, spank_strerror(rc));
            return -1;
        }
    }
    return 0;
}

void am_opts_read_env(void)
{
    if (!am_opts_active())
        return;
    for (int o = 0; o < AM_OPT_N; o++) {
        const char *v = info[o].env ? getenv(info[o].env) : NULL;
        if (!opts.s[o].given && v && *v)
            am_setting_parse((enum am_opt)o, v, true, &opts.s[o]);
    }
}

bool am_opts_active(void)
{
    if (opts.s[AM_OPT_OFF].given)
        return false;
    for (int o = 0; o < AM_OPT_N; o++)
        if (opts.s[o].given)
            return true;
    const char *r = getenv("AM_RECIPE");
    return r && *r;
}

int am_opts_errors(struct am_errors *err)
{
    int n = 0;
    for (int o = 0; o < AM_OPT_N; o++)
        if (opts.s[o].given && opts.s[o].bad) {
            am_errorf(err, NULL, "%s: %s", opts.s[o].shown, opts.s[o].why);
            n++;
        }
    return n;
}

void am_opt_forward_name(enum am_opt o, char *buf, size_t len)
{
    /* Slurm's name: "_SLURM_SPANK_OPTION_" + plugin name + "_" + option name, with every
     * character that is not a letter or a digit turned into '_' (src/common/spank.c). */
    int n = snprintf(buf, len, "_SLURM_SPANK_OPTION_am_%s", info[o].flag + 2);
    for (int i = 23; i < n && (size_t)i < len; i++)
        if (buf[i] == '-')
            buf[i] = '_';
}
