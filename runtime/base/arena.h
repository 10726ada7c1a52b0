/* arena.h - one allocation region per recipe: everything parsed from a recipe lives here and
 * is released with one call, so no error path can leak. A limit bounds the total, so no
 * input (a huge file, a YAML alias bomb) can make the library allocate without bound. */
#ifndef AM_ARENA_H
#define AM_ARENA_H

#include <stddef.h>

struct am_arena_chunk;
struct am_arena {
    struct am_arena_chunk *head;
    size_t total, limit;
};

void am_arena_init(struct am_arena *a, size_t limit);
void am_arena_free(struct am_arena *a);
/* Zeroed memory, or NULL when the limit would be passed or malloc fails. */
void *am_arena_alloc(struct am_arena *a, size_t size);
char *am_arena_strndup(struct am_arena *a, const char *s, size_t n);
char *am_arena_strdup(struct am_arena *a, const char *s);


/* A growable list of strings kept in an arena. */
struct am_list {
    const char **v;
    size_t n, cap;
};
/* Appends s (already in the arena) unless an equal string is present; -1 on no memory. */
int am_list_add(struct am_arena *a, struct am_list *l, const char *s);

#endif
