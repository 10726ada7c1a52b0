/* diag_load.c - reading a job's rank logs into struct am_diag (diag.h). */
#include "diag.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void am_diag_init(struct am_diag *d)
{
    memset(d, 0, sizeof(*d));
    d->world = -1;
    d->culprit = -1;
    d->ff_status = -1;
    d->max_file = AM_DIAG_MAX_FILE;
    d->max_listed = AM_DIAG_MAX_LISTED;
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
    json_decref(r->ckpt);
}

void am_diag_free(struct am_diag *d)
{
    for (int r = 0; r < d->n_ranks; r++)
        rank_free(&d->ranks[r]);
    free(d->ranks);
    free(d->index);
    for (size_t i = 0; i < d->strings_cap; i++)
        free(d->strings[i]);
    free(d->strings);
    for (int i = 0; i < d->n_notes; i++)
        free(d->notes[i]);
    free(d->notes);
    free(d->mismatches);
    free(d->missing);
    for (int i = 0; i < d->n_gref; i++)
        free(d->gref[i].sorted);
    free(d->gref);
    free(d->votes);
    am_diag_init(d);
}

void am_diag_utf8_trim(char *buf)
{
    size_t n = strlen(buf), i = n, k = 0;
    while (i > 0 && k < 4 && ((unsigned char)buf[i - 1] & 0xC0) == 0x80) { /* continuation bytes */
        i--;
        k++;
    }
    if (i == 0 || ((unsigned char)buf[i - 1] & 0x80) == 0)
        return; /* ends with ASCII (or only continuation bytes: left to the escaper) */
    unsigned char lead = (unsigned char)buf[i - 1];
    size_t want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    if (k + 1 < want)
        buf[i - 1] = '\0';
}

void am_diag_note(struct am_diag *d, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof(text))
        am_diag_utf8_trim(text);
    char *copy = strdup(text);
    if (!copy)
        return;
    if (d->lock)
        pthread_mutex_lock(d->lock);
    if (d->n_notes == d->cap_notes) {
        int cap = d->cap_notes ? 2 * d->cap_notes : 16;
        char **m = realloc(d->notes, (size_t)cap * sizeof(*m));
        if (m) {
            d->notes = m;
            d->cap_notes = cap;
        }
    }
    if (d->n_notes < d->cap_notes)
        d->notes[d->n_notes++] = copy;
    else
        free(copy);
    if (d->lock)
        pthread_mutex_unlock(d->lock);
}

/* ---- the rank entries: an array and an open-addressing index (rank -> position + 1) ------ */

static size_t slot_of(int rank, size_t cap) { return ((size_t)(unsigned)rank * 2654435761u) & (cap - 1); }

static int index_build(struct am_diag *d, size_t cap)
{
    int *ix = calloc(cap, sizeof(int));
    if (!ix)
        return -1;
    for (int i = 0; i < d->n_ranks; i++) {
        size_t s = slot_of(d->ranks[i].rank, cap);
        while (ix[s])
            s = (s + 1) & (cap - 1);
        ix[s] = i + 1;
    }
    free(d->index);
    d->index = ix;
    d->index_cap = cap;
    return 0;
}

struct am_diag_rank *am_diag_rank_find(const struct am_diag *d, int rank)
{
    if (rank < 0 || !d->index_cap)
        return NULL;
    for (size_t s = slot_of(rank, d->index_cap); d->index[s]; s = (s + 1) & (d->index_cap - 1))
        if (d->ranks[d->index[s] - 1].rank == rank)
            return &d->ranks[d->index[s] - 1];
    return NULL;
}

static void rank_init(struct am_diag_rank *r, int rank)
{
    memset(r, 0, sizeof(*r));
    r->rank = rank;
    r->local_rank = r->node_id = r->mesh_rank = r->world = -1;
    r->status = -1;
    r->waiting_for = -1;
}

struct am_diag_rank *am_diag_rank_get(struct am_diag *d, int rank)
{
    if (rank < 0 || rank == INT_MAX) /* the job's size, the highest rank + 1, is an int */
        return NULL;
    struct am_diag_rank *r = am_diag_rank_find(d, rank);
    if (r)
        return r;
    if (d->n_ranks == d->cap_ranks) {
        int cap = d->cap_ranks ? 2 * d->cap_ranks : 16;
        struct am_diag_rank *a = realloc(d->ranks, (size_t)cap * sizeof(*a));
        if (!a)
            return NULL;
        d->ranks = a;
        d->cap_ranks = cap;
    }
    if ((size_t)(d->n_ranks + 1) * 2 > d->index_cap && index_build(d, d->index_cap ? 2 * d->index_cap : 64) < 0)
        return NULL;
    r = &d->ranks[d->n_ranks];
    rank_init(r, rank);
    size_t s = slot_of(rank, d->index_cap);
    while (d->index[s])
        s = (s + 1) & (d->index_cap - 1);
    d->index[s] = ++d->n_ranks;
    return r;
}

static int by_rank(const void *a, const void *b)
{
    int x = ((const struct am_diag_rank *)a)->rank, y = ((const struct am_diag_rank *)b)->rank;
    return (x > y) - (x < y);
}

int am_diag_sort_ranks(struct am_diag *d)
{
    if (d->n_ranks > 1)
        qsort(d->ranks, (size_t)d->n_ranks, sizeof(*d->ranks), by_rank);
    return index_build(d, d->index_cap ? d->index_cap : 64);
}

/* ---- interned strings ------------------------------------------------------------------- */

static size_t str_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return (size_t)h;
}

const char *am_diag_intern(struct am_diag *d, const char *s, size_t n)
{
    if ((d->n_strings + 1) * 2 > d->strings_cap) {
        size_t cap = d->strings_cap ? 2 * d->strings_cap : 64;
        char **t = calloc(cap, sizeof(*t));
        if (!t)
            return NULL;
        for (size_t i = 0; i < d->strings_cap; i++)
            if (d->strings[i]) {
                size_t k = str_hash(d->strings[i], strlen(d->strings[i])) & (cap - 1);
                while (t[k])
                    k = (k + 1) & (cap - 1);
                t[k] = d->strings[i];
            }
        free(d->strings);
        d->strings = t;
        d->strings_cap = cap;
    }
    size_t k = str_hash(s, n) & (d->strings_cap - 1);
    for (; d->strings[k]; k = (k + 1) & (d->strings_cap - 1))
        if (strncmp(d->strings[k], s, n) == 0 && d->strings[k][n] == '\0')
            return d->strings[k];
    char *c = malloc(n + 1);
    if (!c)
        return NULL;
    memcpy(c, s, n);
    c[n] = '\0';
    d->strings[k] = c;
    d->n_strings++;
    return c;
}

/* ---- one record, from jansson or from the fast reader ------------------------------------ */

/* What reading one log needs: the job (shared with the other readers: its strings, notes,
 * size and id are changed under d->lock when several threads read) and a cache of the
 * strings this reader interned last (group, op, dtype and state names repeat). */
struct loader {
    struct am_diag *d;
    struct {
        const char *s; /* the interned copy */
        size_t n;
    } cache[16];
    unsigned next;
    struct am_diag_flat_keys keys; /* the fast reader's keys of the lines before */
};

static const char *intern_cached(struct loader *L, const char *s, size_t n)
{
    for (int i = 0; i < 16; i++)
        if (L->cache[i].s && L->cache[i].n == n && memcmp(L->cache[i].s, s, n) == 0)
            return L->cache[i].s;
    if (L->d->lock)
        pthread_mutex_lock(L->d->lock);
    const char *c = am_diag_intern(L->d, s, n);
    if (L->d->lock)
        pthread_mutex_unlock(L->d->lock);
    if (c) {
        L->cache[L->next % 16].s = c;
        L->cache[L->next % 16].n = n;
        L->next++;
    }
    return c;
}

/* A record jansson read (start, groups, cause, ...: the rare ones). */
struct rec {
    json_t *o;
};

/* 1 with *v when the value is an integer */
static inline int rec_int(const struct rec *x, const char *key, long long *v)
{
    const json_t *j = json_object_get(x->o, key);
    if (!json_is_integer(j))
        return 0;
    *v = json_integer_value(j);
    return 1;
}

static inline double rec_num(const struct rec *x, const char *key)
{
    const json_t *j = json_object_get(x->o, key);
    return json_is_number(j) ? json_number_value(j) : 0;
}

static inline const char *rec_str(const struct rec *x, const char *key, size_t *len)
{
    const json_t *j = json_object_get(x->o, key);
    if (!json_is_string(j))
        return NULL;
    *len = json_string_length(j);
    return json_string_value(j);
}

/* A wall-clock time: finite, after 1970 and before the year 10000; else 0 (unknown). */
static double sane_time(double t) { return isfinite(t) && t > 0 && t < 253402300800.0 ? t : 0; }
/* A duration in seconds: finite and below 10^9; else 0. */
static double sane_s(double s) { return isfinite(s) && fabs(s) < 1e9 ? s : 0; }

static long long rec_long(const struct rec *x, const char *key, long long lo, long long hi, long long def)
{
    long long v;
    return rec_int(x, key, &v) && v >= lo && v <= hi ? v : def;
}

static void copy_text(const struct rec *x, const char *key, char *out, size_t len)
{
    size_t n = 0;
    const char *s = rec_str(x, key, &n);
    if (!s)
        n = 0;
    if (n >= len)
        n = len - 1;
    memcpy(out, s ? s : "", n);
    out[n] = '\0';
    am_diag_utf8_trim(out);
}

static const char *intern_of(struct loader *L, const struct rec *x, const char *key)
{
    size_t n = 0;
    const char *s = rec_str(x, key, &n);
    const char *c = intern_cached(L, s ? s : "", s ? n : 0);
    return c ? c : "";
}

/* am-train writes two start records: one before anything that can fail (host, job, rank,
 * world) and one once the rank is placed (coordinates, node, mesh rank, steps, the device and
 * the time anchor of its flight recorder). Each key a record carries replaces what an earlier
 * one said; a key it lacks keeps the earlier value. */
static void on_start(struct loader *L, struct am_diag_rank *r, const struct rec *x)
{
    struct am_diag *d = L->d;
    size_t n;
    r->have_start = 1;
    if (rec_str(x, "host", &n))
        copy_text(x, "host", r->host, sizeof(r->host));
    if (rec_str(x, "job", &n))
        copy_text(x, "job", r->job, sizeof(r->job));
    r->local_rank = (int)rec_long(x, "local_rank", 0, INT_MAX, r->local_rank);
    r->node_id = (int)rec_long(x, "node_id", 0, INT_MAX, r->node_id);
    r->mesh_rank = (int)rec_long(x, "mesh_rank", 0, INT_MAX, r->mesh_rank);
    r->world = (int)rec_long(x, "world", 1, INT_MAX, r->world);
    r->max_steps = (long)rec_long(x, "max_steps", 0, INT32_MAX, r->max_steps);
    double t = sane_time(rec_num(x, "time"));
    if (t > 0)
        r->start_time = t;
    double plan = rec_num(x, "plan_bytes");
    if (isfinite(plan) && plan > 0 && plan < 1e18)
        r->plan_bytes = plan;
    const char *device = rec_str(x, "device", &n);
    if (device)
        r->nccl = n == 4 && memcmp(device, "cuda", 4) == 0;
    const json_t *c = x->o ? json_object_get(x->o, "coords") : NULL;
    static const char *const keys[] = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"};
    if (json_is_object(c)) {
        r->have_coords = 1;
        struct rec cx = {.o = (json_t *)c};
        for (int i = 0; i < 6; i++)
            r->coords[i] = (int)rec_long(&cx, keys[i], INT_MIN, INT_MAX, 0);
    }
    if (d->lock)
        pthread_mutex_lock(d->lock);
    if (r->world > d->world)
        d->world = r->world;
    if (!d->job[0] && r->job[0])
        snprintf(d->job, sizeof(d->job), "%s", r->job);
    if (d->lock)
        pthread_mutex_unlock(d->lock);
}

/* The keys of step and flight records the analysis reads, for the fast reader's records: each
 * field's key is classified once, the last field of a key wins (as in jansson). */
enum fkey {
    FK_TYPE, FK_TIME, FK_STEP, FK_STEP_S, FK_COMM_S, FK_GROUP, FK_OP, FK_DTYPE, FK_STATE, FK_GID, FK_ID,
    FK_SEQ, FK_COUNT, FK_BYTES, FK_PEER, FK_WAITING_FOR, FK_ENQUEUED, FK_STARTED, FK_ENDED, FK_EP_IN, FK_DEV_PEAK,
    FK_N
};

#define KEY_IS(f, lit) (memcmp((f)->key, lit, sizeof(lit) - 1) == 0)

static inline int fkey_of(const struct am_diag_field *f)
{
    switch (f->key_len) {
    case 2:
        return KEY_IS(f, "id") ? FK_ID : KEY_IS(f, "op") ? FK_OP : -1;
    case 3:
        return KEY_IS(f, "gid") ? FK_GID : KEY_IS(f, "seq") ? FK_SEQ : -1;
    case 4:
        return KEY_IS(f, "type") ? FK_TYPE : KEY_IS(f, "time") ? FK_TIME : KEY_IS(f, "step") ? FK_STEP
             : KEY_IS(f, "peer") ? FK_PEER : -1;
    case 5:
        return KEY_IS(f, "group") ? FK_GROUP : KEY_IS(f, "dtype") ? FK_DTYPE : KEY_IS(f, "state") ? FK_STATE
             : KEY_IS(f, "count") ? FK_COUNT : KEY_IS(f, "bytes") ? FK_BYTES : KEY_IS(f, "ended") ? FK_ENDED : -1;
    case 6:
        return KEY_IS(f, "step_s") ? FK_STEP_S : KEY_IS(f, "comm_s") ? FK_COMM_S : -1;
    case 7:
        return KEY_IS(f, "started") ? FK_STARTED : -1;
    case 8:
        return KEY_IS(f, "enqueued") ? FK_ENQUEUED : -1;
    case 11:
        return KEY_IS(f, "waiting_for") ? FK_WAITING_FOR : -1;
    case 12:
        return KEY_IS(f, "ep_tokens_in") ? FK_EP_IN : KEY_IS(f, "dev_mem_peak") ? FK_DEV_PEAK : -1;
    default:
        return -1;
    }
}

/* A field's value as the rec_* accessors read it (NULL: absent; a kind other than those of
 * the value wanted reads as absent). */
static inline long long fk_long(const struct am_diag_field *f, long long lo, long long hi, long long def)
{
    return f && f->kind == 'i' && f->i >= lo && f->i <= hi ? f->i : def;
}

static inline double fk_num(const struct am_diag_field *f)
{
    return !f ? 0 : f->kind == 'r' ? am_diag_flat_real(f) : f->kind == 'i' ? (double)f->i : 0;
}

static inline const char *fk_intern(struct loader *L, const struct am_diag_field *f)
{
    const char *c = f && f->kind == 's' ? intern_cached(L, f->s, f->s_len) : intern_cached(L, "", 0);
    return c ? c : "";
}

static inline int fk_rank(struct am_diag_rank *r, const struct am_diag_field *f)
{
    if (!f || f->kind != 'i')
        return -1;
    long long v = f->i;
    if (v >= 0 && v <= INT_MAX)
        return (int)v;
    if (r->bad_ranks++ == 0)
        r->first_bad_rank = v < LONG_MIN ? LONG_MIN : v > LONG_MAX ? LONG_MAX : (long)v;
    return -1;
}

/* A step and a flight record, from their fields (k: the last field of each key). A step's
 * time goes to the rank's ring of recent ones; the record is stored unless timing (diag.h). */
static void on_step(struct am_diag_rank *r, const struct am_diag_field *const *k, int timing)
{
    long long step = fk_long(k[FK_STEP], 1, INT32_MAX, 0);
    if (step == 0) {
        r->bad_steps++;
        return;
    }
    double t = sane_time(fk_num(k[FK_TIME]));
    if (t > r->last_step_time)
        r->last_step_time = t;
    if (step > r->last_step)
        r->last_step = (long)step;
    double step_s = k[FK_STEP_S] ? sane_s(fk_num(k[FK_STEP_S])) : 0;
    if (step_s > 0)
        r->recent_step_s[r->n_step_s++ % AM_DIAG_RECENT_STEPS] = (float)step_s;
    if (timing)
        return;
    if (r->n_steps == r->cap_steps) {
        size_t cap = r->cap_steps ? 2 * r->cap_steps : 64;
        struct am_diag_step *s = realloc(r->steps, cap * sizeof(*s));
        if (!s)
            return;
        r->steps = s;
        r->cap_steps = cap;
    }
    double peak = k[FK_DEV_PEAK] ? fk_num(k[FK_DEV_PEAK]) : 0;
    if (isfinite(peak) && peak > r->dev_peak && peak < 1e18)
        r->dev_peak = peak;
    if (t > 0 && r->step_t0 == 0)
        r->step_t0 = t;
    if (r->first_step == 0 || step < r->first_step) {
        r->first_step = (uint32_t)step;
        r->first_step_s = (float)step_s;
    }
    double compute = sane_s(fk_num(k[FK_STEP_S])) - sane_s(fk_num(k[FK_COMM_S]));
    double ep_in = k[FK_EP_IN] ? fk_num(k[FK_EP_IN]) : -1; /* a count: sane when finite, >= 0 */
    ep_in = isfinite(ep_in) && ep_in >= 0 && ep_in < 1e18 ? ep_in : -1;
    r->steps[r->n_steps++] =
        (struct am_diag_step){.step = (uint32_t)step, .compute = (float)compute, .ep_in = (float)ep_in,
                              .end = t > 0 ? (float)(t - r->step_t0) : 0};
}

static void on_flight(struct loader *L, struct am_diag_rank *r, const struct am_diag_field *const *k)
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
    f->group = fk_intern(L, k[FK_GROUP]);
    f->op = fk_intern(L, k[FK_OP]);
    f->dtype = fk_intern(L, k[FK_DTYPE]);
    f->state = fk_intern(L, k[FK_STATE]);
    f->gid = (int)fk_long(k[FK_GID], INT_MIN, INT_MAX, -1);
    f->id = (uint64_t)fk_long(k[FK_ID], LLONG_MIN, LLONG_MAX, 0);
    f->seq = (uint64_t)fk_long(k[FK_SEQ], LLONG_MIN, LLONG_MAX, 0);
    f->count = (uint64_t)fk_long(k[FK_COUNT], LLONG_MIN, LLONG_MAX, 0);
    f->bytes = (uint64_t)fk_long(k[FK_BYTES], LLONG_MIN, LLONG_MAX, 0);
    f->peer = fk_rank(r, k[FK_PEER]);
    f->waiting_for = fk_rank(r, k[FK_WAITING_FOR]);
    f->enqueued = sane_time(fk_num(k[FK_ENQUEUED]));
    f->started = sane_time(fk_num(k[FK_STARTED]));
    f->ended = sane_time(fk_num(k[FK_ENDED]));
    double ft = f->ended > 0 ? f->ended : f->started > 0 ? f->started : f->enqueued;
    if (ft > r->last_time)
        r->last_time = ft;
}

/* A step or flight record jansson read (one the fast reader refused: escapes, non-ASCII,
 * nested values): its scalar values as fields, the rest as absent. */
static void json_record(struct loader *L, struct am_diag_rank *r, json_t *o, int step)
{
    struct am_diag_field f[FK_N];
    const struct am_diag_field *k[FK_N] = {0};
    const char *key;
    json_t *v;
    int nf = 0;
    json_object_foreach(o, key, v) {
        struct am_diag_field *x = &f[nf];
        memset(x, 0, sizeof(*x));
        x->key = key;
        x->key_len = strlen(key);
        int id = fkey_of(x);
        if (id < 0)
            continue;
        if (json_is_string(v)) {
            x->kind = 's';
            x->s = json_string_value(v);
            x->s_len = json_string_length(v);
        } else if (json_is_integer(v)) {
            x->kind = 'i';
            x->i = json_integer_value(v);
        } else if (json_is_real(v)) {
            x->kind = 'r';
            x->ready = 1;
            x->r = json_real_value(v);
        } else {
            continue; /* true, false, null, objects, arrays: read as absent */
        }
        k[id] = x;
        nf++;
    }
    if (step)
        on_step(r, k, L->d->timing);
    else if (!L->d->timing)
        on_flight(L, r, k);
}

static void on_groups(struct loader *L, struct am_diag_rank *r, json_t *o)
{
    const json_t *a = json_object_get(o, "groups");
    if (!json_is_array(a) || r->groups || L->d->timing)
        return;
    size_t n = json_array_size(a);
    r->groups = calloc(n ? n : 1, sizeof(*r->groups));
    if (!r->groups)
        return;
    for (size_t i = 0; i < n; i++) {
        json_t *g = json_array_get(a, i);
        const json_t *ranks = json_object_get(g, "ranks");
        struct rec gx = {.o = g};
        struct am_diag_group *dg = &r->groups[r->n_groups];
        dg->name = intern_of(L, &gx, "name");
        dg->gid = (int)rec_long(&gx, "gid", INT_MIN, INT_MAX, -1);
        size_t m = json_array_size(ranks);
        dg->ranks = calloc(m ? m : 1, sizeof(int));
        if (!dg->ranks)
            continue;
        for (size_t k = 0; k < m; k++) {
            const json_t *v = json_array_get(ranks, k);
            json_int_t q = json_integer_value(v);
            if (json_is_integer(v) && q >= 0 && q <= INT_MAX)
                dg->ranks[dg->n++] = (int)q;
            else if (r->bad_ranks++ == 0)
                r->first_bad_rank = json_is_integer(v) ? (long)q : -1;
        }
        r->n_groups++;
    }
}

static void on_record(struct loader *L, struct am_diag_rank *r, const struct rec *x)
{
    size_t tl = 0;
    const char *type = rec_str(x, "type", &tl);
    double t = sane_time(rec_num(x, "time"));
    if (t > r->last_time)
        r->last_time = t;
    if (!type || memchr(type, '\0', tl))
        return;
    if ((tl == 4 && memcmp(type, "step", 4) == 0) || (tl == 6 && memcmp(type, "flight", 6) == 0))
        json_record(L, r, x->o, tl == 4);
    else if (strcmp(type, "start") == 0)
        on_start(L, r, x);
    else if (strcmp(type, "groups") == 0)
        on_groups(L, r, x->o);
    else if (strcmp(type, "cause") == 0 && !r->cause)
        r->cause = json_incref(x->o);
    else if (strcmp(type, "stop") == 0 && !r->stop)
        r->stop = json_incref(x->o);
    else if (strcmp(type, "exit") == 0 && !r->exit)
        r->exit = json_incref(x->o);
    else if (strcmp(type, "fault") == 0 && !r->fault)
        r->fault = json_incref(x->o);
    else if (strcmp(type, "checkpoint") == 0) { /* the last one wins */
        json_decref(r->ckpt);
        r->ckpt = json_incref(x->o);
        double s = sane_s(rec_num(x, "seconds"));
        if (s > 0) {
            r->recent_save_step[r->n_save_s % AM_DIAG_RECENT_SAVES] = (long)rec_long(x, "step", 0, LONG_MAX, 0);
            r->recent_save_s[r->n_save_s++ % AM_DIAG_RECENT_SAVES] = (float)s;
        }
    } else if (strcmp(type, "memory") == 0) { /* what the rank allocated, as am-plan counts it */
        static const char *const parts[] = {"weights_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes",
                                            "grad_buffers_bytes", "act_bytes", "pipe_bytes",
                                            "expert_rows_bytes"}; /* (expert parallelism: at the start) */
        double sum = 0;
        for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
            sum += (double)rec_long(x, parts[i], 0, (long long)1 << 60, 0);
        r->mem_bytes = sum;
    } else if (strcmp(type, "checkpoint_start") == 0)
        r->ckpt_started = rec_long(x, "step", 0, LONG_MAX, 0);
}

/* A step or flight record for the fast reader: 1 handled, 0 not one (jansson decides). What
 * it does is on_record's for these two types, read from the classified fields. */
static int fast_record(struct loader *L, struct am_diag_rank *r, const char *line, size_t n)
{
    struct am_diag_field f[32];
    int nf = am_diag_flat_parse_keys(line, n, f, 32, &L->keys);
    if (nf < 0)
        return 0;
    const struct am_diag_field *k[FK_N] = {0};
    for (int i = 0; i < nf; i++) {
        /* the tag of a remembered key: its enum fkey + 2 (1: a key the analysis never reads) */
        int key = L->keys.tag[i] ? L->keys.tag[i] - 2 : (L->keys.tag[i] = (unsigned char)(fkey_of(&f[i]) + 2)) - 2;
        if (key >= 0)
            k[key] = &f[i];
    }
    const struct am_diag_field *type = k[FK_TYPE];
    if (!type || type->kind != 's')
        return 0;
    int step = type->s_len == 4 && memcmp(type->s, "step", 4) == 0;
    if (!step && !(type->s_len == 6 && memcmp(type->s, "flight", 6) == 0))
        return 0;
    double t = sane_time(fk_num(k[FK_TIME]));
    if (t > r->last_time)
        r->last_time = t;
    if (step)
        on_step(r, k, L->d->timing);
    else if (!L->d->timing)
        on_flight(L, r, k);
    return 1;
}

/* Reads one log into r (an entry of no job yet: r->rank set). */
static void parse_log(struct am_diag *d, struct am_diag_rank *r, const char *textp, size_t len)
{
    struct loader L = {.d = d};
    int rank = r->rank;
    r->have_log = 1;
    size_t at = 0;
    int lineno = 0;
    while (at < len) {
        const char *nl = memchr(textp + at, '\n', len - at);
        size_t end = nl ? (size_t)(nl - textp) : len;
        size_t n = end - at;
        lineno++;
        if (n > AM_DIAG_MAX_LINE) {
            r->lines++;
            if (r->long_lines++ == 0)
                r->first_long_line = lineno;
        } else if (n > 0) {
            r->lines++;
            if (!fast_record(&L, r, textp + at, n)) {
                json_error_t je;
                json_t *o = json_loadb(textp + at, n, 0, &je);
                if (json_is_object(o)) {
                    struct rec x = {.o = o};
                    on_record(&L, r, &x);
                } else if (!nl) {
                    r->truncated = 1;
                    am_diag_note(d, "rank %d: the last line is cut short (%zu bytes, no newline): the rank or its "
                                 "supervisor died while writing it; skipped", rank, n);
                } else if (r->bad_lines++ == 0) {
                    r->first_bad_line = lineno;
                    snprintf(r->bad_text, sizeof(r->bad_text), "%s", o ? "not an object" : je.text);
                    am_diag_utf8_trim(r->bad_text);
                }
                json_decref(o);
            }
        }
        at = end + 1;
    }
    if (r->bad_lines == 1)
        am_diag_note(d, "rank %d: line %d is not a JSON object (%s); skipped", rank, r->first_bad_line, r->bad_text);
    else if (r->bad_lines > 1)
        am_diag_note(d, "rank %d: %d lines are not JSON objects (the first: line %d, %s); skipped", rank, r->bad_lines,
                     r->first_bad_line, r->bad_text);
    if (r->long_lines)
        am_diag_note(d, "rank %d: %d line%s longer than %zu MiB (the first: line %d); skipped", rank, r->long_lines,
                     r->long_lines == 1 ? "" : "s", AM_DIAG_MAX_LINE >> 20, r->first_long_line);
    if (r->bad_steps)
        am_diag_note(d, "rank %d: %d step record%s without a step number from 1 to %d; skipped", rank, r->bad_steps,
                     r->bad_steps == 1 ? "" : "s", INT32_MAX);
}

/* Makes r (read by parse_log, or only marked as a log) the job's entry of its rank; r is
 * emptied. A second log of one rank replaces the first. 0, or -1 (no memory). */
static int commit(struct am_diag *d, struct am_diag_rank *r)
{
    if (d->lock)
        pthread_mutex_lock(d->lock);
    struct am_diag_rank *e = am_diag_rank_get(d, r->rank);
    int again = e && e->have_log;
    if (e) {
        rank_free(e);
        *e = *r;
    }
    if (d->lock)
        pthread_mutex_unlock(d->lock);
    if (!e)
        rank_free(r);
    if (again)
        am_diag_note(d, "rank %d: two logs; the last one read is used", r->rank);
    rank_init(r, r->rank);
    return e ? 0 : -1;
}

int am_diag_add_log(struct am_diag *d, int rank, const char *textp, size_t len)
{
    struct am_diag_rank r;
    if (rank < 0 || rank == INT_MAX)
        return -1;
    rank_init(&r, rank);
    parse_log(d, &r, textp, len);
    return commit(d, &r);
}

/* ---- the directory ---------------------------------------------------------------------------- */

/* "rank-12.jsonl" -> 12, else -1. */
static int rank_of(const char *name)
{
    if (strncmp(name, "rank-", 5) != 0)
        return -1;
    const char *p = name + 5;
    long r = 0;
    if (*p < '0' || *p > '9' || (*p == '0' && p[1] != '.'))
        return -1;
    for (; *p >= '0' && *p <= '9'; p++)
        if ((r = r * 10 + (*p - '0')) >= INT_MAX)
            return -1;
    return strcmp(p, ".jsonl") == 0 ? (int)r : -1;
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

/* Reads up to want bytes at offset off into b; the bytes read, or -1. */
static ssize_t read_at(int fd, char *b, size_t want, off_t off)
{
    size_t got = 0;
    while (got < want) {
        ssize_t k = pread(fd, b + got, want - got, off + (off_t)got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -1;
        if (k == 0)
            break;
        got += (size_t)k;
    }
    return (ssize_t)got;
}

static const char *file_kind(mode_t m)
{
    return S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
         : S_ISDIR(m) ? "a directory" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

/* The log's bytes: a regular file only (opened without blocking: a FIFO is refused, not
 * waited on), at most d->max_file of them (the head and the tail of a bigger one). 0, or -1
 * with a note. */
static int read_log(struct am_diag *d, int rank, const char *path, const char *name, char **buf, size_t *len)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) {
        am_diag_note(d, "rank %d: cannot open %s: %s; skipped", rank, name, strerror(errno));
        return -1;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        am_diag_note(d, "rank %d: %s is %s, not a regular file; skipped", rank, name,
                     fstat(fd, &st) < 0 ? strerror(errno) : file_kind(st.st_mode));
        close(fd);
        return -1;
    }
    size_t size = (size_t)st.st_size, cap = d->max_file ? d->max_file : AM_DIAG_MAX_FILE;
    size_t head = size <= cap ? size : cap / 4 < AM_DIAG_HEAD ? cap / 4 : AM_DIAG_HEAD;
    size_t tail = size <= cap ? 0 : cap - head;
    char *b = malloc(head + tail + 1);
    ssize_t h = b ? read_at(fd, b, head, 0) : -1, t = 0;
    if (h >= 0 && tail) {
        while (h > 0 && b[h - 1] != '\n') /* whole lines from the head */
            h--;
        t = read_at(fd, b + h, tail, (off_t)(size - tail));
        if (t > 0) { /* from the first whole line of the tail */
            char *nl = memchr(b + h, '\n', (size_t)t);
            size_t skip = nl ? (size_t)(nl - (b + h)) + 1 : (size_t)t;
            memmove(b + h, b + h + skip, (size_t)t - skip);
            t -= (ssize_t)skip;
        }
    }
    int e = errno;
    close(fd);
    if (h < 0 || t < 0) {
        am_diag_note(d, "rank %d: cannot read %s: %s; skipped", rank, name, b ? strerror(e) : "out of memory");
        free(b);
        return -1;
    }
    if (tail)
        am_diag_note(d, "rank %d: %s holds %zu bytes, more than am-diag reads of one log (%zu %s): read its first "
                     "%zd and last %zd bytes of whole lines, skipped the %zu between", rank, name, size,
                     cap >= ((size_t)1 << 20) ? cap >> 20 : cap, cap >= ((size_t)1 << 20) ? "MiB" : "bytes", h, t,
                     size - (size_t)h - (size_t)t);
    *buf = b;
    *len = (size_t)(h + t);
    return 0;
}

/* The logs to read and the next one to take. */
struct job {
    struct am_diag *d;
    int *ranks;
    size_t n, cap, next;
    int failed_rank; /* out of memory there, or -1 */
};

static void *reader(void *arg)
{
    struct job *jb = arg;
    struct am_diag *d = jb->d;
    for (;;) {
        if (d->lock)
            pthread_mutex_lock(d->lock);
        size_t i = jb->next < jb->n && jb->failed_rank < 0 ? jb->next++ : jb->n;
        if (d->lock)
            pthread_mutex_unlock(d->lock);
        if (i >= jb->n)
            return NULL;
        int r = jb->ranks[i];
        char path[4096 + 64], name[64], *buf = NULL;
        size_t len = 0;
        snprintf(name, sizeof(name), "rank-%d.jsonl", r);
        snprintf(path, sizeof(path), "%.4000s/%s", d->dir, name);
        struct am_diag_rank x;
        rank_init(&x, r);
        if (read_log(d, r, path, name, &buf, &len) < 0)
            x.have_log = 1; /* there, but unreadable (noted) */
        else
            parse_log(d, &x, buf, len);
        free(buf);
        if (commit(d, &x) < 0) {
            if (d->lock)
                pthread_mutex_lock(d->lock);
            jb->failed_rank = r;
            if (d->lock)
                pthread_mutex_unlock(d->lock);
        }
    }
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
    /* the logs, then read by a few threads (each reads, parses and hands over one log at a
     * time; the shared parts of d change under d->lock) */
    DIR *dd = opendir(d->dir);
    if (!dd) {
        snprintf(err, err_len, "%s: cannot list it: %s", d->dir, strerror(errno));
        return -1;
    }
    struct job jb = {.d = d, .failed_rank = -1};
    for (struct dirent *e; (e = readdir(dd)) != NULL;) {
        int r = rank_of(e->d_name);
        if (r < 0)
            continue;
        if (jb.n == jb.cap) {
            size_t cap = jb.cap ? 2 * jb.cap : 64;
            int *m = realloc(jb.ranks, cap * sizeof(int));
            if (!m)
                break;
            jb.ranks = m;
            jb.cap = cap;
        }
        jb.ranks[jb.n++] = r;
    }
    closedir(dd);
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = d->threads > 0 ? d->threads : cpus > 16 ? 16 : cpus > 1 ? (int)cpus : 1;
    if ((size_t)threads > jb.n)
        threads = jb.n ? (int)jb.n : 1;
    pthread_t tid[64];
    int started = 0;
    if (threads > 1) {
        d->lock = &lock;
        for (; started < threads - 1 && started < 64; started++)
            if (pthread_create(&tid[started], NULL, reader, &jb) != 0)
                break;
    }
    reader(&jb);
    for (int i = 0; i < started; i++)
        pthread_join(tid[i], NULL);
    d->lock = NULL;
    free(jb.ranks);
    if (jb.failed_rank >= 0) {
        snprintf(err, err_len, "out of memory reading %s/rank-%d.jsonl", d->dir, jb.failed_rank);
        return -1;
    }
    return 0;
}
