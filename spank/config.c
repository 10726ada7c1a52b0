/* config.c - plugstack.conf arguments (config.h). */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "text.h"

const char am_config_keys[] = "gpus_per_node, nvlink_domain, gpu_mem, recipe_path, log_root, env, sbatch";

enum key { K_GPUS_PER_NODE, K_NVLINK_DOMAIN, K_GPU_MEM, K_RECIPE_PATH, K_LOG_ROOT, K_ENV, K_SBATCH, K_N };
static const char *const key_names[K_N] = {"gpus_per_node", "nvlink_domain", "gpu_mem", "recipe_path",
                                           "log_root", "env", "sbatch"};

#define PATH_LIMIT 4000 /* leaves room for "/JOBID" and a file name under PATH_MAX */

#ifndef AM_RECIPES_DIR
#error "AM_RECIPES_DIR (the installed recipes directory) must be defined by the build"
#endif
const char am_config_recipes[] = AM_RECIPES_DIR;

void am_config_init(struct am_config *c)
{
    memset(c, 0, sizeof(*c));
    c->recipe_path = am_config_recipes;
    c->sbatch = true;
}

static int bad(char *err, size_t len, const char *arg, const char *fmt, const char *what)
{
    char shown[AM_SHOWN_LEN], rule[512];
    snprintf(rule, sizeof(rule), fmt, what);
    snprintf(err, len, "plugstack.conf argument '%s': %s", am_shown(arg, shown, sizeof(shown)), rule);
    return -1;
}

static bool env_name_ok(const char *s, size_t n)
{
    if (n == 0 || (s[0] >= '0' && s[0] <= '9'))
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_'))
            return false;
    return true;
}

/* Every element of a colon-separated list is an absolute path of plain text. */
static bool dir_list_ok(const char *v)
{
    if (*v == '\0')
        return false;
    for (const char *p = v; p;) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 0 || p[0] != '/' || n > PATH_LIMIT)
            return false;
        p = end ? end + 1 : NULL;
    }
    return true;
}

static int parse_one(struct am_config *c, enum key k, const char *arg, const char *v, char *err, size_t len)
{
    long n;
    switch (k) {
    case K_GPUS_PER_NODE:
    case K_NVLINK_DOMAIN:
        if (am_parse_count(v, 1, AM_CONFIG_MAX_COUNT, &n) < 0)
            return bad(err, len, arg, "%s must be a whole number from 1 to 65536 (GPUs; for example 8)",
                       key_names[k]);
        *(k == K_GPUS_PER_NODE ? &c->gpus_per_node : &c->nvlink_domain) = (int)n;
        return 0;
    case K_GPU_MEM:
        if (am_parse_size(v, &c->gpu_mem) < 0)
            return bad(err, len, arg, "%s must be a memory size such as 80G or 141GiB", key_names[k]);
        c->gpu_mem_text = v;
        return 0;
    case K_RECIPE_PATH:
        if (!dir_list_ok(v))
            return bad(err, len, arg, "%s must be absolute directories separated by ':' (for example "
                       "recipe_path=/shared/am/recipes:/opt/am/recipes)", key_names[k]);
        c->recipe_path = v;
        return 0;
    case K_LOG_ROOT:
        if (v[0] != '/' || strlen(v) > PATH_LIMIT || strchr(v, ':'))
            return bad(err, len, arg, "%s must be an absolute directory (for example log_root=/shared/am/logs)",
                       key_names[k]);
        c->log_root = v;
        return 0;
    case K_ENV: {
        const char *eq = strchr(v, '=');
        if (!eq || !env_name_ok(v, (size_t)(eq - v)))
            return bad(err, len, arg, "%s takes NAME=VALUE, one variable per env= argument (for example "
                       "env=NCCL_IB_HCA=mlx5_0,mlx5_1 env=UCX_TLS=rc,sm)", key_names[k]);
        if (!strncmp(v, "AM_", 3) || !strncmp(v, "SLURM_", 6))
            return bad(err, len, arg, "%s cannot set AM_* or SLURM_* variables: the plugin and Slurm own them "
                       "(set the site's NCCL_*, UCX_* or other defaults here)", key_names[k]);
        if (c->n_env == AM_CONFIG_MAX_ENV)
            return bad(err, len, arg, "more than 32 %s= arguments (keep the site defaults to the few that matter)",
                       key_names[k]);
        size_t nlen = (size_t)(eq - v) + 1;
        for (size_t i = 0; i < c->n_env; i++)
            if (!strncmp(c->env[i], v, nlen))
                return bad(err, len, arg, "%s sets this variable a second time (keep one env= argument per "
                           "variable)", key_names[k]);
        c->env[c->n_env++] = v;
        return 0;
    }
    case K_SBATCH:
        if (strcmp(v, "0") && strcmp(v, "1"))
            return bad(err, len, arg, "%s must be 1 (check recipes in sbatch and salloc, the default) or 0 "
                       "(check them in srun only)", key_names[k]);
        c->sbatch = v[0] == '1';
        return 0;
    case K_N:
        break;
    }
    return -1;
}

int am_config_parse(struct am_config *c, int ac, char **av, char *err, size_t len)
{
    bool seen[K_N] = {false};
    for (int i = 0; i < ac; i++) {
        const char *arg = av[i] ? av[i] : "";
        const char *eq = strchr(arg, '=');
        if (!eq) {
            char shown[AM_SHOWN_LEN];
            snprintf(err, len, "plugstack.conf argument '%s': expected KEY=VALUE (valid keys: %s)",
                     am_shown(arg, shown, sizeof(shown)), am_config_keys);
            return -1;
        }
        enum key k = K_N;
        for (int j = 0; j < K_N; j++)
            if (strlen(key_names[j]) == (size_t)(eq - arg) && !strncmp(arg, key_names[j], (size_t)(eq - arg)))
                k = (enum key)j;
        if (k == K_N) {
            char shown[AM_SHOWN_LEN], key[AM_SHOWN_LEN];
            char name[64];
            snprintf(name, sizeof(name), "%.*s", (int)((size_t)(eq - arg) < 63 ? eq - arg : 63), arg);
            snprintf(err, len, "plugstack.conf argument '%s': unknown key '%s' (valid keys: %s)",
                     am_shown(arg, shown, sizeof(shown)), am_shown(name, key, sizeof(key)), am_config_keys);
            return -1;
        }
        if (seen[k] && k != K_ENV)
            return bad(err, len, arg, "%s is given twice (keep one)", key_names[k]);
        seen[k] = true;
        if (parse_one(c, k, arg, eq + 1, err, len) < 0)
            return -1;
    }
    return 0;
}
