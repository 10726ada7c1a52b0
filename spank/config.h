/* config.h - the admin's settings: the key=value arguments after the plugin's path in
 * plugstack.conf, for example
 *
 *   required /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_am.so gpus_per_node=8 gpu_mem=80G \
 *            recipe_path=/shared/am/recipes log_root=/shared/am/logs env=NCCL_IB_HCA=mlx5_0,mlx5_1
 *
 * Slurm splits the line at whitespace, so no value can hold a space; `env` may be given
 * several times (one variable each), every other key at most once. An unknown key, a
 * repeated key or a bad value is an error that names the argument and says what is valid.
 * docs/admin.md documents each key.
 */
#ifndef AM_SPANK_CONFIG_H
#define AM_SPANK_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#define AM_CONFIG_MAX_ENV 32     /* env= arguments */
#define AM_CONFIG_MAX_COUNT 65536 /* gpus_per_node, nvlink_domain */

struct am_config {
    int gpus_per_node;        /* GPUs per node; 0: not set */
    int nvlink_domain;        /* GPUs per NVLink domain; 0: not set (gpus_per_node) */
    double gpu_mem;           /* bytes per GPU; 0: memory is not checked */
    const char *gpu_mem_text; /* as the admin wrote it ("80G"), for messages */
    const char *recipe_path;  /* "DIR1:DIR2", absolute directories; default: am_config_recipes */
    const char *log_root;     /* absolute; logs go to LOG_ROOT/JOBID; NULL: none */
    const char *env[AM_CONFIG_MAX_ENV]; /* "NAME=VALUE" set in the tasks of am steps */
    size_t n_env;
    bool sbatch;              /* check recipes in sbatch/salloc (default true) */
};

/* The installed recipes, PREFIX/share/am/recipes (`make install` puts the shipped ones
 * there; configure's prefix, substituted at build): recipe_path when the admin gives none,
 * so that `--am-recipe=tiny.yaml` and the shipped templates work on a default install. */
extern const char am_config_recipes[];

/* The defaults: recipe_path the installed recipes, nothing else set, sbatch checks on. */
void am_config_init(struct am_config *c);

/* Parses plugstack.conf arguments into c (which keeps pointers into av). Returns 0, or -1
 * with a message in err naming the argument, the rule and what is valid. */
int am_config_parse(struct am_config *c, int ac, char **av, char *err, size_t len);

/* The valid keys, for messages: "gpus_per_node, nvlink_domain, ..." */
extern const char am_config_keys[];

#endif
