/* options.h - the --am-* options and their environment-variable forms.
 *
 * The option table is registered with spank_option_register() from slurm_spank_init (a
 * plain exported spank_options table does not register in sbatch on Slurm 22.05). Each
 * callback checks the value's syntax and stores it, or the reason it is invalid, in the
 * module's one context struct; it never fails, so that a later value (the command line
 * after an #SBATCH line) replaces an earlier one, and so that the plugin, not Slurm, words
 * the error (Slurm would echo the raw value, whatever its size). The errors are reported
 * by validate.c from slurm_spank_init_post_opt, before anything is submitted or started.
 *
 * When an option is absent, sbatch/salloc/srun read its environment variable (AM_RECIPE,
 * AM_TP, ...); an empty variable counts as unset. The plugin is active for a command when
 * an --am-* option is given or AM_RECIPE is set: AM_TP and the others alone do nothing,
 * so a stale variable in a shell cannot turn a plain job into an am job. --am-off makes
 * it inactive whatever else is given: for helper steps (srun hostname, a data copy)
 * inside a job whose --am-* options Slurm forwards to every srun.
 */
#ifndef AM_SPANK_OPTIONS_H
#define AM_SPANK_OPTIONS_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

#include <slurm/spank.h>

#include "errors.h"

enum am_opt {
    AM_OPT_RECIPE, AM_OPT_TP, AM_OPT_PP, AM_OPT_EP, AM_OPT_CP, AM_OPT_LOG_DIR, AM_OPT_DRY_RUN, AM_OPT_OFF, AM_OPT_N
};

struct am_setting {
    bool given;     /* by the option or its environment variable */
    bool from_env;  /* by the environment variable */
    bool bad;       /* the syntax is wrong; `why` says how */
    char shown[256];  /* how the user wrote it, safe to print: "--am-tp=8" or "AM_TP=8" */
    char why[256];    /* the rule and a fix, when bad */
    long num;         /* AM_OPT_TP .. AM_OPT_CP */
    char str[PATH_MAX]; /* AM_OPT_RECIPE, AM_OPT_LOG_DIR: non-empty, no control characters */
};

/* Registers every option (slurm_spank_init, in sbatch, salloc, srun and slurmstepd).
 * Returns 0, or -1 with the reason in err. */
int am_opts_register(spank_t sp, char *err, size_t len);

/* Reads the environment forms of the options not given (init_post_opt, sbatch/srun). */
void am_opts_read_env(void);

/* True when the user asked for am: an --am-* option, or AM_RECIPE; and not --am-off. */
bool am_opts_active(void);

const struct am_setting *am_opt(enum am_opt o);

/* Appends one message per invalid value; returns how many. */
int am_opts_errors(struct am_errors *err);

/* "--am-tp", "AM_TP", "distributed.tp_size" (NULL for options that are not recipe keys). */
const char *am_opt_flag(enum am_opt o);
const char *am_opt_env(enum am_opt o);
const char *am_opt_key(enum am_opt o);

/* The environment variable in which Slurm forwards an option given to sbatch/salloc to
 * the job's srun steps (without Slurm's SLURM_SPANK_ prefix): "_SLURM_SPANK_OPTION_am_am_recipe". */
void am_opt_forward_name(enum am_opt o, char *buf, size_t len);

/* Parses one value (pure; the option callbacks and the unit test use it). */
void am_setting_parse(enum am_opt o, const char *value, bool from_env, struct am_setting *s);

#endif
