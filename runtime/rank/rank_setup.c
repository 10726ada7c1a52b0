/* rank_setup.c - bootstrap, recipe, topology, placement and plan of one rank (rank_setup.h). */
#include "rank_setup.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_TIMEOUT_S 300.0
#define FIRST_ERROR_MAX 512

/* What each rank tells the others (all-gathered as bytes). */
struct contribution {
    struct am_place_rank where;
    int32_t n_errors;
    char first_error[FIRST_ERROR_MAX];
};

/* distributed.* overrides from the environment, as the SPANK plugin exports them. */
static size_t env_overrides(struct am_override *ov, char origin[][80])
{
    static const char *const var[] = {"AM_TP", "AM_PP", "AM_EP", "AM_CP"};
    static const char *const key[] = {"distributed.tp_size", "distributed.pp_size", "distributed.ep_size",
                                      "distributed.cp_size"};
    size_t n = 0;
    for (size_t i = 0; i < 4; i++) {
        const char *v = getenv(var[i]);
        if (!v || !*v)
            continue;
        snprintf(origin[n], 80, "%s=%.60s", var[i], v);
        ov[n] = (struct am_override){.path = key[i], .value = v, .origin = origin[n]};
        n++;
    }
    return n;
}

/* Steps 2-3: what this rank can do alone. Errors go to err. */
static void local_steps(struct am_rank_setup *s, struct am_errors *err)
{
    const char *path = getenv("AM_RECIPE");
    struct am_override ov[4];
    char origin[4][80];
    if (!path || !*path) {
        am_errorf(err, NULL, "AM_RECIPE is not set: start rank programs with am-launch RECIPE");
    } else {
        size_t n = env_overrides(ov, origin);
        s->recipe = am_recipe_load(path, ov, n, err);
        /* what am-train does not run is refused here too, with the messages sbatch gives */
        if (s->recipe)
            am_validate_run(s->recipe, NULL, err);
        if (s->recipe && err->n == 0 && s->recipe->dist_env.timeout_minutes > 0)
            s->timeout_s = 60.0 * s->recipe->dist_env.timeout_minutes;
    }
    am_rank_topology(s->info.host, s->info.local_rank, &s->topo, err);
}

/* Rank 0's list: its own errors are in err; add the first message of every other rank
 * that failed with a different one. Every rank does the same (cheap, keeps them alike). */
static void gather_errors(const struct am_rank_setup *s, const struct contribution *all, struct am_errors *err)
{
    const char *mine = err->n ? err->msg[0] : "";
    for (int r = 0; r < s->info.size; r++) {
        if (r == s->info.rank || all[r].n_errors == 0 || strcmp(all[r].first_error, mine) == 0)
            continue;
        int dup = 0, same = 0;
        for (int q = 0; q < r && !dup; q++)
            dup = q != s->info.rank && all[q].n_errors && strcmp(all[q].first_error, all[r].first_error) == 0;
        if (dup)
            continue;
        for (int q = r + 1; q < s->info.size; q++)
            same += q != s->info.rank && all[q].n_errors && strcmp(all[q].first_error, all[r].first_error) == 0;
        char others[64] = "";
        if (same)
            snprintf(others, sizeof(others), " (and %d other rank%s)", same, same > 1 ? "s" : "");
        am_errorf(err, NULL, "rank %d on %s%s: %s%s", r, all[r].where.host, others, all[r].first_error,
                  all[r].n_errors > 1 ? " (and more: see that rank's output)" : "");
    }
}

int am_rank_setup(struct am_rank_setup *s, struct am_errors *err)
{
    char msg[1024];
    size_t before = err->n;
    struct contribution mine, *all = NULL;
    int rc = -1;
    memset(s, 0, sizeof(*s));
    s->timeout_s = DEFAULT_TIMEOUT_S;
    s->boot = am_boot_init(&s->info, msg, sizeof(msg));
    if (!s->boot) {
        am_errorf(err, NULL, "%s", msg);
        return -1;
    }
    local_steps(s, err);

    memset(&mine, 0, sizeof(mine));
    snprintf(mine.where.host, sizeof(mine.where.host), "%.127s", s->info.host);
    snprintf(mine.where.domain, sizeof(mine.where.domain), "%.127s", s->topo.domain[0] ? s->topo.domain : s->info.host);
    mine.where.node_id = s->info.node_id;
    mine.where.local_rank = s->info.local_rank;
    mine.where.gpu = s->topo.gpu.gpu;
    mine.n_errors = (int32_t)(err->n - before);
    if (mine.n_errors)
        snprintf(mine.first_error, sizeof(mine.first_error), "%s", err->msg[before]);
    all = calloc((size_t)s->info.size, sizeof(*all));
    s->ranks = calloc((size_t)s->info.size, sizeof(*s->ranks));
    if (!all || !s->ranks) {
        am_errorf(err, NULL, "rank %d: out of memory for %d ranks", s->info.rank, s->info.size);
        goto out;
    }
    char why[512];
    if (am_boot_allgather(s->boot, "place", &mine, sizeof(mine), all, s->timeout_s, why, sizeof(why)) < 0) {
        am_errorf(err, NULL, "rank %d on %s: %s", s->info.rank, s->info.host, why);
        goto out;
    }
    int failed = 0;
    for (int r = 0; r < s->info.size; r++) {
        s->ranks[r] = all[r].where;
        failed |= all[r].n_errors != 0;
    }
    if (failed) {
        gather_errors(s, all, err);
        goto out;
    }

    am_place_world(s->ranks, s->info.size, &s->world);
    int placed = am_place_build(s->ranks, s->info.size, s->recipe->dist.tp, &s->place, err) == 0;
    struct am_world w = s->world;
    if (!placed)
        w.nvlink_domain = 0; /* said better above: which domains, what to change */
    if (am_plan_build(s->recipe, &w, &s->plan, err) < 0 || !placed)
        goto out;
    am_place_coords(&s->plan, &s->place, s->info.rank, &s->coords);
    s->ready = 1;
    rc = 0;
out:
    free(all);
    return rc;
}

int am_rank_setup_print(const struct am_rank_setup *s, FILE *f)
{
    static const enum am_group kinds[] = {AM_GROUP_TP, AM_GROUP_PP, AM_GROUP_DP, AM_GROUP_EP};
    int *buf = calloc((size_t)s->info.size, sizeof(int));
    int rc = buf && s->ready ? 0 : -1;
    for (int r = 0; rc == 0 && r < s->info.size; r++) {
        const struct am_place_rank *p = &s->ranks[r];
        struct am_coords c;
        am_place_coords(&s->plan, &s->place, r, &c);
        json_t *o = json_pack("{s:i,s:s,s:s,s:i,s:i,s:i}", "rank", r, "host", p->host, "domain", p->domain,
                              "local_rank", (int)p->local_rank, "gpu", (int)p->gpu, "mesh_rank", s->place.mesh_of[r]);
        json_t *coords = json_pack("{s:i,s:i,s:i,s:i,s:i,s:i}", "pp", c.pp, "dp_replicate", c.dp_replicate,
                                   "dp_shard", c.dp_shard, "cp", c.cp, "tp", c.tp, "ep", c.ep);
        json_t *groups = json_object();
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
            json_t *a = json_array();
            int n = am_place_group(&s->plan, &s->place, kinds[k], r, buf);
            for (int i = 0; i < n; i++)
                json_array_append_new(a, json_integer(buf[i]));
            json_object_set_new(groups, am_group_name(kinds[k]), a);
        }
        json_object_set_new(o, "coords", coords);
        json_object_set_new(o, "groups", groups);
        char *line = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        if (!line || fprintf(f, "%s\n", line) < 0)
            rc = -1;
        free(line);
    }
    free(buf);
    if (fflush(f) != 0)
        rc = -1;
    return rc;
}

void am_rank_setup_end(struct am_rank_setup *s)
{
    am_boot_fini(s->boot);
    am_place_free(&s->place);
    am_plan_free(&s->plan);
    am_recipe_free(s->recipe);
    free(s->ranks);
    memset(s, 0, sizeof(*s));
}

void am_rank_setup_exit(struct am_rank_setup *s, int status)
{
    int booted = s->boot != NULL, rank = s->info.rank;
    fflush(stdout);
    fflush(stderr);
    if (booted)
        am_boot_fence(s->boot, s->timeout_s, NULL, 0); /* best effort: the job ends either way */
    am_rank_setup_end(s);
    if (status != 0 && booted && rank != 0)
        sleep(AM_SETUP_STOP_GRACE_S); /* rank 0's supervisor stops the job meanwhile */
    exit(status);
}
