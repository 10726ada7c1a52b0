/* diag_load.c - reading a job's rank logs into struct am_diag (diag.h). */
#include "diag.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void am_diag_init(struct am_diag *d)
{
    memset(d, 0, sizeof(*d));
    d->world = -1;
    d->culprit = -1;
    d->ff_status = -1;
}

static void rank_free(struct am_diag_rank *r)
{
    free(r->steps);
    free(r->flight);
    for (int g = 0; g < r->n_groups; g++)
        free(r->groups[g].ranks);
    free(r->groups);
    json_decref(r->cause);
    json_decref(r->stop);
    json_decref(r->exit);
    json_decref(r->fault);
}

void am_diag_free(struct am_diag *d)
{
    for (int r = 0; r < d->n_ranks; r++)
        rank_free(&d->ranks[r]);
    free(d->ranks);
    for (int i = 0; i < d->n_notes; i++)
        free(d->notes[i]);
    free(d->notes);
    free(d->mismatches);
    am_diag_init(d);
}

void am_diag_note(struct am_diag *d, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    char **n = realloc(d->notes, (size_t)(d->n_notes + 1) * sizeof(*n));
    if (!n)
        return;
    d->notes = n;
    if ((d->notes[d->n_notes] = strdup(text)) != NULL)
        d->n_notes++;
}

struct am_diag_rank *am_diag_rank_get(struct am_diag *d, int rank)
{
    if (rank < 0 || rank > (1 << 24))
        return NULL;
    if (rank >= d->n_ranks) {
        int n = rank + 1;
        struct am_diag_rank *a = realloc(d->ranks, (size_t)n * sizeof(*a));
        if (!a)
            return NULL;
        for (int r = d->n_ranks; r < n; r++) {
            memset(&a[r], 0, sizeof(a[r]));
            a[r].rank = r;
            a[r].local_rank = a[r].node_id = a[r].mesh_rank = a[r].world = -1;
            a[r].status = -1;
            a[r].waiting_for = -1;
        }
        d->ranks = a;
        d->n_ranks = n;
    }
    return &d->ranks[rank];
}

/* ---- records ------------------------------------------------------------------------------ */

static double num(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : 0;
}

static long integer(const json_t *o, const char *key, long def)
{
    const json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (long)json_integer_value(v) : def;
}

static void text(const json_t *o, const char *key, char *out, size_t len)
{
    const char *s = json_string_value(json_object_get(o, key));
    snprintf(out, len, "%s", s ? s : "");
}

/* am-train writes two start records: one before anything that can fail (host, job, rank,
 * world) and one once the rank is placed (coordinates, node, mesh rank, steps, and the time
 * anchor of its flight recorder). Each key a record carries replaces what an earlier one
 * said; a key it lacks keeps the earlier value. */
static void on_start(struct am_diag *d, struct am_diag_rank *r, json_t *o)
{
    r->have_start = 1;
    if (json_is_string(json_object_get(o, "host")))
        text(o, "host", r->host, sizeof(r->host));
    if (json_is_string(json_object_get(o, "job")))
        text(o, "job", r->job, sizeof(r->job));
    r->local_rank = (int)integer(o, "local_rank", r->local_rank);
    r->node_id = (int)integer(o, "node_id", r->node_id);
    r->mesh_rank = (int)integer(o, "mesh_rank", r->mesh_rank);
    r->world = (int)integer(o, "world", r->world);
    r->max_steps = integer(o, "max_steps", r->max_steps);
    if (json_is_number(json_object_get(o, "time")))
        r->start_time = num(o, "time");
    if (json_is_string(json_object_get(o, "device"))) {
        char device[32] = "";
        text(o, "device", device, sizeof(device));
        r->nccl = strcmp(device, "cuda") == 0;
    }
    const json_t *c = json_object_get(o, "coords");
    static const char *const keys[] = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"};
    if (json_is_object(c)) {
        r->have_coords = 1;
        for (int i = 0; i < 6; i++)
            r->coords[i] = (int)integer(c, keys[i], 0);
    }
    if (r->world > d->world)
        d->world = r->world;
    if (!d->job[0] && r->job[0])
        snprintf(d->job, sizeof(d->job), "%s", r->job);
}

static void on_step(struct am_diag_rank *r, json_t *o)
{
    if (r->n_steps == r->cap_steps) {
        size_t cap = r->cap_steps ? 2 * r->cap_steps : 64;
        struct am_diag_step *s = realloc(r->steps, cap * sizeof(*s));
        if (!s)
            return;
        r->steps = s;
        r->cap_steps = cap;
    }
    r->steps[r->n_steps++] = (struct am_diag_step){.step = integer(o, "step", 0), .step_s = num(o, "step_s"),
                                                   .comm_s = num(o, "comm_s"), .time = num(o, "time")};
}

static void on_flight(struct am_diag_rank *r, json_t *o)
{
    if (r->n_flight == r->cap_flight) {
        size_t cap = r->cap_flight ? 2 * r->cap_flight : 256;
        struct am_diag_flight *f = realloc(r->flight, cap * sizeof(*f));
        if (!f)
            return;
        r->flight = f;
        r->cap_flight = cap;
    }
    struct am_diag_flight *f = &r->flight[r->n_flight++];
    memset(f, 0, sizeof(*f));
    text(o, "group", f->group, sizeof(f->group));
    text(o, "op", f->op, sizeof(f->op));
    text(o, "dtype", f->dtype, sizeof(f->dtype));
    text(o, "state", f->state, sizeof(f->state));
    f->gid = (int)integer(o, "gid", -1);
    f->id = (uint64_t)integer(o, "id", 0);
    f->seq = (uint64_t)integer(o, "seq", 0);
    f->count = (uint64_t)integer(o, "count", 0);
    f->bytes = (uint64_t)integer(o, "bytes", 0);
    f->peer = (int)integer(o, "peer", -1);
    f->waiting_for = (int)integer(o, "waiting_for", -1);
    f->enqueued = num(o, "enqueued");
    f->started = num(o, "started");
    f->ended = num(o, "ended");
}

static void on_groups(struct am_diag_rank *r, json_t *o)
{
    const json_t *a = json_object_get(o, "groups");
    if (!json_is_array(a) || r->groups)
        return;
    size_t n = json_array_size(a);
    r->groups = calloc(n ? n : 1, sizeof(*r->groups));
    if (!r->groups)
        return;
    for (size_t i = 0; i < n; i++) {
        const json_t *g = json_array_get(a, i), *ranks = json_object_get(g, "ranks");
        struct am_diag_group *dg = &r->groups[r->n_groups];
        text(g, "name", dg->name, sizeof(dg->name));
        dg->gid = (int)integer(g, "gid", -1);
        size_t m = json_array_size(ranks);
        dg->ranks = calloc(m ? m : 1, sizeof(int));
        if (!dg->ranks)
            continue;
        for (size_t k = 0; k < m; k++)
            dg->ranks[k] = (int)json_integer_value(json_array_get(ranks, k));
        dg->n = (int)m;
        r->n_groups++;
    }
}

static void on_record(struct am_diag *d, struct am_diag_rank *r, json_t *o)
{
    const char *type = json_string_value(json_object_get(o, "type"));
    double t = num(o, "time");
    if (t > r->last_time)
        r->last_time = t;
    if (!type)
        return;
    if (strcmp(type, "start") == 0)
        on_start(d, r, o);
    else if (strcmp(type, "step") == 0)
        on_step(r, o);
    else if (strcmp(type, "flight") == 0)
        on_flight(r, o);
    else if (strcmp(type, "groups") == 0)
        on_groups(r, o);
    else if (strcmp(type, "cause") == 0 && !r->cause)
        r->cause = json_incref(o);
    else if (strcmp(type, "stop") == 0 && !r->stop)
        r->stop = json_incref(o);
    else if (strcmp(type, "exit") == 0 && !r->exit)
        r->exit = json_incref(o);
    else if (strcmp(type, "fault") == 0 && !r->fault)
        r->fault = json_incref(o);
    if (r->n_flight && strcmp(type, "flight") == 0) {
        const struct am_diag_flight *f = &r->flight[r->n_flight - 1];
        double ft = f->ended > 0 ? f->ended : f->started > 0 ? f->started : f->enqueued;
        if (ft > r->last_time)
            r->last_time = ft;
    }
}

int am_diag_add_log(struct am_diag *d, int rank, const char *textp, size_t len)
{
    struct am_diag_rank *r = am_diag_rank_get(d, rank);
    if (!r)
        return -1;
    r->have_log = 1;
    size_t at = 0;
    while (at < len) {
        const char *nl = memchr(textp + at, '\n', len - at);
        size_t end = nl ? (size_t)(nl - textp) : len;
        size_t n = end - at;
        if (n > 0) {
            json_error_t je;
            json_t *o = json_loadb(textp + at, n, 0, &je);
            r->lines++;
            if (json_is_object(o)) {
                on_record(d, r, o);
            } else if (!nl) {
                r->truncated = 1;
                am_diag_note(d, "rank %d: the last line is cut short (%zu bytes, no newline): the rank or its "
                             "supervisor died while writing it; skipped", rank, n);
            } else {
                r->bad_lines++;
                am_diag_note(d, "rank %d: line %d is not a JSON object (%s); skipped", rank, r->lines, je.text);
            }
            json_decref(o);
        }
        at = end + 1;
    }
    return 0;
}

/* ---- the directory ---------------------------------------------------------------------------- */

/* "rank-12.jsonl" -> 12, else -1. */
static int rank_of(const char *name)
{
    int r, n = 0;
    if (sscanf(name, "rank-%d.jsonl%n", &r, &n) != 1 || name[n] != '\0' || r < 0)
        return -1;
    char back[64];
    snprintf(back, sizeof(back), "rank-%d.jsonl", r);
    return strcmp(back, name) == 0 ? r : -1;
}

static int count_logs(const char *dir)
{
    DIR *dd = opendir(dir);
    int n = 0;
    if (!dd)
        return -1;
    for (struct dirent *e; (e = readdir(dd)) != NULL;)
        n += rank_of(e->d_name) >= 0;
    closedir(dd);
    return n;
}

static int read_all(const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap);
    for (size_t got; b && (got = fread(b + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            char *nb = realloc(b, cap * 2);
            if (!nb) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!b || bad) {
        free(b);
        return -1;
    }
    *buf = b;
    *len = n;
    return 0;
}

int am_diag_load_dir(struct am_diag *d, const char *dir, char *err, size_t err_len)
{
    struct stat st;
    if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, err_len, "%s: %s (give the job's log directory: <log dir>/<job id>, holding rank-<R>.jsonl)", dir,
                 stat(dir, &st) < 0 ? strerror(errno) : "not a directory");
        return -1;
    }
    snprintf(d->dir, sizeof(d->dir), "%s", dir);
    int n = count_logs(dir);
    if (n == 0) { /* a log root with one job directory in it */
        DIR *dd = opendir(dir);
        char found[sizeof(d->dir) + 300] = "", names[512] = "";
        int jobs = 0;
        for (struct dirent *e; dd && (e = readdir(dd)) != NULL;) {
            char sub[4096 + 300];
            if (e->d_name[0] == '.')
                continue;
            snprintf(sub, sizeof(sub), "%s/%s", dir, e->d_name);
            if (stat(sub, &st) == 0 && S_ISDIR(st.st_mode) && count_logs(sub) > 0) {
                if (jobs++ == 0)
                    snprintf(found, sizeof(found), "%s", sub);
                size_t at = strlen(names);
                if (at < sizeof(names) - 64)
                    snprintf(names + at, sizeof(names) - at, "%s%s", at ? ", " : "", e->d_name);
            }
        }
        if (dd)
            closedir(dd);
        if (jobs == 0) {
            snprintf(err, err_len, "%s: no rank logs (rank-<R>.jsonl) here nor in a job directory below it (give the "
                     "job's log directory, <log dir>/<job id>)", dir);
            return -1;
        }
        if (jobs > 1) {
            snprintf(err, err_len, "%s holds the logs of %d jobs (%s): give one of them, %s/<job id>", dir, jobs,
                     names, dir);
            return -1;
        }
        snprintf(d->dir, sizeof(d->dir), "%.4000s", found);
    } else if (n < 0) {
        snprintf(err, err_len, "%s: cannot list it: %s", dir, strerror(errno));
        return -1;
    }
    DIR *dd = opendir(d->dir);
    if (!dd) {
        snprintf(err, err_len, "%s: cannot list it: %s", d->dir, strerror(errno));
        return -1;
    }
    int rc = 0;
    for (struct dirent *e; rc == 0 && (e = readdir(dd)) != NULL;) {
        int r = rank_of(e->d_name);
        if (r < 0)
            continue;
        char path[4096 + 300], *buf = NULL;
        size_t len = 0;
        snprintf(path, sizeof(path), "%s/%s", d->dir, e->d_name);
        if (read_all(path, &buf, &len) < 0) {
            am_diag_note(d, "rank %d: cannot read %s: %s", r, path, strerror(errno));
            struct am_diag_rank *x = am_diag_rank_get(d, r);
            if (x)
                x->have_log = 1;
            continue;
        }
        if (am_diag_add_log(d, r, buf, len) < 0) {
            snprintf(err, err_len, "out of memory reading %s", path);
            rc = -1;
        }
        free(buf);
    }
    closedir(dd);
    return rc;
}
