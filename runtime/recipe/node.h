/* node.h - a YAML document as a tree that remembers where every value came from.
 *
 * The recipe is parsed with libyaml into maps, sequences and scalars; each node keeps its
 * file:line:column (or the override that set it), so any later check can point at the
 * exact place. Scalars stay text until a typed reader (recipe.c) interprets them; `plain`
 * tells an unquoted `none` (YAML null) from a quoted "none" (a string).
 *
 * All memory lives in the caller's arena. Limits (nesting depth, node count, the arena's
 * size) make every input safe to parse, including hostile ones.
 */
#ifndef AM_NODE_H
#define AM_NODE_H

#include <stdbool.h>
#include <stddef.h>

#include "arena.h"
#include "errors.h"

enum am_node_kind { AM_NODE_SCALAR, AM_NODE_MAP, AM_NODE_SEQ };

struct am_node;

/* A map entry (key set) or a sequence item (key NULL). `used` is set by readers so that
 * unread keys can be reported. */
struct am_entry {
    const char *key;
    struct am_pos key_pos;
    struct am_node *value;
    bool used;
};

struct am_node {
    enum am_node_kind kind;
    struct am_pos pos;
    const char *str; /* scalar text */
    bool plain;      /* scalar written without quotes */
    bool failed;     /* its error is reported already (an unset ${VAR}): readers pass over it */
    struct am_entry *entries;
    size_t n, cap;
};

enum { AM_YAML_MAX_DEPTH = 64, AM_YAML_MAX_NODES = 100000 };

/* Parses one YAML document from buf. `file` names it in positions; `origin`, when not
 * NULL, is stamped on every node instead (for --set values). Returns the root, or NULL
 * with an error appended (syntax error, limits, duplicate key, non-scalar key). An empty
 * document yields an empty map. */
struct am_node *am_yaml_parse(struct am_arena *a, const char *file, const char *origin,
                              const char *buf, size_t len, struct am_errors *err);

/* Child of a map by key, or NULL. Marks the entry used. */
struct am_node *am_node_child(struct am_node *map, const char *key);
/* Entry of a map by key, or NULL (does not mark it used). */
struct am_entry *am_node_entry(struct am_node *map, const char *key);
/* Walks a dotted path ("distributed.pipeline.pp_schedule"); NULL when any step is missing
 * or not a map. Marks nothing. */
struct am_node *am_node_path(struct am_node *root, const char *path);

/* Sets a dotted path to `value`, creating maps on the way. Fails (returns -1 with an
 * error naming `pos`) when a step of the path is a scalar or a sequence, or a key is
 * empty. */
int am_node_set(struct am_arena *a, struct am_node *root, const char *path, struct am_node *value,
                const struct am_pos *pos, struct am_errors *err);

/* Appends an entry to a map or sequence; -1 when the arena is exhausted. */
int am_node_append(struct am_arena *a, struct am_node *n, const char *key, struct am_pos key_pos,
                   struct am_node *value);

/* Replaces ${VAR}, ${VAR,default} and $VAR in the values of the top-level sections named in
 * `sections` (NULL-terminated; NULL: all) with the environment's, as AutoModel's loader does
 * (env.c gives the exact rules); an unset variable without a default is an error naming it, the
 * value's position and key. */
void am_node_resolve_env(struct am_arena *a, struct am_node *root, const char *const *sections,
                         struct am_errors *err);

/* True for a plain null scalar: ~, null, Null, NULL, or empty; also AutoModel's `none`. */
bool am_node_is_null(const struct am_node *n);

#endif

/* Typed reads of a scalar. `key` names the value in messages ("distributed.tp_size").
 * Each returns 0, or -1 with an error naming the position, the key and what was expected.
 * am_node_long accepts whole numbers (also 1e3-style when exact) in [min, max]. */
int am_node_long(const struct am_node *n, const char *key, long min, long max, long *out,
                 struct am_errors *err);
int am_node_double(const struct am_node *n, const char *key, double *out, struct am_errors *err);
int am_node_bool(const struct am_node *n, const char *key, bool *out, struct am_errors *err);
/* A string; -1 for a list or map. */
int am_node_str(const struct am_node *n, const char *key, const char **out, struct am_errors *err);
/* One of `choices` (NULL-terminated); out is its index. The error lists the choices. */
int am_node_choice(const struct am_node *n, const char *key, const char *const *choices, int *out,
                   struct am_errors *err);
