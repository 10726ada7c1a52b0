/* arena.c - chunked bump allocator behind arena.h. */
#include "arena.h"

#include <stdlib.h>
#include <string.h>

struct am_arena_chunk {
    struct am_arena_chunk *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
};

enum { CHUNK_MIN = 64 * 1024 };

void am_arena_init(struct am_arena *a, size_t limit)
{
    a->head = NULL;
    a->total = 0;
    a->limit = limit;
}

void am_arena_free(struct am_arena *a)
{
    struct am_arena_chunk *c = a->head;
    while (c) {
        struct am_arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
    a->total = 0;
}

void *am_arena_alloc(struct am_arena *a, size_t size)
{
    size = (size + 15) & ~(size_t)15;
    struct am_arena_chunk *c = a->head;
    if (!c || c->size - c->used < size) {
        size_t want = size > CHUNK_MIN ? size : CHUNK_MIN;
        if (a->total + want > a->limit)
            return NULL;
        c = malloc(sizeof(*c) + want);
        if (!c)
            return NULL;
        c->next = a->head;
        c->used = 0;
        c->size = want;
        a->head = c;
        a->total += want;
    }
    void *p = c->data + c->used;
    c->used += size;
    memset(p, 0, size);
    return p;
}

char *am_arena_strndup(struct am_arena *a, const char *s, size_t n)
{
    char *d = am_arena_alloc(a, n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

char *am_arena_strdup(struct am_arena *a, const char *s) { return am_arena_strndup(a, s, strlen(s)); }

int am_list_add(struct am_arena *a, struct am_list *l, const char *s)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->v[i], s) == 0)
            return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        const char **v = am_arena_alloc(a, cap * sizeof(*v));
        if (!v)
            return -1;
        if (l->n)
            memcpy(v, l->v, l->n * sizeof(*v));
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = s;
    return 0;
}
