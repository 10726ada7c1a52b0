/* validate.c - sbatch, salloc and srun: check the recipe as the user (validate.h). */
#include "validate.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "env.h"
#include "options.h"
#include "plan.h"
#include "recipe.h"
#include "text.h"

/* The module's one context: what init_post_opt found, kept for local_user_init. */
static struct {
    struct am_recipe *r;
    char recipe[PATH_MAX];  /* absolute */
    char log_dir[PATH_MAX]; /* absolute; "" when not given */
    struct am_override ov[4];
    char ov_value[4][24];
    size_t n_ov;
    bool unreadable; /* the recipe was found but could not be read or parsed */
} chk;

static const enum am_opt size_opts[] = {AM_OPT_TP, AM_OPT_PP, AM_OPT_EP, AM_OPT_CP};
#define N_SIZE_OPTS (sizeof(size_opts) / sizeof(size_opts[0]))

/* ---- messages ------------------------------------------------------------------------- */

/* Prints one line as slurm_error("am: ..."), control characters (which could come from a
 * file or a directory name) as '?'. */
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char line[PATH_MAX + 1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    for (unsigned char *p = (unsigned char *)line; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            *p = '?';
    slurm_error("am: %s", line);
}

static void print_errors(const struct am_errors *err)
{
    for (size_t i = 0; i < err->n; i++)
        say("%s", err->msg[i]);
    if (err->truncated)
        say("... and %d more problems", err->truncated);
}

/* "problem" or "N problems". */
static const char *problems(const struct am_errors *err, char *buf, size_t len)
{
    size_t n = err->n + (size_t)err->truncated;
    if (n == 1)
        snprintf(buf, len, "the problem");
    else
        snprintf(buf, len, "the %zu problems", n);
    return buf;
}

/* The am-plan command that checks the same recipe offline, for the last line. */
static const char *am_plan_hint(const char *world, char *buf, size_t len)
{
    int o = snprintf(buf, len, "am-plan %s%s", chk.recipe, world);
    for (size_t i = 0; i < chk.n_ov && o > 0 && (size_t)o < len; i++)
        o += snprintf(buf + o, len - (size_t)o, " --set %s=%s", chk.ov[i].path, chk.ov[i].value);
    return buf;
}

/* A path for a message: control characters as '?' (paths are otherwise shown whole). */
static const char *plain_path(const char *s, char *buf, size_t len)
{
    size_t k = 0;
    for (; s[k] && k + 1 < len; k++)
        buf[k] = ((unsigned char)s[k] < 0x20 || s[k] == 0x7f) ? '?' : s[k];
    buf[k] = '\0';
    return buf;
}

/* ---- finding the files ---------------------------------------------------------------- */

/* The path exists, or exists but cannot be examined (which reading it will then report). */
static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 || (errno != ENOENT && errno != ENOTDIR);
}

/* out = cwd + "/" + rel (rel without leading "./"). */
static int absolute(const char *rel, char *out, size_t len, char *why, size_t why_len)
{
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof(cwd))) {
        snprintf(why, why_len, "cannot determine the current directory (%s); give an absolute path",
                 strerror(errno));
        return -1;
    }
    char buf[64], shown[PATH_MAX];
    const char *problem = am_path_problem(cwd, buf, sizeof(buf));
    if (problem) { /* the tasks get the absolute path: it must be one printable line */
        int n = snprintf(why, why_len, "the current directory, %.300s", plain_path(cwd, shown, sizeof(shown)));
        if (n > 0 && (size_t)n < why_len)
            snprintf(why + n, why_len - (size_t)n, ", %s, which no path handed to the tasks may have (rename it, or "
                     "give the path from a directory without one)", problem);
        return -1;
    }
    while (rel[0] == '.' && rel[1] == '/')
        for (rel += 2; *rel == '/'; rel++)
            ;
    if ((size_t)snprintf(out, len, "%s%s%s", cwd, strcmp(cwd, "/") ? "/" : "", rel) >= len) {
        snprintf(why, why_len, "the current directory and the path together are longer than %zu bytes; give a "
                 "shorter absolute path", len - 1);
        return -1;
    }
    return 0;
}

/* A directory found where the recipe was expected gets its own advice. */
static int not_a_directory(const struct am_setting *s, struct am_errors *err)
{
    struct stat st;
    char dir[PATH_MAX], typed[PATH_MAX];
    if (stat(chk.recipe, &st) == 0 && S_ISDIR(st.st_mode)) {
        am_errorf(err, NULL, "%s: %s is a directory, not a recipe file (give the recipe file in it, for example "
                  "%s=%s/NAME.yaml)", s->shown, plain_path(chk.recipe, dir, sizeof(dir)),
                  s->from_env ? am_opt_env(AM_OPT_RECIPE) : am_opt_flag(AM_OPT_RECIPE),
                  plain_path(s->str, typed, sizeof(typed)));
        return -1;
    }
    return 0;
}

/* The recipe as the user: an absolute FILE as is; a relative one in the current
 * directory, then in each recipe_path directory. */
static int find_recipe(const struct am_setting *s, const struct am_config *cfg, struct am_errors *err)
{
    char why[512], shown[PATH_MAX];
    const char *v = s->str;
    if (v[0] == '/') {
        if (!exists(v)) {
            am_errorf(err, NULL, "%s: no such file (give the path of an existing recipe file)", s->shown);
            return -1;
        }
        snprintf(chk.recipe, sizeof(chk.recipe), "%s", v);
        return not_a_directory(s, err);
    }
    if (exists(v)) {
        if (absolute(v, chk.recipe, sizeof(chk.recipe), why, sizeof(why)) < 0) {
            am_errorf(err, NULL, "%s: %s", s->shown, why);
            return -1;
        }
        return not_a_directory(s, err);
    }
    for (const char *p = cfg->recipe_path; p && *p;) {
        const char *end = strchr(p, ':');
        int n = end ? (int)(end - p) : (int)strlen(p);
        if ((size_t)snprintf(chk.recipe, sizeof(chk.recipe), "%.*s/%s", n, p, v) < sizeof(chk.recipe) &&
            exists(chk.recipe))
            return not_a_directory(s, err);
        p = end ? end + 1 : NULL;
    }
    chk.recipe[0] = '\0';
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof(cwd)))
        snprintf(cwd, sizeof(cwd), "?");
    if (cfg->recipe_path == am_config_recipes)
        am_errorf(err, NULL, "%s: no such file in the current directory (%s) nor in am's installed recipes (%s); "
                  "give the path of an existing recipe file", s->shown, plain_path(cwd, shown, sizeof(shown)),
                  cfg->recipe_path);
    else if (cfg->recipe_path)
        am_errorf(err, NULL, "%s: no such file in the current directory (%s) nor in the site's recipe "
                  "directories (%s); give the path of an existing recipe file", s->shown,
                  plain_path(cwd, shown, sizeof(shown)), cfg->recipe_path);
    else
        am_errorf(err, NULL, "%s: no such file in the current directory (%s); give the path of an existing "
                  "recipe file", s->shown, plain_path(cwd, shown, sizeof(shown)));
    return -1;
}

static int find_log_dir(const struct am_setting *s, struct am_errors *err)
{
    char why[512];
    struct stat st;
    if (s->str[0] == '/')
        snprintf(chk.log_dir, sizeof(chk.log_dir), "%s", s->str);
    else if (absolute(s->str, chk.log_dir, sizeof(chk.log_dir), why, sizeof(why)) < 0) {
        am_errorf(err, NULL, "%s: %s", s->shown, why);
        return -1;
    }
    if (stat(chk.log_dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
        am_errorf(err, NULL, "%s: exists and is not a directory (give a directory, or a path that does not exist "
                  "yet: am-launch creates it)", s->shown);
        return -1;
    }
    return 0;
}

/* ---- the checks common to sbatch and srun ---------------------------------------------- */

static void make_overrides(void)
{
    chk.n_ov = 0;
    for (size_t i = 0; i < N_SIZE_OPTS; i++) {
        const struct am_setting *s = am_opt(size_opts[i]);
        if (!s->given || s->bad)
            continue;
        snprintf(chk.ov_value[chk.n_ov], sizeof(chk.ov_value[0]), "%ld", s->num);
        chk.ov[chk.n_ov] = (struct am_override){
            .path = am_opt_key(size_opts[i]), .value = chk.ov_value[chk.n_ov], .origin = s->shown};
        chk.n_ov++;
    }
}

/* The option syntax and, with read_files, the files and the recipe with every rule that
 * needs no allocation. Returns 0, or -1 with the problems in err. */
static int check_without_world(const struct am_config *cfg, bool read_files, struct am_errors *err)
{
    const struct am_setting *recipe = am_opt(AM_OPT_RECIPE), *log_dir = am_opt(AM_OPT_LOG_DIR);
    chk.unreadable = false;
    am_opts_errors(err);
    if (!recipe->given) {
        for (int o = 0; o < AM_OPT_N; o++)
            if (am_opt((enum am_opt)o)->given) {
                am_errorf(err, NULL, "%s needs a recipe: add --am-recipe=FILE (or set AM_RECIPE=FILE)",
                          am_opt((enum am_opt)o)->shown);
                break;
            }
    }
    if (!read_files || !recipe->given || recipe->bad)
        return err->n ? -1 : 0;
    make_overrides();
    chk.log_dir[0] = '\0';
    find_recipe(recipe, cfg, err);
    if (log_dir->given && !log_dir->bad)
        find_log_dir(log_dir, err);
    if (err->n)
        return -1;
    am_recipe_free(chk.r);
    chk.r = am_recipe_load(chk.recipe, chk.ov, chk.n_ov, err);
    if (chk.r && (!chk.r->root || chk.r->root->kind != AM_NODE_MAP)) { /* not a recipe at all */
        am_recipe_free(chk.r);
        chk.r = NULL;
    }
    chk.unreadable = !chk.r;
    if (chk.r) /* the layout's and am-train's errors too, with the recipe's: all in one run */
        am_validate_run(chk.r, NULL, err);
    return err->n ? -1 : 0;
}

/* Prints the problems and a last line saying what did not happen and how to go on. */
static void report_without_world(const char *outcome, const struct am_errors *err)
{
    char what[32], hint[PATH_MAX + 256];
    const struct am_setting *recipe = am_opt(AM_OPT_RECIPE);
    print_errors(err);
    if (chk.r)
        say("%s: fix %s above (%s checks a recipe offline)", outcome, problems(err, what, sizeof(what)),
            am_plan_hint("", hint, sizeof(hint)));
    else if (chk.unreadable)
        say("%s: %s could not be read as a recipe (give the path of a YAML recipe file you can read)", outcome,
            recipe->shown);
    else
        say("%s: fix %s above", outcome, problems(err, what, sizeof(what)));
}

/* Private hand-over variables left in this process's environment by someone else (a
 * salloc shell, a copied environment) must not reach a job: only the plugin sets them. */
static void clear_handover_env(void)
{
    char name[64];
    for (size_t i = 0; am_handover_names[i]; i++) {
        snprintf(name, sizeof(name), AM_HANDOVER_PREFIX "%s", am_handover_names[i]);
        unsetenv(name);
    }
}

/* The settings to hand over, as (name without prefix, value) pairs; value NULL: unset. */
struct handover {
    const char *name[8], *value[8];
    char num[4][24], layout[96];
    int n;
};

static void handover_collect(struct handover *h, int dp)
{
    memset(h, 0, sizeof(*h));
    h->name[h->n] = "AM_RECIPE";
    h->value[h->n++] = chk.recipe;
    for (size_t i = 0; i < N_SIZE_OPTS; i++) {
        const struct am_setting *s = am_opt(size_opts[i]);
        h->name[h->n] = am_opt_env(size_opts[i]);
        if (s->given) {
            snprintf(h->num[i], sizeof(h->num[i]), "%ld", s->num);
            h->value[h->n] = h->num[i];
        }
        h->n++;
    }
    h->name[h->n] = "AM_LOG_DIR";
    h->value[h->n++] = chk.log_dir[0] ? chk.log_dir : NULL;
    int o = snprintf(h->layout, sizeof(h->layout), "tp=%d,pp=%d,cp=%d,ep=%d", chk.r ? chk.r->dist.tp : 0,
                     chk.r ? chk.r->dist.pp : 0, chk.r ? chk.r->dist.cp : 0, chk.r ? chk.r->dist.ep : 0);
    if (dp > 0 && o > 0 && (size_t)o < sizeof(h->layout))
        snprintf(h->layout + o, sizeof(h->layout) - (size_t)o, ",dp=%d", dp);
    h->name[h->n] = "AM_LAYOUT";
    h->value[h->n++] = chk.r ? h->layout : NULL;
}

/* ---- sbatch, salloc ------------------------------------------------------------------ */

static void print_dry_run_submit(void)
{
    const struct am_recipe *r = chk.r;
    char hint[PATH_MAX + 256];
    if (!r) {
        printf("am: dry run: the options are valid; this cluster checks recipes in srun only (sbatch=0)\n");
        printf("am: dry run: the job was not submitted\n");
        fflush(stdout);
        return;
    }
    printf("am: dry run: %s passes every check that needs no allocation\n", r->file);
    printf("am:   model %s, %ld layers, hidden %ld, %ld heads (%ld kv)%s; tp %d, pp %d, cp %d, ep %d; %s\n",
           r->model.model_type ? r->model.model_type : "?", r->model.num_hidden_layers, r->model.hidden_size,
           r->model.num_attention_heads, r->model.num_key_value_heads,
           r->model.num_experts ? ", mixture of experts" : "", r->dist.tp, r->dist.pp, r->dist.cp, r->dist.ep,
           am_strategy_name(r->dist.strategy));
    printf("am:   srun checks the rest for each step; the whole plan for N nodes of G GPUs: %s\n",
           am_plan_hint(" --nodes N --gpus-per-node G", hint, sizeof(hint)));
    printf("am: dry run: the job was not submitted\n");
    fflush(stdout);
}

static int handover_job(spank_t sp, struct am_errors *err)
{
    struct handover h;
    char fwd[96];
    handover_collect(&h, 0);
    for (int i = 0; i < h.n; i++) {
        spank_err_t rc = h.value[i] ? spank_job_control_setenv(sp, h.name[i], h.value[i], 1)
                                    : spank_job_control_unsetenv(sp, h.name[i]);
        if (rc != ESPANK_SUCCESS && h.value[i]) {
            am_errorf(err, NULL, "cannot pass %s to the job (spank_job_control_setenv: %s); report this to the "
                      "cluster's admin", h.name[i], spank_strerror(rc));
            return -1;
        }
    }
    /* What Slurm forwards to the job's srun steps: the absolute paths, not the paths as
     * typed (relative to a directory the job script may leave). */
    const enum am_opt paths[] = {AM_OPT_RECIPE, AM_OPT_LOG_DIR};
    const char *abs[] = {chk.recipe, chk.log_dir};
    for (int i = 0; i < 2; i++) {
        const struct am_setting *s = am_opt(paths[i]);
        if (!s->given || s->from_env)
            continue;
        am_opt_forward_name(paths[i], fwd, sizeof(fwd));
        spank_err_t rc = spank_job_control_setenv(sp, fwd, abs[i], 1);
        if (rc != ESPANK_SUCCESS) {
            am_errorf(err, NULL, "cannot pass %s to the job's steps (spank_job_control_setenv: %s); report this "
                      "to the cluster's admin", s->shown, spank_strerror(rc));
            return -1;
        }
    }
    return 0;
}

int am_submit_check(spank_t sp, const struct am_config *cfg)
{
    struct am_errors err;
    bool dry_run = false;
    int rc = 0;
    clear_handover_env();
    am_opts_read_env();
    if (!am_opts_active())
        return 0;
    am_errors_init(&err);
    if (check_without_world(cfg, cfg->sbatch, &err) < 0) {
        report_without_world("job not submitted", &err);
        rc = -1;
    } else if (am_opt(AM_OPT_DRY_RUN)->given) {
        print_dry_run_submit();
        dry_run = true;
    } else if (chk.r && handover_job(sp, &err) < 0) {
        print_errors(&err);
        rc = -1;
    }
    am_errors_free(&err);
    if (dry_run) { /* checked and printed: sbatch/salloc end here, successfully, submitting nothing */
        am_check_fini();
        exit(0);
    }
    return rc;
}

/* ---- srun ---------------------------------------------------------------------------- */

int am_step_precheck(spank_t sp, const struct am_config *cfg)
{
    struct am_errors err;
    int rc = 0;
    (void)sp;
    clear_handover_env();
    am_opts_read_env();
    if (!am_opts_active())
        return 0;
    am_errors_init(&err);
    if (check_without_world(cfg, true, &err) < 0) {
        report_without_world("step not started", &err);
        rc = -1;
    }
    am_errors_free(&err);
    return rc;
}

/* The step as the recipe library sees it: its ranks and nodes, and the NVLink domain the
 * admin configured (nvlink_domain, else gpus_per_node; 0: unknown, not checked here).
 * srun does not know where each task will run (Slurm may put 3 and 1 of 4 tasks on 2
 * nodes): that tensor-parallel groups stay inside one node's domain is checked by
 * slurmstepd on each node, which knows (env.c). gpus_per_node is the tasks per node when
 * they divide evenly, for the plan's text only. */
static void step_world(const struct am_config *cfg, int nodes, int tasks, struct am_world *w)
{
    *w = (struct am_world){.size = tasks,
                           .nodes = nodes,
                           .gpus_per_node = tasks % nodes == 0 ? tasks / nodes : 0,
                           .nvlink_domain = cfg->nvlink_domain ? cfg->nvlink_domain : cfg->gpus_per_node,
                           .gpu_mem = cfg->gpu_mem};
}

/* The plan, as am-plan prints it, for --am-dry-run. */
static void print_plan(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                       uint32_t job, uint32_t stepid)
{
    printf("am: dry run for step %u.%u: the command is not run\n", job, stepid);
    am_plan_print(stdout, r, w, p);
    fflush(stdout);
}

static int handover_step(struct am_errors *err, int dp, const char *stop)
{
    struct handover h;
    char name[64];
    handover_collect(&h, dp);
    h.name[h.n] = "AM_STOP";
    h.value[h.n++] = stop;
    for (int i = 0; i < h.n; i++) {
        snprintf(name, sizeof(name), AM_HANDOVER_PREFIX "%s", h.name[i]);
        if (h.value[i] ? setenv(name, h.value[i], 1) : unsetenv(name)) {
            am_errorf(err, NULL, "cannot pass %s to the step (setenv: %s)", h.name[i], strerror(errno));
            return -1;
        }
    }
    return 0;
}

int am_step_check(spank_t sp, const struct am_config *cfg)
{
    struct am_errors err;
    struct am_plan plan = {0};
    struct am_world w;
    uint32_t nodes = 0, tasks = 0, job = 0, stepid = 0;
    char what[32], hint[PATH_MAX + 256], where[256];
    const char *stop = NULL;
    int rc = 0;
    if (!am_opts_active() || !chk.r)
        return 0;
    am_errors_init(&err);
    if (spank_get_item(sp, S_JOB_NNODES, &nodes) != ESPANK_SUCCESS ||
        spank_get_item(sp, S_JOB_TOTAL_TASK_COUNT, &tasks) != ESPANK_SUCCESS || !nodes || !tasks ||
        nodes > INT32_MAX || tasks > INT32_MAX) {
        slurm_verbose("am: Slurm does not tell this step's node and task counts; am-launch checks the layout");
        goto hand_over;
    }
    spank_get_item(sp, S_JOB_ID, &job);
    spank_get_item(sp, S_JOB_STEPID, &stepid);
    step_world(cfg, (int)nodes, (int)tasks, &w);
    if (am_plan_build(chk.r, &w, &plan, &err) == 0)
        am_plan_check_memory(chk.r, &w, &plan, &err);
    if (err.n) {
        print_errors(&err);
        /* am-plan's world is nodes x gpus-per-node: an uneven step is shown as one node */
        int o = snprintf(where, sizeof(where), " --nodes %d --gpus-per-node %d", w.gpus_per_node ? w.nodes : 1,
                         w.gpus_per_node ? w.gpus_per_node : w.size);
        if (w.nvlink_domain && o > 0 && (size_t)o < sizeof(where))
            o += snprintf(where + o, sizeof(where) - (size_t)o, " --nvlink-domain %d", w.nvlink_domain);
        if (cfg->gpu_mem_text && o > 0 && (size_t)o < sizeof(where))
            snprintf(where + o, sizeof(where) - (size_t)o, " --gpu-mem %s", cfg->gpu_mem_text);
        say("step not run: fix %s above (%s shows the plan); its tasks end with exit code 1 without running the "
            "command", problems(&err, what, sizeof(what)), am_plan_hint(where, hint, sizeof(hint)));
        am_errors_free(&err); /* printed; the list is reused for the hand-over's own errors */
        am_errors_init(&err);
        stop = "error";
    } else if (am_opt(AM_OPT_DRY_RUN)->given) {
        print_plan(chk.r, &w, &plan, job, stepid);
        stop = "dry-run";
    }
hand_over:
    if (handover_step(&err, plan.dp, stop) < 0) {
        print_errors(&err);
        rc = -1;
    }
    am_plan_free(&plan);
    am_errors_free(&err);
    return rc;
}

void am_check_fini(void)
{
    am_recipe_free(chk.r);
    chk.r = NULL;
}
