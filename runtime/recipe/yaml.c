/* yaml.c - libyaml events -> node tree (node.h), with positions, anchors and limits. */
#include <stdio.h>
#include <string.h>
#include <yaml.h>

#include "node.h"

struct anchor {
    const char *name;
    struct am_node *node;
};

struct builder {
    struct am_arena *a;
    const char *file, *origin;
    struct am_errors *err;
    size_t nodes;
    struct anchor *anchors;
    size_t n_anchors, cap_anchors;
    /* open collections, and for maps the pending key */
    struct frame {
        struct am_node *node;
        const char *key;
        struct am_pos key_pos;
    } stack[AM_YAML_MAX_DEPTH + 1];
    int depth;
    struct am_node *root;
};

static struct am_pos pos_at(const struct builder *b, yaml_mark_t m)
{
    return (struct am_pos){.file = b->file, .origin = b->origin, .line = (int)m.line + 1,
                           .col = (int)m.column + 1};
}

static struct am_node *new_node(struct builder *b, enum am_node_kind kind, yaml_mark_t m)
{
    if (++b->nodes > AM_YAML_MAX_NODES) {
        struct am_pos p = pos_at(b, m);
        am_errorf(b->err, &p, "more than %d values: a recipe is far smaller (is this the right file?)",
                  AM_YAML_MAX_NODES);
        return NULL;
    }
    struct am_node *n = am_arena_alloc(b->a, sizeof(*n));
    if (!n) {
        am_errorf(b->err, NULL, "%s: out of memory while reading the recipe", b->file);
        return NULL;
    }
    n->kind = kind;
    n->pos = pos_at(b, m);
    return n;
}

/* A deep copy for an alias, counted against the node limit (so an alias bomb stops). */
static struct am_node *copy_node(struct builder *b, const struct am_node *src, yaml_mark_t m, int depth)
{
    if (depth > AM_YAML_MAX_DEPTH) {
        struct am_pos p = pos_at(b, m);
        am_errorf(b->err, &p, "aliases nest deeper than %d levels", AM_YAML_MAX_DEPTH);
        return NULL;
    }
    struct am_node *n = new_node(b, src->kind, m);
    if (!n)
        return NULL;
    n->pos = src->pos;
    n->str = src->str;
    n->plain = src->plain;
    for (size_t i = 0; i < src->n; i++) {
        struct am_node *v = copy_node(b, src->entries[i].value, m, depth + 1);
        if (!v || am_node_append(b->a, n, src->entries[i].key, src->entries[i].key_pos, v) < 0)
            return NULL;
    }
    return n;
}

static int remember_anchor(struct builder *b, const yaml_char_t *name, struct am_node *n)
{
    if (!name)
        return 0;
    if (b->n_anchors == b->cap_anchors) {
        size_t cap = b->cap_anchors ? 2 * b->cap_anchors : 8;
        struct anchor *v = am_arena_alloc(b->a, cap * sizeof(*v));
        if (!v)
            return -1;
        if (b->n_anchors)
            memcpy(v, b->anchors, b->n_anchors * sizeof(*v));
        b->anchors = v;
        b->cap_anchors = cap;
    }
    b->anchors[b->n_anchors++] = (struct anchor){am_arena_strdup(b->a, (const char *)name), n};
    return 0;
}

/* Attaches a finished node to the open collection (or makes it the root). For a map, the
 * first scalar of each pair is the key. */
static int attach(struct builder *b, struct am_node *n)
{
    if (b->depth == 0) {
        b->root = n;
        return 0;
    }
    struct frame *f = &b->stack[b->depth - 1];
    if (f->node->kind == AM_NODE_SEQ)
        return am_node_append(b->a, f->node, NULL, n->pos, n);
    if (!f->key) {
        if (n->kind != AM_NODE_SCALAR) {
            am_errorf(b->err, &n->pos, "a key must be a plain name, not a %s",
                      n->kind == AM_NODE_MAP ? "mapping" : "list");
            return -1;
        }
        if (am_node_entry(f->node, n->str)) {
            am_errorf(b->err, &n->pos, "key '%s' appears twice in the same section (keep one)", n->str);
            return -1;
        }
        f->key = n->str;
        f->key_pos = n->pos;
        return 0;
    }
    int rc = am_node_append(b->a, f->node, f->key, f->key_pos, n);
    f->key = NULL;
    return rc;
}

static struct am_node *on_alias(struct builder *b, const yaml_event_t *ev)
{
    const char *name = (const char *)ev->data.alias.anchor;
    for (size_t i = b->n_anchors; i-- > 0;)
        if (strcmp(b->anchors[i].name, name) == 0)
            return copy_node(b, b->anchors[i].node, ev->start_mark, 0);
    struct am_pos p = pos_at(b, ev->start_mark);
    am_errorf(b->err, &p, "alias *%s names no anchor defined before it", name);
    return NULL;
}

static int on_event(struct builder *b, const yaml_event_t *ev)
{
    struct am_node *n;
    switch (ev->type) {
    case YAML_SCALAR_EVENT:
        if (!(n = new_node(b, AM_NODE_SCALAR, ev->start_mark)))
            return -1;
        n->str = am_arena_strndup(b->a, (const char *)ev->data.scalar.value, ev->data.scalar.length);
        if (!n->str || strlen(n->str) != ev->data.scalar.length) {
            am_errorf(b->err, &n->pos, "a value contains a NUL byte or memory ran out");
            return -1;
        }
        n->plain = ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
        if (remember_anchor(b, ev->data.scalar.anchor, n) < 0)
            return -1;
        return attach(b, n);
    case YAML_ALIAS_EVENT:
        if (!(n = on_alias(b, ev)))
            return -1;
        return attach(b, n);
    case YAML_SEQUENCE_START_EVENT:
    case YAML_MAPPING_START_EVENT: {
        int map = ev->type == YAML_MAPPING_START_EVENT;
        if (b->depth >= AM_YAML_MAX_DEPTH) {
            struct am_pos p = pos_at(b, ev->start_mark);
            am_errorf(b->err, &p, "sections nest deeper than %d levels", AM_YAML_MAX_DEPTH);
            return -1;
        }
        if (!(n = new_node(b, map ? AM_NODE_MAP : AM_NODE_SEQ, ev->start_mark)))
            return -1;
        const yaml_char_t *anchor = map ? ev->data.mapping_start.anchor : ev->data.sequence_start.anchor;
        if (remember_anchor(b, anchor, n) < 0)
            return -1;
        b->stack[b->depth++] = (struct frame){.node = n};
        return 0;
    }
    case YAML_SEQUENCE_END_EVENT:
    case YAML_MAPPING_END_EVENT:
        n = b->stack[--b->depth].node;
        return attach(b, n);
    default:
        return 0;
    }
}

struct am_node *am_yaml_parse(struct am_arena *a, const char *file, const char *origin,
                              const char *buf, size_t len, struct am_errors *err)
{
    struct builder b = {.a = a, .file = file, .origin = origin, .err = err};
    yaml_parser_t parser;
    if (!yaml_parser_initialize(&parser)) {
        am_errorf(err, NULL, "%s: cannot start the YAML parser (out of memory)", file);
        return NULL;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)buf, len);
    int docs = 0, ok = 1;
    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&parser, &ev)) {
            struct am_pos p = pos_at(&b, parser.problem_mark);
            am_errorf(err, &p, "YAML syntax error: %s%s%s", parser.problem ? parser.problem : "invalid",
                      parser.context ? " " : "", parser.context ? parser.context : "");
            ok = 0;
            break;
        }
        int done = ev.type == YAML_STREAM_END_EVENT;
        if (ev.type == YAML_DOCUMENT_START_EVENT && ++docs > 1) {
            struct am_pos p = pos_at(&b, ev.start_mark);
            am_errorf(err, &p, "a recipe is one YAML document; remove the second '---'");
            ok = 0;
        } else if (on_event(&b, &ev) < 0) {
            ok = 0;
        }
        yaml_event_delete(&ev);
        if (done || !ok)
            break;
    }
    yaml_parser_delete(&parser);
    if (!ok)
        return NULL;
    if (!b.root) { /* empty document */
        struct am_node *n = am_arena_alloc(a, sizeof(*n));
        if (!n)
            return NULL;
        n->kind = AM_NODE_MAP;
        n->pos = (struct am_pos){.file = file, .origin = origin};
        return n;
    }
    return b.root;
}
