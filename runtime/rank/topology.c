/* topology.c - the topology file, GPU binding and this rank's domain (topology.h). */
#include "topology.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node.h"
#include "util.h"

#define TOPO_MAX_BYTES (4 * 1024 * 1024)
#define TOPO_MAX_GPUS 1024
#define TOPO_MAX_NODES 65536

/* ---- small helpers --------------------------------------------------------------------- */

/* Appends "unknown key" with a suggestion among `known` (NULL-terminated). */
static void unknown_key(struct am_errors *err, const struct am_pos *pos, const char *where, const char *key,
                        const char *const *known)
{
    const char *best = NULL;
    int bd = 3;
    char list[128] = "";
    for (int i = 0; known[i]; i++) {
        int d = am_edit_distance(key, known[i], 3);
        if (d < bd || (d == bd && !best && d <= 2)) {
            bd = d;
            best = known[i];
        }
        size_t l = strlen(list);
        snprintf(list + l, sizeof(list) - l, "%s%s", i ? (known[i + 1] ? ", " : " and ") : "", known[i]);
    }
    if (best && bd <= 2)
        am_errorf(err, pos, "%s%s%.40s: unknown key (did you mean %s?)", where, *where ? "." : "", key, best);
    else
        am_errorf(err, pos, "%s%s%.40s: unknown key (the keys here are %s)", where, *where ? "." : "", key, list);
}

/* Expands a Slurm-style host list of one bracket group: "n[1-3,7]" -> n1 n2 n3 n7, with
 * zero padding kept ("gpu[01-10]"). *out gets the names (in the arena); returns their
 * count, or -1 with a message (the pattern is bad or too large). */
static int expand(struct am_arena *a, const char *pattern, const char ***out, char *why, size_t why_len)
{
    const char *lb = strchr(pattern, '['), *rb = lb ? strchr(lb, ']') : NULL;
    if (!lb && !strchr(pattern, ']')) {
        *out = am_arena_alloc(a, sizeof(char *));
        if (!*out || !((*out)[0] = am_arena_strdup(a, pattern)))
            goto nomem;
        return 1;
    }
    if (!lb || !rb || strchr(rb + 1, '[') || strchr(rb + 1, ']') || rb == lb + 1) {
        snprintf(why, why_len, "'%.40s' is not a node name or a range like n[1-4] or n[1,3,5]", pattern);
        return -1;
    }
    /* two passes: count, then fill */
    int n = 0;
    const char **names = NULL;
    for (int pass = 0; pass < 2; pass++) {
        int k = 0;
        const char *p = lb + 1;
        while (p < rb) {
            char *end;
            if (!isdigit((unsigned char)*p))
                goto bad;
            int width = 0;
            for (const char *q = p; isdigit((unsigned char)*q); q++)
                width++;
            errno = 0;
            long lo = strtol(p, &end, 10), hi = lo;
            p = end;
            if (*p == '-') {
                if (!isdigit((unsigned char)p[1]))
                    goto bad;
                hi = strtol(p + 1, &end, 10);
                p = end;
            }
            if (errno || hi < lo || hi - lo >= TOPO_MAX_NODES || (*p != ',' && p != rb))
                goto bad;
            if (*p == ',')
                p++;
            for (long v = lo; v <= hi; v++, k++) {
                if (k >= TOPO_MAX_NODES) {
                    snprintf(why, why_len, "'%.40s' names more than %d nodes", pattern, TOPO_MAX_NODES);
                    return -1;
                }
                if (pass == 1) {
                    char name[256];
                    int l = snprintf(name, sizeof(name), "%.*s%0*ld%s", (int)(lb - pattern), pattern, width, v,
                                     rb + 1);
                    if (l < 0 || (size_t)l >= sizeof(name)) {
                        snprintf(why, why_len, "'%.40s': node names are at most 255 characters", pattern);
                        return -1;
                    }
                    if (!(names[k] = am_arena_strdup(a, name)))
                        goto nomem;
                }
            }
        }
        if (pass == 0) {
            n = k;
            names = am_arena_alloc(a, (size_t)n * sizeof(char *));
            if (!names)
                goto nomem;
        }
    }
    *out = names;
    return n;
bad:
    snprintf(why, why_len, "'%.40s' has a bad range: write n[1-4], n[1,3,5] or n[01-16]", pattern);
    return -1;
nomem:
    snprintf(why, why_len, "out of memory");
    return -1;
}

/* ---- the file --------------------------------------------------------------------------- */

struct parse {
    struct am_topology *t;
    struct am_errors *err;
    struct am_pos *node_pos;    /* where each node was defined */
    struct am_pos *domains_pos; /* where its `domains` was given; line 0: not given */
    size_t cap;
};

static int add_node(struct parse *ps, const char *name, const struct am_pos *pos)
{
    struct am_topology *t = ps->t;
    for (size_t i = 0; i < t->n_nodes; i++) {
        if (strcmp(t->nodes[i].name, name) == 0) {
            char where[512];
            am_pos_format(&ps->node_pos[i], where, sizeof(where));
            where[strlen(where) > 2 ? strlen(where) - 2 : 0] = '\0';
            am_errorf(ps->err, pos, "nodes: %s is listed twice (also at %s): give each node once", name, where);
            return -1;
        }
    }
    if (t->n_nodes == ps->cap) {
        size_t cap = ps->cap ? 2 * ps->cap : 16;
        struct am_topo_node *v = am_arena_alloc(&t->arena, cap * sizeof(*v));
        struct am_pos *p = am_arena_alloc(&t->arena, cap * sizeof(*p));
        struct am_pos *d = am_arena_alloc(&t->arena, cap * sizeof(*d));
        if (!v || !p || !d) {
            am_errorf(ps->err, pos, "nodes: out of memory");
            return -1;
        }
        memcpy(v, t->nodes, t->n_nodes * sizeof(*v));
        memcpy(p, ps->node_pos, t->n_nodes * sizeof(*p));
        memcpy(d, ps->domains_pos, t->n_nodes * sizeof(*d));
        t->nodes = v;
        ps->node_pos = p;
        ps->domains_pos = d;
        ps->cap = cap;
    }
    ps->node_pos[t->n_nodes] = *pos;
    ps->domains_pos[t->n_nodes] = (struct am_pos){0};
    t->nodes[t->n_nodes++] = (struct am_topo_node){.name = name, .cluster = -1};
    return 0;
}

/* `domains: [[0,1],[2,3]]` of a node with `gpus` GPUs into domain_of[], numbered in the
 * order of each domain's lowest GPU. */
static int read_domains(struct parse *ps, struct am_node *v, const char *where, int gpus, int *domain_of,
                        int *n_domains)
{
    struct am_errors *err = ps->err;
    char key[400];
    int bad = 0, listed = 0;
    if (v->kind != AM_NODE_SEQ) {
        am_errorf(err, &v->pos, "%s.domains: expected a list of GPU lists, like [[0, 1], [2, 3]]", where);
        return -1;
    }
    int *lowest = am_arena_alloc(&ps->t->arena, (v->n + 1) * sizeof(int));
    if (!lowest)
        return -1;
    for (int g = 0; g < gpus; g++)
        domain_of[g] = -1;
    for (size_t d = 0; d < v->n; d++) {
        struct am_node *list = v->entries[d].value;
        if (list->kind != AM_NODE_SEQ || list->n == 0) {
            am_errorf(err, &list->pos, "%s.domains[%zu]: expected a non-empty list of GPU numbers, like [0, 1]", where, d);
            bad = 1;
            continue;
        }
        lowest[d] = INT_MAX;
        for (size_t i = 0; i < list->n; i++) {
            long g;
            snprintf(key, sizeof(key), "%s.domains[%zu][%zu]", where, d, i);
            if (am_node_long(list->entries[i].value, key, 0, gpus - 1, &g, err) < 0) {
                bad = 1;
                continue;
            }
            if (domain_of[g] >= 0) {
                am_errorf(err, &list->entries[i].value->pos, "%s: GPU %ld is already in domains[%d]: a GPU belongs to "
                          "one domain", key, g, domain_of[g]);
                bad = 1;
                continue;
            }
            domain_of[g] = (int)d;
            listed++;
            if (g < lowest[d])
                lowest[d] = (int)g;
        }
    }
    if (!bad && listed < gpus) {
        char missing[128] = "";
        for (int g = 0, k = 0; g < gpus; g++) {
            if (domain_of[g] >= 0)
                continue;
            size_t l = strlen(missing);
            if (k++ < 8)
                snprintf(missing + l, sizeof(missing) - l, "%s%d", l ? ", " : "", g);
            else if (k == 9)
                snprintf(missing + l, sizeof(missing) - l, ", ...");
        }
        am_errorf(err, &v->pos, "%s.domains: GPU%s %s %s in no domain: list every GPU 0..%d exactly once", where,
                  gpus - listed > 1 ? "s" : "", missing, gpus - listed > 1 ? "are" : "is", gpus - 1);
        bad = 1;
    }
    if (bad)
        return -1;
    /* renumber: domain d -> its rank among the domains by lowest GPU */
    int *order = am_arena_alloc(&ps->t->arena, (v->n + 1) * sizeof(int));
    if (!order)
        return -1;
    for (size_t d = 0; d < v->n; d++) {
        int k = 0;
        for (size_t e = 0; e < v->n; e++)
            k += lowest[e] < lowest[d];
        order[d] = k;
    }
    for (int g = 0; g < gpus; g++)
        domain_of[g] = order[domain_of[g]];
    *n_domains = (int)v->n;
    return 0;
}

static int read_node(struct parse *ps, struct am_entry *e)
{
    static const char *const keys[] = {"gpus", "domains", NULL};
    struct am_topology *t = ps->t;
    struct am_errors *err = ps->err;
    char where[320], why[160];
    const char **names;
    snprintf(where, sizeof(where), "nodes.%.200s", e->key);
    int n = expand(&t->arena, e->key, &names, why, sizeof(why));
    if (n < 0) {
        am_errorf(err, &e->key_pos, "nodes: %s", why);
        return -1;
    }
    struct am_node *v = e->value;
    if (v->kind != AM_NODE_MAP) {
        am_errorf(err, &v->pos, "%s: expected a section like {gpus: 4, domains: [[0, 1], [2, 3]]}", where);
        return -1;
    }
    int bad = 0;
    for (size_t i = 0; i < v->n; i++)
        if (strcmp(v->entries[i].key, "gpus") && strcmp(v->entries[i].key, "domains")) {
            unknown_key(err, &v->entries[i].key_pos, where, v->entries[i].key, keys);
            bad = 1;
        }
    struct am_node *gpus_node = am_node_child(v, "gpus"), *domains = am_node_child(v, "domains");
    long gpus = 0;
    if (!gpus_node) {
        am_errorf(err, &v->pos, "%s: gpus is missing (how many GPUs the node has; 0 for none)", where);
        return -1;
    }
    char key[340];
    snprintf(key, sizeof(key), "%s.gpus", where);
    if (am_node_long(gpus_node, key, 0, TOPO_MAX_GPUS, &gpus, err) < 0)
        return -1;
    int *domain_of = am_arena_alloc(&t->arena, ((size_t)gpus + 1) * sizeof(int));
    int n_domains = gpus > 0 ? 1 : 0;
    if (!domain_of)
        return -1;
    if (domains && gpus == 0) {
        am_errorf(err, &domains->pos, "%s.domains: the node has no GPUs (gpus: 0): remove domains", where);
        bad = 1;
    } else if (domains) {
        if (read_domains(ps, domains, where, (int)gpus, domain_of, &n_domains) < 0)
            bad = 1;
    }
    if (bad)
        return -1;
    for (int i = 0; i < n; i++) {
        if (add_node(ps, names[i], &e->key_pos) < 0)
            return -1;
        struct am_topo_node *tn = &t->nodes[t->n_nodes - 1];
        tn->gpus = (int)gpus;
        tn->domain_of = domain_of;
        tn->n_domains = n_domains;
        if (domains)
            ps->domains_pos[t->n_nodes - 1] = domains->pos;
    }
    return 0;
}

static int read_cluster(struct parse *ps, struct am_node *c, size_t index)
{
    static const char *const keys[] = {"name", "nodes", NULL};
    struct am_topology *t = ps->t;
    struct am_errors *err = ps->err;
    char where[64], key[96], why[160], name_buf[32];
    snprintf(where, sizeof(where), "clusters[%zu]", index);
    if (c->kind != AM_NODE_MAP) {
        am_errorf(err, &c->pos, "%s: expected a section like {name: rack-a, nodes: [n1, n2]}", where);
        return -1;
    }
    int bad = 0;
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->entries[i].key, "name") && strcmp(c->entries[i].key, "nodes")) {
            unknown_key(err, &c->entries[i].key_pos, where, c->entries[i].key, keys);
            bad = 1;
        }
    const char *name = NULL;
    struct am_node *name_node = am_node_child(c, "name"), *list = am_node_child(c, "nodes");
    snprintf(key, sizeof(key), "%s.name", where);
    if (name_node && am_node_str(name_node, key, &name, err) < 0)
        return -1;
    if (!name) {
        snprintf(name_buf, sizeof(name_buf), "cluster%zu", index);
        name = am_arena_strdup(&t->arena, name_buf);
    }
    if (!name || !*name || strlen(name) >= AM_DOMAIN_MAX) {
        am_errorf(err, name_node ? &name_node->pos : &c->pos, "%s.name: must be 1 to %d characters", where,
                  AM_DOMAIN_MAX - 1);
        return -1;
    }
    for (size_t i = 0; i < t->n_clusters; i++)
        if (strcmp(t->clusters[i], name) == 0) {
            am_errorf(err, name_node ? &name_node->pos : &c->pos, "%s.name: '%s' is also the name of clusters[%zu]: "
                      "names must differ", where, name, i);
            return -1;
        }
    t->clusters[t->n_clusters] = name;
    if (!list || list->kind != AM_NODE_SEQ || list->n == 0) {
        am_errorf(err, list ? &list->pos : &c->pos, "%s.nodes: expected a non-empty list of node names, like "
                  "[n1, n2] or [\"n[1-18]\"]", where);
        return -1;
    }
    for (size_t i = 0; i < list->n; i++) {
        struct am_node *item = list->entries[i].value;
        const char *pattern, **names;
        snprintf(key, sizeof(key), "%s.nodes[%zu]", where, i);
        if (am_node_str(item, key, &pattern, err) < 0) {
            bad = 1;
            continue;
        }
        int n = expand(&t->arena, pattern, &names, why, sizeof(why));
        if (n < 0) {
            am_errorf(err, &item->pos, "%s: %s", key, why);
            bad = 1;
            continue;
        }
        for (int k = 0; k < n; k++) {
            size_t j = 0;
            while (j < t->n_nodes && strcmp(t->nodes[j].name, names[k]))
                j++;
            if (j == t->n_nodes) {
                am_errorf(err, &item->pos, "%s: node %s is not listed under nodes: add it there (with its gpus)", key,
                          names[k]);
                bad = 1;
            } else if (t->nodes[j].cluster >= 0) {
                am_errorf(err, &item->pos, "%s: node %s is already in cluster %s: a node is in at most one cluster",
                          key, names[k], t->clusters[t->nodes[j].cluster]);
                bad = 1;
            } else if (ps->domains_pos[j].line) {
                am_errorf(err, &ps->domains_pos[j], "nodes.%s.domains: node %s is in cluster %s, whose NVLink "
                          "domain spans all its GPUs: remove domains", names[k], names[k], name);
                bad = 1;
            } else {
                t->nodes[j].cluster = (int)t->n_clusters;
            }
        }
    }
    t->n_clusters++;
    return bad ? -1 : 0;
}

int am_topology_parse(const char *name, const char *buf, size_t len, struct am_topology *t, struct am_errors *err)
{
    static const char *const keys[] = {"nodes", "clusters", NULL};
    memset(t, 0, sizeof(*t));
    am_arena_init(&t->arena, 64 * 1024 * 1024);
    struct parse ps = {.t = t, .err = err};
    size_t before = err->n;
    t->file = am_arena_strdup(&t->arena, name);
    struct am_node *root = am_yaml_parse(&t->arena, t->file, NULL, buf, len, err);
    if (!root)
        return -1;
    struct am_pos file_pos = {.file = t->file};
    if (root->kind != AM_NODE_MAP) {
        am_errorf(err, &root->pos, "a topology file is a section with nodes: (and optionally clusters:)");
        return -1;
    }
    for (size_t i = 0; i < root->n; i++)
        if (strcmp(root->entries[i].key, "nodes") && strcmp(root->entries[i].key, "clusters"))
            unknown_key(err, &root->entries[i].key_pos, "", root->entries[i].key, keys);
    struct am_node *nodes = am_node_child(root, "nodes"), *clusters = am_node_child(root, "clusters");
    if (!nodes || nodes->kind != AM_NODE_MAP || nodes->n == 0) {
        am_errorf(err, nodes ? &nodes->pos : &file_pos, "nodes: expected a section with one entry per node, like "
                  "nodes: {n1: {gpus: 4, domains: [[0, 1], [2, 3]]}}");
        return -1;
    }
    for (size_t i = 0; i < nodes->n; i++)
        read_node(&ps, &nodes->entries[i]);
    if (err->n > before)
        return -1;
    if (clusters) {
        if (clusters->kind != AM_NODE_SEQ) {
            am_errorf(err, &clusters->pos, "clusters: expected a list like [{name: rack-a, nodes: [n1, n2]}]");
            return -1;
        }
        t->clusters = am_arena_alloc(&t->arena, (clusters->n + 1) * sizeof(char *));
        if (!t->clusters)
            return -1;
        for (size_t i = 0; i < clusters->n; i++)
            read_cluster(&ps, clusters->entries[i].value, i);
    }
    return err->n > before ? -1 : 0;
}

int am_topology_load(const char *path, struct am_topology *t, struct am_errors *err)
{
    char *buf;
    size_t len;
    const char *why = am_read_file(path, TOPO_MAX_BYTES, &buf, &len);
    if (why) {
        memset(t, 0, sizeof(*t));
        am_arena_init(&t->arena, 1024);
        am_errorf(err, NULL, "topology file %s: %s (set --topology or AM_TOPOLOGY_FILE to a readable file)", path, why);
        return -1;
    }
    int rc = am_topology_parse(path, buf, len, t, err);
    free(buf);
    return rc;
}

void am_topology_free(struct am_topology *t)
{
    am_arena_free(&t->arena);
    memset(t, 0, sizeof(*t));
}

const struct am_topo_node *am_topology_node(const struct am_topology *t, const char *host)
{
    for (size_t i = 0; i < t->n_nodes; i++)
        if (strcmp(t->nodes[i].name, host) == 0)
            return &t->nodes[i];
    return NULL;
}

void am_topology_domain(const struct am_topology *t, const struct am_topo_node *n, int gpu, char *out, size_t len)
{
    if (n->cluster >= 0 && n->gpus > 0)
        snprintf(out, len, "%s", t->clusters[n->cluster]);
    else if (gpu < 0 || gpu >= n->gpus)
        snprintf(out, len, "%s", n->name);
    else
        snprintf(out, len, "%s:%d", n->name, n->domain_of[gpu]);
}

/* ---- GPU binding ------------------------------------------------------------------------ */

/* "0,1,3" -> numbers; returns the count, -1 when an entry is not a number (a GPU UUID). */
static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s) {
        char *end;
        if (!isdigit((unsigned char)*s))
            return -1;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || v > 1 << 20 || (*end && *end != ','))
            return -1;
        if (n < max)
            out[n] = (int)v;
        n++;
        s = *end ? end + 1 : end;
    }
    return n > max ? -1 : n;
}

int am_gpu_bind(const char *visible, const char *step, int local_rank, int node_gpus, struct am_gpu_binding *b,
                char *err, size_t err_len)
{
    enum { MAX = TOPO_MAX_GPUS };
    int vis[MAX], stp[MAX], phys[MAX];
    int nv = visible && *visible ? parse_list(visible, vis, MAX) : 0;
    int ns = step && *step ? parse_list(step, stp, MAX) : 0;
    int n = 0, cuda_renumbered = 0;
    *b = (struct am_gpu_binding){.gpu = -1, .device = -1, .n = 0};
    if (ns < 0) {
        snprintf(err, err_len, "SLURM_STEP_GPUS='%.60s' is not a list of GPU numbers", step);
        return -1;
    }
    if (nv < 0) { /* UUIDs or MIG names: the order is CUDA's, the indices unknown */
        int count = 1;
        for (const char *p = visible; *p; p++)
            count += *p == ',';
        b->n = count;
        b->device = local_rank % count;
        if (ns == count)
            b->gpu = stp[b->device];
        return 0;
    }
    if (nv > 0) {
        int all_in_step = 1;
        for (int i = 0; i < nv && ns > 0; i++) {
            int found = 0;
            for (int k = 0; k < ns; k++)
                found |= stp[k] == vis[i];
            all_in_step &= found;
        }
        for (int i = 0; i < nv; i++) {
            if (ns > 0 && !all_in_step) { /* a cgroup renumbered the step's GPUs from 0 */
                if (vis[i] >= ns) {
                    snprintf(err, err_len, "CUDA_VISIBLE_DEVICES='%.60s' names device %d, but the step has %d GPUs "
                             "(SLURM_STEP_GPUS='%.60s')", visible, vis[i], ns, step);
                    return -1;
                }
                phys[n++] = stp[vis[i]];
            } else {
                phys[n++] = vis[i];
            }
        }
        cuda_renumbered = 1;
    } else if (ns > 0) {
        memcpy(phys, stp, (size_t)ns * sizeof(int));
        n = ns;
    } else {
        for (int g = 0; g < node_gpus && g < MAX; g++)
            phys[n++] = g;
    }
    for (int i = 0; i < n && node_gpus > 0; i++)
        if (phys[i] >= node_gpus) {
            snprintf(err, err_len, "GPU %d (from %s) does not exist: the node has %d GPU%s (0..%d)", phys[i],
                     nv > 0 ? "CUDA_VISIBLE_DEVICES" : "SLURM_STEP_GPUS", node_gpus, node_gpus > 1 ? "s" : "",
                     node_gpus - 1);
            return -1;
        }
    if (n == 0)
        return 0;
    int i = local_rank % n;
    b->n = n;
    b->gpu = phys[i];
    b->device = cuda_renumbered ? i : phys[i];
    return 0;
}

/* ---- this rank -------------------------------------------------------------------------- */

int am_rank_topology(const char *host, int local_rank, struct am_rank_topo *out, struct am_errors *err)
{
    const char *file = getenv("AM_TOPOLOGY_FILE"), *visible = getenv("CUDA_VISIBLE_DEVICES");
    const char *step = getenv("SLURM_STEP_GPUS");
    char msg[512], why[256];
    int rc = -1, node_gpus = 0, nvml = 0;
    struct am_topology t;
    const struct am_topo_node *node = NULL;
    memset(&t, 0, sizeof(t));
    am_arena_init(&t.arena, 1024);
    memset(out, 0, sizeof(*out));
    if (!step || !*step)
        step = getenv("SLURM_JOB_GPUS");
    if (file && *file) {
        am_topology_free(&t);
        if (am_topology_load(file, &t, err) < 0)
            goto out;
        node = am_topology_node(&t, host);
        if (!node) {
            am_errorf(err, NULL, "topology file %s: node %s (this rank's host) is not listed: add it under nodes: "
                      "(with its gpus)", file, host);
            goto out;
        }
        node_gpus = node->gpus;
        snprintf(out->source, sizeof(out->source), "topology file");
    } else {
        nvml = am_nvml_domain(host, -1, &node_gpus, out->domain, sizeof(out->domain), why, sizeof(why));
        if (nvml < 0) {
            am_errorf(err, NULL, "NVML on %s: %s", host, why);
            goto out;
        }
        snprintf(out->source, sizeof(out->source), "%s", nvml ? "NVML" : "no GPU information");
    }
    if (am_gpu_bind(visible, step, local_rank, node_gpus, &out->gpu, msg, sizeof(msg)) < 0) {
        am_errorf(err, NULL, "GPU binding on %s: %s", host, msg);
        goto out;
    }
    if (node) {
        am_topology_domain(&t, node, out->gpu.gpu, out->domain, sizeof(out->domain));
    } else if (nvml && out->gpu.gpu >= 0) {
        if (am_nvml_domain(host, out->gpu.gpu, &node_gpus, out->domain, sizeof(out->domain), why, sizeof(why)) < 0) {
            am_errorf(err, NULL, "NVML on %s: %s", host, why);
            goto out;
        }
    } else {
        snprintf(out->domain, sizeof(out->domain), "%s", host);
    }
    rc = 0;
out:
    am_topology_free(&t);
    return rc;
}
