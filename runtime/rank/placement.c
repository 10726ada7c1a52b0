/* placement.c - physical rank <-> mesh rank, TP groups inside NVLink domains (placement.h). */
#include "placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct item {
    int phys, pos; /* pos: place in (node, local rank) order */
    int first;     /* pos of the first rank of its domain */
    const struct am_place_rank *r;
};

static int by_node(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    if (x->r->node_id != y->r->node_id)
        return x->r->node_id < y->r->node_id ? -1 : 1;
    if (x->r->local_rank != y->r->local_rank)
        return x->r->local_rank < y->r->local_rank ? -1 : 1;
    return x->phys - y->phys;
}

static int by_domain(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    int c = strncmp(x->r->domain, y->r->domain, AM_DOMAIN_MAX);
    return c ? c : x->pos - y->pos;
}

static int by_first(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    return x->first != y->first ? x->first - y->first : x->pos - y->pos;
}

static int gcd(int a, int b)
{
    while (b) {
        int t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The ranks in domain order (see placement.h); items[i].first marks the domains. */
static struct item *domain_order(const struct am_place_rank *ranks, int n)
{
    struct item *it = calloc((size_t)n, sizeof(*it));
    if (!it)
        return NULL;
    for (int i = 0; i < n; i++)
        it[i] = (struct item){.phys = i, .r = &ranks[i]};
    qsort(it, (size_t)n, sizeof(*it), by_node);
    for (int i = 0; i < n; i++)
        it[i].pos = i;
    qsort(it, (size_t)n, sizeof(*it), by_domain);
    for (int i = 0; i < n; i++)
        it[i].first = i > 0 && strncmp(it[i].r->domain, it[i - 1].r->domain, AM_DOMAIN_MAX) == 0 ? it[i - 1].first
                                                                                               : it[i].pos;
    qsort(it, (size_t)n, sizeof(*it), by_first);
    return it;
}

void am_place_world(const struct am_place_rank *ranks, int n, struct am_world *w)
{
    *w = (struct am_world){.size = n};
    struct item *it = domain_order(ranks, n);
    if (!it)
        return;
    int g = 0, run = 0;
    for (int i = 0; i < n; i++) {
        run++;
        if (i == n - 1 || it[i + 1].first != it[i].first) {
            g = gcd(g, run);
            run = 0;
        }
    }
    w->nvlink_domain = g;
    qsort(it, (size_t)n, sizeof(*it), by_node);
    int per = -1;
    for (int i = 0; i < n; i++) {
        run++;
        if (i == n - 1 || it[i + 1].r->node_id != it[i].r->node_id) {
            w->nodes++;
            per = per < 0 || per == run ? run : 0;
            run = 0;
        }
    }
    w->gpus_per_node = per > 0 ? per : 0;
    free(it);
}

/* "1, 2 or 4": the divisors of k. */
static void divisors(int k, char *buf, size_t len)
{
    int d[64], n = 0;
    for (int i = 1; i <= k && n < 64; i++)
        if (k % i == 0)
            d[n++] = i;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        size_t l = strlen(buf);
        snprintf(buf + l, len - l, "%s%d", i == 0 ? "" : i == n - 1 ? " or " : ", ", d[i]);
    }
}

/* One domain's entry in the error: "n3:1 has 2 ranks (5, 7)". */
static void describe_domain(const struct item *it, int from, int count, char *buf, size_t len)
{
    int l = snprintf(buf, len, "%s has %d rank%s (", it[from].r->domain, count, count > 1 ? "s" : "");
    for (int k = 0; k < count && l < (int)len - 16; k++) {
        if (k == 8) {
            l += snprintf(buf + l, len - (size_t)l, ", ...");
            break;
        }
        l += snprintf(buf + l, len - (size_t)l, "%s%d", k ? ", " : "", it[from + k].phys);
    }
    if (l < (int)len - 1)
        snprintf(buf + l, len - (size_t)l, ")");
}

int am_place_build(const struct am_place_rank *ranks, int n, int tp, struct am_placement *pl, struct am_errors *err)
{
    memset(pl, 0, sizeof(*pl));
    pl->size = n;
    pl->tp = tp;
    struct item *it = domain_order(ranks, n);
    pl->mesh_of = calloc((size_t)n, sizeof(int));
    pl->physical_of = calloc((size_t)n, sizeof(int));
    int rc = -1, bad = 0, common = 0;
    char list[1024] = "", one[256];
    if (!it || !pl->mesh_of || !pl->physical_of) {
        am_errorf(err, NULL, "placement: out of memory for %d ranks", n);
        goto out;
    }
    if (tp < 1) {
        am_errorf(err, NULL, "placement: tp_size %d must be at least 1", tp);
        goto out;
    }
    for (int i = 0, start = 0; i < n; i++) {
        if (i < n - 1 && it[i + 1].first == it[i].first)
            continue;
        int count = i - start + 1;
        pl->n_domains++;
        common = gcd(common, count);
        if (count % tp) {
            if (bad < 4) {
                describe_domain(it, start, count, one, sizeof(one));
                size_t l = strlen(list);
                snprintf(list + l, sizeof(list) - l, "%s%s", bad ? "; " : "", one);
            }
            bad++;
        }
        start = i + 1;
    }
    if (bad) {
        char ok[256];
        divisors(common, ok, sizeof(ok));
        size_t l = strlen(list);
        if (bad > 4)
            snprintf(list + l, sizeof(list) - l, "; and %d more domain%s", bad - 4, bad - 4 > 1 ? "s" : "");
        am_errorf(err, NULL, "placement: tp_size %d cannot be placed: NVLink domain %s. A tensor-parallel group must "
                  "lie inside one domain, so every domain needs a multiple of %d ranks: use tp_size %s (dividing every "
                  "domain's rank count), or start a multiple of %d ranks in every domain (for example one rank per "
                  "GPU: srun --ntasks-per-node=<GPUs per node>)", tp, list, tp, ok, tp);
        goto out;
    }
    for (int i = 0; i < n; i++) {
        pl->physical_of[i] = it[i].phys;
        pl->mesh_of[it[i].phys] = i;
    }
    rc = 0;
out:
    free(it);
    return rc;
}

void am_place_free(struct am_placement *pl)
{
    free(pl->mesh_of);
    free(pl->physical_of);
    memset(pl, 0, sizeof(*pl));
}

void am_place_coords(const struct am_plan *p, const struct am_placement *pl, int rank, struct am_coords *c)
{
    am_plan_coords(p, pl->mesh_of[rank], c);
}

int am_place_group(const struct am_plan *p, const struct am_placement *pl, enum am_group g, int rank, int *members)
{
    int n = am_plan_group(p, g, pl->mesh_of[rank], members);
    for (int i = 0; i < n; i++)
        members[i] = pl->physical_of[members[i]];
    return n;
}

int am_place_groups(const struct am_plan *p, const struct am_placement *pl, const enum am_group *kinds, int n_kinds,
                    struct am_group_set *set, struct am_errors *err)
{
    int world = p->world, total = 0, rc = -1;
    int *buf = calloc((size_t)world, sizeof(int)), *size_of = calloc((size_t)n_kinds + 1, sizeof(int));
    char *seen = calloc((size_t)world, 1);
    memset(set, 0, sizeof(*set));
    if (!buf || !size_of || !seen) {
        am_errorf(err, NULL, "placement: out of memory for the groups of %d ranks", world);
        goto out;
    }
    if (pl->size != world) {
        am_errorf(err, NULL, "placement: the plan is for %d ranks but the placement for %d", world, pl->size);
        goto out;
    }
    for (int k = 0; k < n_kinds; k++) {
        size_of[k] = am_plan_group(p, kinds[k], 0, buf);
        total += world / size_of[k];
    }
    size_t bytes = (size_t)total * (sizeof(int *) + sizeof(char *) + sizeof(int) + sizeof(enum am_group)) +
                   (size_t)n_kinds * (size_t)world * sizeof(int);
    char *mem = malloc(bytes);
    if (!mem) {
        am_errorf(err, NULL, "placement: out of memory for the groups of %d ranks", world);
        goto out;
    }
    const int **groups = (const int **)mem;
    const char **names = (const char **)(groups + total);
    int *sizes = (int *)(names + total);
    enum am_group *kind_of = (enum am_group *)(sizes + total);
    int *members = (int *)(kind_of + total);
    int i = 0;
    for (int k = 0; k < n_kinds; k++) {
        memset(seen, 0, (size_t)world);
        for (int m = 0; m < world; m++) {
            if (seen[m])
                continue;
            int n = am_plan_group(p, kinds[k], m, buf);
            for (int j = 0; j < n; j++) {
                seen[buf[j]] = 1;
                members[j] = pl->physical_of[buf[j]];
            }
            groups[i] = members;
            sizes[i] = n;
            names[i] = am_group_name(kinds[k]);
            kind_of[i] = kinds[k];
            members += n;
            i++;
        }
    }
    *set = (struct am_group_set){.n = i, .groups = groups, .sizes = sizes, .names = names, .kinds = kind_of,
                                 .storage = mem};
    rc = 0;
out:
    free(buf);
    free(size_of);
    free(seen);
    return rc;
}

void am_group_set_free(struct am_group_set *set)
{
    free(set->storage);
    memset(set, 0, sizeof(*set));
}
