/* env.c - ${VAR} interpolation in recipe values (node.h: am_node_resolve_env), as AutoModel's
 * loader (resolve_yaml_env_vars) does it:
 *   1. every `${EXPR}` (EXPR: one or more characters up to the first `}`) is replaced: EXPR is
 *      stripped of surrounding whitespace and of a leading `oc.env:` (OmegaConf's spelling);
 *      `NAME,DEFAULT` splits at the first comma (both parts stripped). A set variable gives its
 *      value, even when empty; an unset one gives DEFAULT, or is an error without one;
 *   2. then, in the result, every `$NAME` (a letter or `_`, then letters, digits, `_`, and
 *      `.`-separated segments of them) is replaced by the variable's value, or is an error.
 * Values of `_target_` and of keys ending in `_fn` are left alone (AutoModel imports them), and
 * so are keys and the sections am does not read (their values are never used). A replaced value is read like an unquoted one ("none" is null, "8" a number), as
 * AutoModel's translate_value reads it.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node.h"
#include "util.h"

struct buf {
    char *s;
    size_t n, cap;
    bool oom;
};

static void put(struct buf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

/* s[0..n) without surrounding whitespace (Python's str.strip) */
static void strip(const char **s, size_t *n)
{
    while (*n && isspace((unsigned char)**s))
        (*s)++, (*n)--;
    while (*n && isspace((unsigned char)(*s)[*n - 1]))
        (*n)--;
}

static void unset(struct am_errors *err, const struct am_node *v, const char *key, const char *name, size_t name_len,
                  const char *token, size_t token_len)
{
    am_errorf(err, &v->pos, "%s: environment variable '%.*s' is not set (required by '%.*s'; set it, or give a "
              "default: ${%.*s,VALUE})", key, (int)(name_len > 40 ? 40 : name_len), name,
              (int)(token_len > 40 ? 40 : token_len), token, (int)(name_len > 40 ? 40 : name_len), name);
}

static const char *env(const char *name, size_t n)
{
    char var[256];
    if (n == 0 || n >= sizeof(var))
        return NULL;
    memcpy(var, name, n);
    var[n] = '\0';
    return getenv(var);
}

/* Pass 1: ${...}. Returns the number of unset variables. */
static int braced(const char *s, struct buf *out, const struct am_node *v, const char *key, struct am_errors *err)
{
    int bad = 0;
    for (size_t i = 0; s[i];) {
        const char *close = s[i] == '$' && s[i + 1] == '{' ? strchr(s + i + 2, '}') : NULL;
        if (!close || close == s + i + 2) {
            put(out, s + i, 1);
            i++;
            continue;
        }
        const char *expr = s + i + 2, *def = NULL;
        size_t n = (size_t)(close - expr), def_n = 0;
        strip(&expr, &n);
        if (n >= 7 && strncmp(expr, "oc.env:", 7) == 0) {
            expr += 7, n -= 7;
            strip(&expr, &n);
        }
        const char *comma = memchr(expr, ',', n);
        if (comma) {
            def = comma + 1;
            def_n = n - (size_t)(def - expr);
            n = (size_t)(comma - expr);
            strip(&expr, &n);
            strip(&def, &def_n);
        }
        const char *val = env(expr, n);
        if (val)
            put(out, val, strlen(val));
        else if (def)
            put(out, def, def_n);
        else {
            unset(err, v, key, expr, n, s + i, (size_t)(close - (s + i)) + 1);
            bad++;
        }
        i = (size_t)(close - s) + 1;
    }
    return bad;
}

static bool name_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* Pass 2: $NAME and $NAME.SEGMENT... Returns the number of unset variables. */
static int bare(const char *s, struct buf *out, const struct am_node *v, const char *key, struct am_errors *err)
{
    int bad = 0;
    for (size_t i = 0; s[i];) {
        if (s[i] != '$' || !(isalpha((unsigned char)s[i + 1]) || s[i + 1] == '_')) {
            put(out, s + i, 1);
            i++;
            continue;
        }
        size_t j = i + 2;
        while (name_char(s[j]))
            j++;
        while (s[j] == '.' && name_char(s[j + 1])) {
            j++;
            while (name_char(s[j]))
                j++;
        }
        const char *val = env(s + i + 1, j - i - 1);
        if (val)
            put(out, val, strlen(val));
        else {
            unset(err, v, key, s + i + 1, j - i - 1, s + i, j - i);
            bad++;
        }
        i = j;
    }
    return bad;
}

static void resolve(struct am_arena *a, struct am_node *v, const char *key, struct am_errors *err)
{
    struct buf one = {0}, two = {0};
    put(&one, "", 0);
    put(&two, "", 0);
    int bad = braced(v->str, &one, v, key, err);
    if (!one.oom)
        bad += bare(one.s, &two, v, key, err);
    if (one.oom || two.oom) {
        am_errorf(err, &v->pos, "%s: out of memory while replacing environment variables", key);
        v->failed = true;
    } else if (bad)
        v->failed = true;
    else if (strcmp(two.s, v->str) != 0) {
        const char *s = am_arena_strdup(a, two.s);
        if (s) {
            v->str = s;
            v->plain = true;
        }
    }
    free(one.s);
    free(two.s);
}

static void walk(struct am_arena *a, struct am_node *n, const char *path, struct am_errors *err, int depth)
{
    if (depth > AM_YAML_MAX_DEPTH)
        return;
    if (n->kind == AM_NODE_SCALAR) {
        if (n->str && strchr(n->str, '$'))
            resolve(a, n, path, err);
        return;
    }
    for (size_t i = 0; i < n->n; i++) {
        struct am_entry *e = &n->entries[i];
        char sub[256];
        if (n->kind == AM_NODE_MAP) {
            size_t kl = strlen(e->key);
            if (e->value->kind == AM_NODE_SCALAR &&
                (strcmp(e->key, "_target_") == 0 || (kl >= 3 && strcmp(e->key + kl - 3, "_fn") == 0)))
                continue;
            snprintf(sub, sizeof(sub), "%s%s%s", path, *path ? "." : "", e->key);
        } else {
            snprintf(sub, sizeof(sub), "%s", path);
        }
        walk(a, e->value, sub, err, depth + 1);
    }
}

void am_node_resolve_env(struct am_arena *a, struct am_node *root, const char *const *sections,
                         struct am_errors *err)
{
    if (root->kind != AM_NODE_MAP)
        return;
    for (size_t i = 0; i < root->n; i++)
        if (!sections || am_key_in(root->entries[i].key, sections))
            walk(a, root->entries[i].value, root->entries[i].key, err, 1);
}
