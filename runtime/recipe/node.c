/* node.c - lookup and update of the document tree (node.h). */
#include "node.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int am_node_append(struct am_arena *a, struct am_node *n, const char *key, struct am_pos key_pos,
                   struct am_node *value)
{
    if (n->n == n->cap) {
        size_t cap = n->cap ? 2 * n->cap : 4;
        struct am_entry *e = am_arena_alloc(a, cap * sizeof(*e));
        if (!e)
            return -1;
        if (n->n)
            memcpy(e, n->entries, n->n * sizeof(*e));
        n->entries = e;
        n->cap = cap;
    }
    n->entries[n->n++] = (struct am_entry){.key = key, .key_pos = key_pos, .value = value};
    return 0;
}

struct am_entry *am_node_entry(struct am_node *map, const char *key)
{
    if (!map || map->kind != AM_NODE_MAP)
        return NULL;
    for (size_t i = 0; i < map->n; i++)
        if (strcmp(map->entries[i].key, key) == 0)
            return &map->entries[i];
    return NULL;
}

struct am_node *am_node_child(struct am_node *map, const char *key)
{
    struct am_entry *e = am_node_entry(map, key);
    if (!e)
        return NULL;
    e->used = true;
    return e->value;
}

struct am_node *am_node_path(struct am_node *root, const char *path)
{
    struct am_node *n = root;
    const char *p = path;
    char key[256];
    while (n && *p) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        if (len >= sizeof(key))
            return NULL;
        memcpy(key, p, len);
        key[len] = '\0';
        struct am_entry *e = am_node_entry(n, key);
        n = e ? e->value : NULL;
        p = dot ? dot + 1 : p + len;
    }
    return n;
}

int am_node_set(struct am_arena *a, struct am_node *root, const char *path, struct am_node *value,
                const struct am_pos *pos, struct am_errors *err)
{
    struct am_node *n = root;
    const char *p = path;
    char key[256], walked[512] = "";
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        if (len == 0 || len >= sizeof(key)) {
            am_errorf(err, pos, "'%s' is not a valid key path (use section.key, e.g. distributed.tp_size)",
                      path);
            return -1;
        }
        memcpy(key, p, len);
        key[len] = '\0';
        if (n->kind != AM_NODE_MAP) {
            am_errorf(err, pos, "%s: cannot set '%s' inside it: %s is a %s, not a section", path, key,
                      walked, n->kind == AM_NODE_SEQ ? "list" : "value");
            return -1;
        }
        struct am_entry *e = am_node_entry(n, key);
        if (!dot) {
            if (e)
                e->value = value;
            else if (am_node_append(a, n, am_arena_strdup(a, key), *pos, value) < 0)
                goto oom;
            return 0;
        }
        if (!e) {
            struct am_node *m = am_arena_alloc(a, sizeof(*m));
            if (!m || am_node_append(a, n, am_arena_strdup(a, key), *pos, m) < 0)
                goto oom;
            m->kind = AM_NODE_MAP;
            m->pos = *pos;
            e = &n->entries[n->n - 1];
        }
        size_t wl = strlen(walked);
        snprintf(walked + wl, sizeof(walked) - wl, "%s%s", wl ? "." : "", key);
        n = e->value;
        p = dot + 1;
    }
oom:
    am_errorf(err, pos, "out of memory while applying %s", path);
    return -1;
}

bool am_node_is_null(const struct am_node *n)
{
    if (!n)
        return true;
    if (n->kind != AM_NODE_SCALAR || !n->plain)
        return false;
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL", "none", "None"};
    for (size_t i = 0; i < sizeof(nulls) / sizeof(nulls[0]); i++)
        if (strcmp(n->str, nulls[i]) == 0)
            return true;
    return false;
}


/* Quotes a user value for a message: at most 40 bytes, non-printable bytes as '?'. */
static void quote(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 4 < len && i < 40; i++)
        buf[i] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (s[i] && i + 4 < len)
        buf[i++] = '.', buf[i++] = '.', buf[i++] = '.';
    buf[i] = '\0';
}

static int expect_scalar(const struct am_node *n, const char *key, const char *what, struct am_errors *err)
{
    if (n->kind == AM_NODE_SCALAR)
        return 0;
    am_errorf(err, &n->pos, "%s: expected %s, got a %s", key, what, n->kind == AM_NODE_MAP ? "section" : "list");
    return -1;
}

int am_node_long(const struct am_node *n, const char *key, long min, long max, long *out,
                 struct am_errors *err)
{
    char q[64];
    if (expect_scalar(n, key, "a whole number", err) < 0)
        return -1;
    const char *s = n->str;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno) {
        /* 1e3, 4.0: accept when the value is exactly a whole number */
        errno = 0;
        double d = strtod(s, &end);
        if (*s == '\0' || *end != '\0' || errno || !isfinite(d) || d != floor(d) || fabs(d) > 9.0e15) {
            quote(s, q, sizeof(q));
            am_errorf(err, &n->pos, "%s: expected a whole number, got '%s'", key, q);
            return -1;
        }
        v = (long)d;
    }
    if (v < min || v > max) {
        if (max == LONG_MAX)
            am_errorf(err, &n->pos, "%s: %ld is out of range (must be >= %ld)", key, v, min);
        else
            am_errorf(err, &n->pos, "%s: %ld is out of range (must be %ld to %ld)", key, v, min, max);
        return -1;
    }
    *out = v;
    return 0;
}

int am_node_double(const struct am_node *n, const char *key, double *out, struct am_errors *err)
{
    char q[64];
    if (expect_scalar(n, key, "a number", err) < 0)
        return -1;
    char *end;
    errno = 0;
    double d = strtod(n->str, &end);
    if (n->str[0] == '\0' || *end != '\0' || errno || !isfinite(d)) {
        quote(n->str, q, sizeof(q));
        am_errorf(err, &n->pos, "%s: expected a number, got '%s'", key, q);
        return -1;
    }
    *out = d;
    return 0;
}

int am_node_bool(const struct am_node *n, const char *key, bool *out, struct am_errors *err)
{
    static const char *const yes[] = {"true", "True", "TRUE", "yes", "Yes", "on", "1"};
    static const char *const no[] = {"false", "False", "FALSE", "no", "No", "off", "0"};
    char q[64];
    if (expect_scalar(n, key, "true or false", err) < 0)
        return -1;
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        if (strcmp(n->str, yes[i]) == 0)
            return *out = true, 0;
        if (strcmp(n->str, no[i]) == 0)
            return *out = false, 0;
    }
    quote(n->str, q, sizeof(q));
    am_errorf(err, &n->pos, "%s: expected true or false, got '%s'", key, q);
    return -1;
}

int am_node_str(const struct am_node *n, const char *key, const char **out, struct am_errors *err)
{
    if (expect_scalar(n, key, "a string", err) < 0)
        return -1;
    *out = n->str;
    return 0;
}

int am_node_choice(const struct am_node *n, const char *key, const char *const *choices, int *out,
                   struct am_errors *err)
{
    char q[64], list[512] = "";
    if (expect_scalar(n, key, "a name", err) < 0)
        return -1;
    for (int i = 0; choices[i]; i++) {
        if (strcmp(n->str, choices[i]) == 0)
            return *out = i, 0;
        size_t l = strlen(list);
        snprintf(list + l, sizeof(list) - l, "%s%s", i ? ", " : "", choices[i]);
    }
    quote(n->str, q, sizeof(q));
    am_errorf(err, &n->pos, "%s: '%s' is not one of: %s", key, q, list);
    return -1;
}
